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
        # block 1024: vLLM 0.30 cannot lay out the tiny checkpoint's bf16 KV at its default 512
        ("KV plan for the tiny checkpoint on this CPU",
         ["plan", "--model", str(tiny), "--cpu", "--block-size", "1024"]),
        ("KV plan for GLM-5.3-Flash on the reference node (8x L40, commercial setup)",
         ["plan", "--model", "glm-5.3-flash", "--gpus", "8xL40", "--tp", "8", "--experts", "exl3:4",
          "--kda", "fp8", "--kv-cache-dtype", "fp8", "--speculative", "mtp:3", "--max-num-seqs", "8"]),
        ("The report's five KV pools on 8x L40: planner predictions vs measurements",
         ["plan", "--reproduce-report"]),
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
