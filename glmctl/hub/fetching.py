"""`glmctl fetch` as a library: fetch an artifact end to end, or verify (and repair) a download."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel

from glmctl._cli.output import Output
from glmctl.errors import UsageError
from glmctl.hub import download as dl
from glmctl.hub.catalog import resolve
from glmctl.hub.manifest import ExpectedFile, read_manifest
from glmctl.hub.verify import VerifyReport, check_files, check_structure


class FetchResult(BaseModel):
    artifact: str
    repo_id: str | None
    revision: str | None
    local_dir: str
    license: str | None
    downloaded_bytes: int
    repaired: list[str] = []
    verify: VerifyReport


def models_dir() -> Path:
    if env := os.environ.get("GLMCTL_MODELS"):
        return Path(env)
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "glmctl" / "models"


def fetch(target: str, *, repo: str | None, revision: str | None, include: list[str], exclude: list[str],
          local_dir: Path | None, accept: list[str], hash_contents: bool, jobs: int, out: Output) -> FetchResult:
    artifact = resolve(target, repo)
    local_dir = (local_dir or models_dir() / artifact.name).expanduser().resolve()
    plan = dl.plan_fetch(artifact, local_dir, revision, include or None, exclude)
    out.note(f"{artifact.repo_id}@{plan.revision[:10]}: {len(plan.files)} files, "
             f"{plan.bytes_total / 2**30:,.2f} GiB, {plan.bytes_to_download / 2**30:,.2f} GiB to download -> {local_dir}")
    from glmctl.hub.license_gate import require_license

    require_license(artifact.license, accept=accept, artifact=artifact.name, record_dir=local_dir, out=out)
    dl.check_disk(plan)
    if plan.bytes_to_download:
        dl.download(plan, max_workers=jobs, show_progress=out.human)
    dl.record_manifest(plan, artifact.license)
    report = _verify(local_dir, plan.files, source="hub", revision=plan.revision,
                     hash_contents=hash_contents, jobs=jobs, out=out)
    return FetchResult(artifact=artifact.name, repo_id=artifact.repo_id, revision=plan.revision,
                       local_dir=str(local_dir), license=artifact.license,
                       downloaded_bytes=plan.bytes_to_download, verify=report)


def verify_download(local_dir: Path, *, offline: bool, hash_contents: bool, jobs: int, repair: bool,
                    out: Output) -> FetchResult:
    local_dir = local_dir.expanduser().resolve()
    if not local_dir.is_dir():
        raise UsageError(f"{local_dir} is not a directory", hint="glmctl fetch --verify DIR names a download directory")
    manifest = read_manifest(local_dir)
    expected: list[ExpectedFile] = manifest.files if manifest else []
    source, revision = ("manifest" if manifest else "none"), (manifest.revision if manifest else None)
    if manifest and not offline:
        try:
            revision, listed = dl.list_remote(manifest.repo_id, manifest.revision, [], [])
            wanted = {f.path for f in manifest.files}
            expected, source = [f for f in listed if f.path in wanted], "hub"
        except dl.HubError as exc:
            out.warn(f"{exc.message}; verifying against the manifest written at download time")
    if not manifest:
        out.warn(f"no glmctl manifest in {local_dir}: only structure (headers, index, config) can be checked")
    report = _verify(local_dir, expected, source=source, revision=revision,
                     hash_contents=hash_contents, jobs=jobs, out=out)
    repaired: list[str] = []
    if repair and report.bad_files:
        if not manifest:
            raise UsageError("cannot repair without a manifest (the repository is unknown)",
                             hint="fetch it again: glmctl fetch REPO --local-dir DIR")
        repaired = [f.path for f in report.bad_files if f.path in {e.path for e in expected}]
        out.note(f"repairing {len(repaired)} files: {', '.join(repaired)}")
        dl.redownload(manifest.repo_id, manifest.revision, local_dir, repaired, show_progress=out.human)
        report = _verify(local_dir, expected, source=source, revision=revision,
                         hash_contents=hash_contents, jobs=jobs, out=out)
    return FetchResult(artifact=manifest.artifact if manifest else local_dir.name,
                       repo_id=manifest.repo_id if manifest else None, revision=revision,
                       local_dir=str(local_dir), license=manifest.license if manifest else None,
                       downloaded_bytes=0, repaired=repaired, verify=report)


def _verify(local_dir: Path, expected: list[ExpectedFile], *, source: str, revision: str | None,
            hash_contents: bool, jobs: int, out: Output) -> VerifyReport:
    with out.progress() as bar:
        files = check_files(local_dir, expected, hash_contents=hash_contents, jobs=jobs, progress=bar)
    headers, problems = check_structure(local_dir)
    by_path = {f.path: f for f in files}
    for h in headers:  # a bad header outranks "ok" from size checks; hash mismatches stay as they are
        if by_path.get(h.path) is None or by_path[h.path].status == "ok":
            by_path[h.path] = h
    return VerifyReport(directory=str(local_dir), source=source, revision=revision, hashed=hash_contents,
                        files=list(by_path.values()), problems=problems)


def render(result: FetchResult, console) -> None:
    from rich.table import Table

    report = result.verify
    title = f"{result.artifact} ({result.repo_id or 'unknown repo'}@{(result.revision or '?')[:10]}) in {result.local_dir}"
    table = Table(title=title, show_lines=False)
    for col in ("file", "status", "size", "detail"):
        table.add_column(col)
    bad = report.bad_files
    rows = bad if len(report.files) > 25 else report.files
    for f in rows:
        style = "green" if f.status == "ok" else "red"
        size = f"{(f.actual_size or f.expected_size or 0) / 2**20:,.1f} MiB"
        table.add_row(f.path, f"[{style}]{f.status}[/{style}]", size, f.detail)
    console.print(table)
    ok = len(report.files) - len(bad)
    how = "sizes and SHA-256/git ids" if report.hashed else "sizes only (--no-hash)"
    console.print(f"{ok}/{len(report.files)} files ok ({how}, against the {report.source}).")
    for p in report.problems:
        console.print(f"[red]problem:[/red] {p}")
    if result.repaired:
        console.print(f"repaired: {', '.join(result.repaired)}")
    if report.ok:
        console.print("[green]verified[/green]")
    else:
        console.print("[red]NOT verified[/red]: run `glmctl fetch --verify DIR --repair` to download damaged files again")
