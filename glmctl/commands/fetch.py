"""`glmctl fetch`: download checkpoints and drafters from the Hugging Face Hub, verify, record licences."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from glmctl._cli.completion import fetch_targets
from glmctl._cli.options import JsonOpt, QuietOpt, examples


def fetch(
    target: Annotated[
        str | None,
        typer.Argument(autocompletion=fetch_targets, help="A catalogue artifact (glm-5.3-flash, glm-5.3-flash-exl3-4bit, dflash2) or a Hub repo id."),
    ] = None,
    revision: Annotated[str | None, typer.Option("--revision", help="Branch, tag or commit (default: main).")] = None,
    include: Annotated[list[str] | None, typer.Option("--include", help="Only files matching this glob (repeatable).")] = None,
    exclude: Annotated[list[str] | None, typer.Option("--exclude", help="Skip files matching this glob (repeatable).")] = None,
    local_dir: Annotated[Path | None, typer.Option("--local-dir", help="Target directory (default: $GLMCTL_MODELS/NAME).")] = None,
    repo: Annotated[str | None, typer.Option("--repo", help="Repository for a catalogue artifact that has none recorded.")] = None,
    accept_license: Annotated[
        list[str] | None, typer.Option("--accept-license", help="Accept this licence id (repeatable); required for restricted artifacts.")
    ] = None,
    verify: Annotated[Path | None, typer.Option("--verify", help="Verify an existing download in DIR instead of fetching.")] = None,
    repair: Annotated[bool, typer.Option("--repair", help="With --verify: download damaged or missing files again.")] = False,
    offline: Annotated[bool, typer.Option("--offline", help="With --verify: use only the manifest written at download time.")] = False,
    no_hash: Annotated[bool, typer.Option("--no-hash", help="Check presence and sizes only (much faster on 100s of GB).")] = False,
    jobs: Annotated[int, typer.Option("--jobs", min=1, max=64, help="Parallel downloads / hashing threads.")] = 8,
    timeout: Annotated[float, typer.Option(
        "--timeout", min=1, metavar="SECONDS",
        help="Seconds one request to the Hub, or one stalled read of a download, may take.")] = 60.0,
    deadline: Annotated[float, typer.Option(
        "--deadline", min=0, metavar="SECONDS",
        help="Seconds the whole fetch (listing, download, repair) may take (0: no limit).")] = 86_400.0,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Download an artifact (resumable), gate it on its licence, and verify every file.

    Exit 0 only when every file verified; 1 when a file is damaged or missing, nothing could be verified, or the Hub failed; 2 for a bad request, an unknown repository or a licence not accepted; 130 at Ctrl-C (finished files are kept, partial ones resume).
    """
    from glmctl._cli.output import Output
    from glmctl.errors import UsageError
    from glmctl.hub import fetching

    out = Output.from_flags(json_, quiet)
    if verify is not None:
        if target is not None:
            raise UsageError("--verify DIR checks an existing download; do not also name an artifact",
                             hint=f"glmctl fetch --verify {verify}")
        result = fetching.verify_download(verify, offline=offline, hash_contents=not no_hash, jobs=jobs,
                                          repair=repair, feedback=out.feedback(), timeout=timeout, deadline_s=deadline)
    else:
        if target is None:
            raise UsageError("name an artifact or a repo id to fetch", hint="glmctl fetch glm-5.3-flash")
        if repair or offline:
            raise UsageError("--repair and --offline only apply with --verify DIR")
        result = fetching.fetch(target, repo=repo, revision=revision, include=include or [], exclude=exclude or [],
                                local_dir=local_dir, accept=accept_license or [], hash_contents=not no_hash,
                                jobs=jobs, feedback=out.feedback(_terminal_confirm(out)), timeout=timeout,
                                deadline_s=deadline)
    out.result(result, render=lambda console: fetching.render(result, console))
    if not result.verify.ok:
        raise typer.Exit(1)



def _terminal_confirm(out):
    """The operator types the licence id to accept it; None where nobody can be asked."""
    if not (sys.stdin.isatty() and out.human):
        return None
    return lambda lic: input(f"Type the licence id ({lic.id}) to accept it: ").strip() == lic.id


fetch.epilog = examples(
    "glmctl fetch glm-5.3-flash --local-dir /models/glm-5.3-flash",
    "glmctl fetch dflash2 --accept-license dflash2-cc-by-nc-nd-4.0",
    "glmctl fetch --verify /models/glm-5.3-flash --repair",
)
