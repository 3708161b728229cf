#!/usr/bin/env python3
"""`make demo`: the main job on the embedded default (the tiny checkpoint, served on CPU).

Each step is the real `glmctl` command a user would type; the demo stops at the first failure.
Later steps (serve, eval, bench) are added as those commands land.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GLMCTL = [sys.executable, "-m", "glmctl"]


def steps(tiny: Path) -> list[tuple[str, list[str]]]:
    return [
        ("KV plan for the tiny checkpoint on this CPU", ["plan", "--model", str(tiny), "--cpu"]),
        ("KV plan for GLM-5.3-Flash on the reference node (8x L40, commercial setup)",
         ["plan", "--model", "glm-5.3-flash", "--gpus", "8xL40", "--tp", "8"]),
    ]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", type=Path, required=True)
    args = ap.parse_args()
    for title, argv in steps(args.tiny):
        print(f"\n==> {title}\n$ glmctl {shlex.join(argv)}", flush=True)
        code = subprocess.call([*GLMCTL, *argv], cwd=ROOT)
        if code != 0:
            print(f"demo step failed with exit code {code}: glmctl {shlex.join(argv)}", file=sys.stderr)
            return code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
