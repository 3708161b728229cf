#!/usr/bin/env python3
"""Generate completions/glmctl.{bash,zsh,fish} from the real CLI (Typer/Click's own scripts).

    python scripts/gen_completions.py --write    # regenerate the files
    python scripts/gen_completions.py --check    # exit 1 if a file differs (used by the tests)

The scripts call back into `glmctl` with _GLMCTL_COMPLETE set; that path imports no torch/vllm.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHELLS = {"bash": "glmctl.bash", "zsh": "glmctl.zsh", "fish": "glmctl.fish"}


def render(shell: str) -> str:
    from typer._completion_shared import get_completion_script

    return get_completion_script(prog_name="glmctl", complete_var="_GLMCTL_COMPLETE", shell=shell).rstrip() + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    stale = []
    for shell, name in SHELLS.items():
        path = ROOT / "completions" / name
        text = render(shell)
        if args.write:
            path.parent.mkdir(exist_ok=True)
            path.write_text(text)
        elif not path.exists() or path.read_text() != text:
            stale.append(str(path.relative_to(ROOT)))
    if stale:
        print("stale completion scripts (run `make completions`): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
