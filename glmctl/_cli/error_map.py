"""Exception-to-message mapping, applied once around the whole CLI (`glmctl.app.main`)."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable


def _debug() -> bool:
    from glmctl import switches

    return switches.read("GLMCTL_DEBUG")


def _say(prefix: str, message: str, hint: str | None, offer_traceback: bool = True) -> None:
    from rich.console import Console
    from rich.markup import escape

    # soft_wrap: a message is never broken mid-sentence by hard newlines (grep-able, copy-pasteable)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    # escape(): messages carry paths, globs and extras like 'glmctl[gpu]' that Rich would eat as markup
    err.print(f"[bold red]{prefix}:[/bold red] {escape(message)}", markup=True)
    if hint:
        err.print(f"[bold]hint:[/bold] {escape(hint)}")
    if offer_traceback and not _debug():  # a usage error is fixed from its sentence, not a traceback
        err.print("[dim](set GLMCTL_DEBUG=1 for the traceback)[/dim]")


def _exit_now(code: int) -> None:
    """Exit without joining worker threads (Python waits for every pool worker at exit)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def run_guarded(entry: Callable[[], object]) -> int:
    """Run the CLI; turn known failures into a message and an exit code.

    GlmctlError -> its exit_code (1 runtime, 2 usage/config); KeyboardInterrupt -> 130;
    anything else -> 1 with "unexpected error". GLMCTL_DEBUG=1 prints the traceback too.
    An error that says `abandon_threads` (work in flight that cannot be cancelled, such as
    huggingface_hub's transfers) ends the process at once instead of waiting for those threads.
    """
    from glmctl.errors import GlmctlError

    try:
        entry()
    except SystemExit as exc:  # click / typer exit paths (usage errors exit 2 there)
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except GlmctlError as exc:
        if _debug():
            traceback.print_exc()
        _say("error", exc.message, exc.hint, offer_traceback=exc.exit_code not in (2, 130))
        if getattr(exc, "abandon_threads", False):
            _exit_now(exc.exit_code)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the last line of defence
        if _debug():
            traceback.print_exc()
        _say("unexpected error", f"{type(exc).__name__}: {exc}", "please report this with the traceback")
        return 1
    return 0
