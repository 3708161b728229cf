"""`glmctl fetch` as a library: fetch an artifact end to end, or verify (and repair) a download.

The Hub work runs on a worker thread under the fetch's deadline. When the deadline passes, or
Ctrl-C arrives, the caller gets `FetchAbandoned` at once: finished files are complete and partial
ones resume on the next fetch, so nothing is gained by waiting for transfers in flight (which
huggingface_hub cannot cancel); the CLI exits without joining them.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel

from glmctl import switches
from glmctl.errors import GlmctlError, UsageError
from glmctl.feedback import QUIET, Feedback
from glmctl.hub import download as dl
from glmctl.hub.artifact_check import VerifyReport, check_files, check_structure
from glmctl.hub.catalog import resolve
from glmctl.hub.manifest import ExpectedFile, read_manifest

T = TypeVar("T")
DEFAULT_DEADLINE_S = 86_400.0


class FetchAbandoned(GlmctlError):
    """The fetch stopped (deadline or Ctrl-C) with transfers in flight; they are not waited for."""

    abandon_threads = True

    def __init__(self, message: str, hint: str | None = None, exit_code: int = 1) -> None:
        super().__init__(message, hint)
        self.exit_code = exit_code


class FetchDeadline:
    """The end of the whole fetch; `seconds` None (or 0): no limit."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds or None
        self._end = None if self.seconds is None else time.monotonic() + self.seconds

    def remaining(self) -> float | None:
        return None if self._end is None else max(0.0, self._end - time.monotonic())


def bounded(work: Callable[[], T], deadline: FetchDeadline, what: str, *, budget_s: float | None = None) -> T:
    """Run `work` on a worker thread and return its result or raise its error; FetchAbandoned when
    the deadline (or the smaller `budget_s`) passes, or at Ctrl-C."""
    done = threading.Event()
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = work()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = exc
        finally:
            done.set()

    left = deadline.remaining()
    wait = budget_s if left is None or (budget_s is not None and budget_s < left) else left
    threading.Thread(target=run, name="glmctl-fetch", daemon=True).start()
    try:
        finished = done.wait(wait)
    except KeyboardInterrupt:
        raise FetchAbandoned(f"interrupted while {what}",
                             hint="finished files are kept and partial ones resume: run the same command again",
                             exit_code=130) from None
    if not finished:
        limit = (f"its --deadline of {deadline.seconds:,.0f} s" if wait == left
                 else f"{wait:,.0f} s")
        raise FetchAbandoned(f"{what} did not finish within {limit}",
                             hint="finished files are kept and partial ones resume: run the same command "
                                  "again, with a larger --deadline (0: no limit) on a slow link")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


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
    if env := switches.read("GLMCTL_MODELS"):
        return env
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "glmctl" / "models"


def fetch(target: str, *, repo: str | None, revision: str | None, include: list[str], exclude: list[str],
          local_dir: Path | None, accept: list[str], hash_contents: bool, jobs: int,
          feedback: Feedback = QUIET, timeout: float = dl.DEFAULT_TIMEOUT_S,
          deadline_s: float | None = DEFAULT_DEADLINE_S) -> FetchResult:
    from glmctl.hub.fetch_license_gate import decide_license

    artifact = resolve(target, repo)
    local_dir = (local_dir or models_dir() / artifact.name).expanduser().resolve()
    # The licence is the catalogue's: refused before the network is asked anything, recorded once the
    # listing proves the repository is there.
    licence = decide_license(artifact.license, accept=accept, artifact=artifact.name, record_dir=local_dir,
                             feedback=feedback)
    deadline = FetchDeadline(deadline_s)
    plan = bounded(lambda: dl.plan_fetch(artifact, local_dir, revision, include or None, exclude, timeout),
                   deadline, f"listing {artifact.repo_id} on the Hub")
    feedback.note(f"{artifact.repo_id}@{plan.revision[:10]}: {len(plan.files)} files, "
             f"{plan.bytes_total / 2**30:,.2f} GiB, {plan.bytes_to_download / 2**30:,.2f} GiB to download -> {local_dir}")
    dl.check_disk(plan)
    licence.record(artifact=artifact.name, record_dir=local_dir,
                             feedback=feedback)
    if plan.bytes_to_download:
        bounded(lambda: dl.download(plan, max_workers=jobs, show_progress=feedback.bars, timeout=timeout),
                deadline, f"downloading {artifact.repo_id}")
    dl.record_manifest(plan, artifact.license)
    report = _verify(local_dir, plan.files, source="hub", revision=plan.revision,
                     hash_contents=hash_contents, jobs=jobs, feedback=feedback)
    return FetchResult(artifact=artifact.name, repo_id=artifact.repo_id, revision=plan.revision,
                       local_dir=str(local_dir), license=artifact.license,
                       downloaded_bytes=plan.bytes_to_download, verify=report)


