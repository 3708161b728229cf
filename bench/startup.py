#!/usr/bin/env python3
"""Start-up time of `glmctl --help` next to a bare `python -c pass` (target: glmctl under 0.3 s).

    python bench/startup.py [--runs 15] [--json]

Prints the median wall time of each over N runs and the ratio measured/limit for glmctl's
extra start-up cost (glmctl --help minus bare interpreter) against 0.3 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

LIMIT_S = 0.3


def _median_s(argv: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    bare = _median_s([sys.executable, "-c", "pass"], args.runs)
    help_ = _median_s([sys.executable, "-m", "glmctl", "--help"], args.runs)
    row = {
        "python_bare_s": round(bare, 4),
        "glmctl_help_s": round(help_, 4),
        "glmctl_extra_s": round(help_ - bare, 4),
        "limit_s": LIMIT_S,
        "ratio_help_over_limit": round(help_ / LIMIT_S, 3),
        "runs": args.runs,
        "method": "median wall time of subprocess runs on this machine",
    }
    if args.json:
        print(json.dumps(row, indent=2))
    else:
        print(f"python -c pass     {bare * 1000:7.1f} ms")
        print(f"glmctl --help      {help_ * 1000:7.1f} ms   (measured/limit {row['ratio_help_over_limit']:.2f} of {LIMIT_S * 1000:.0f} ms)")
        print(f"glmctl extra cost  {(help_ - bare) * 1000:7.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