def verify_download(local_dir: Path, *, offline: bool, hash_contents: bool, jobs: int, repair: bool,
                    feedback: Feedback = QUIET, timeout: float = dl.DEFAULT_TIMEOUT_S,
                    deadline_s: float | None = DEFAULT_DEADLINE_S) -> FetchResult:
    local_dir = local_dir.expanduser().resolve()
    if not local_dir.is_dir():
        raise UsageError(f"{local_dir} is not a directory", hint="glmctl fetch --verify DIR names a download directory")
    manifest = _read_manifest(local_dir)
    deadline = FetchDeadline(deadline_s)
    expected: list[ExpectedFile] = manifest.files if manifest else []
    source, revision = ("manifest" if manifest else "none"), (manifest.revision if manifest else None)
    if manifest and not offline:
        try:
            # a Hub that cannot list the files soon is no reason not to verify: the manifest can
            revision, listed = bounded(lambda: dl.list_remote(manifest.repo_id, manifest.revision, [], [], timeout),
                                       deadline, f"listing {manifest.repo_id} on the Hub", budget_s=2 * timeout)
            wanted = {f.path for f in manifest.files}
            expected, source = [f for f in listed if f.path in wanted], "hub"
        except (dl.HubError, FetchAbandoned) as exc:
            if isinstance(exc, FetchAbandoned) and exc.exit_code == 130:
                raise
            feedback.warn(f"{exc.message}; verifying against the manifest written at download time")
    if not manifest:
        feedback.warn(f"no glmctl manifest in {local_dir}: only structure (headers, index, config) can be checked")
    report = _verify(local_dir, expected, source=source, revision=revision,
                     hash_contents=hash_contents, jobs=jobs, feedback=feedback)
    repaired: list[str] = []
    if repair and report.bad_files:
        if not manifest:
            raise UsageError("cannot repair without a manifest (the repository is unknown)",
                             hint="fetch it again: glmctl fetch REPO --local-dir DIR")
        by_path = {e.path: e for e in expected}
        damaged = [by_path[f.path] for f in report.bad_files if f.path in by_path]
        feedback.note(f"repairing {len(damaged)} files: {', '.join(f.path for f in damaged)}")
        repaired = bounded(lambda: dl.redownload(manifest.repo_id, manifest.revision, local_dir, damaged,
                                                 show_progress=feedback.bars, timeout=timeout),
                           deadline, f"repairing {local_dir}")
        report = _verify(local_dir, expected, source=source, revision=revision,
                         hash_contents=hash_contents, jobs=jobs, feedback=feedback)
    return FetchResult(artifact=manifest.artifact if manifest else local_dir.name,
                       repo_id=manifest.repo_id if manifest else None, revision=revision,
                       local_dir=str(local_dir), license=manifest.license if manifest else None,
                       downloaded_bytes=0, repaired=repaired, verify=report)


def _read_manifest(local_dir: Path):
    from pydantic import ValidationError

    try:
        return read_manifest(local_dir)
    except (ValueError, ValidationError, OSError) as exc:
        raise UsageError(f"the glmctl manifest in {local_dir} is unreadable ({type(exc).__name__})",
                         hint=f"remove {local_dir}/.glmctl/manifest.json to verify structure only, or fetch "
                              "the artifact again") from exc


def _verify(local_dir: Path, expected: list[ExpectedFile], *, source: str, revision: str | None,
            hash_contents: bool, jobs: int, feedback: Feedback = QUIET) -> VerifyReport:
    with feedback.progress() as bar:
        files = check_files(local_dir, expected, hash_contents=hash_contents, jobs=jobs, progress=bar)
    headers, problems = check_structure(local_dir)
    if not expected and not any(local_dir.glob("*.safetensors")):
        problems.append(f"nothing to verify in {local_dir}: no glmctl manifest lists its files and it holds no "
                        "safetensors shard")
    by_path = {f.path: f for f in files}
    for h in headers:  # a bad header outranks "ok" from size checks; hash mismatches stay as they are
        if by_path.get(h.path) is None or by_path[h.path].status == "ok":
            by_path[h.path] = h
    return VerifyReport(directory=str(local_dir), source=source, revision=revision, hashed=hash_contents,
                        files=list(by_path.values()), problems=problems)


def render(result: FetchResult, console) -> None:
    from rich.markup import escape
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
        table.add_row(escape(f.path), f"[{style}]{f.status}[/{style}]", size, escape(f.detail))
    console.print(table)
    ok = len(report.files) - len(bad)
    how = "sizes and SHA-256/git ids" if report.hashed else "sizes only (--no-hash)"
    console.print(f"{ok}/{len(report.files)} files ok ({how}, against the {report.source}).")
    for p in report.problems:
        console.print(f"[red]problem:[/red] {escape(p)}")
    if result.repaired:
        console.print(f"repaired: {', '.join(result.repaired)}")
    if report.ok:
        console.print("[green]verified[/green]")
    elif report.source == "none":
        console.print("[red]NOT verified[/red]: without a glmctl manifest the files cannot be repaired here; "
                      "fetch the artifact again with glmctl fetch")
    elif bad:
        console.print("[red]NOT verified[/red]: run "
                      f"`glmctl fetch --verify {escape(result.local_dir)} --repair` to download damaged files again")
    else:
        console.print("[red]NOT verified[/red]")
