"""The rank simulation's profile summary: iterations from the mHC marker, every kernel tabled."""

from __future__ import annotations

import gzip
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from rank_sim_profile import breakdown  # noqa: E402


def _trace(path: Path, steps: int, layers: int) -> None:
    events, ts = [], 0.0
    for _ in range(steps):
        for _ in range(2 * layers):
            for name, dur in (("_mix_partials_kernel", 3.0), ("_mix_finalize_kernel", 2.0),
                              ("exl3_moe_coop_a_kernel", 10.0), ("mystery_small", 0.5)):
                events.append({"cat": "kernel", "ph": "X", "name": name, "ts": ts, "dur": dur})
                ts += dur + 0.1
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_iterations_and_table(tmp_path):
    since = time.time() - 10
    _trace(tmp_path / "rank0.pt.trace.json.gz", steps=3, layers=2)
    old = time.time() - 5  # written out: breakdown waits for a trace older than 3 s
    import os
    os.utime(tmp_path / "rank0.pt.trace.json.gz", (old, old))
    b = breakdown(tmp_path, steps=10, layers=2, since=since, wait_s=5)
    assert b["iterations"] == 3  # from the marker, not the profiler's limit of 10
    table = {r["name"]: r for r in b["kernels_table"]}
    assert table["exl3_moe_coop_a_kernel"]["kind"] == "routed_experts"
    assert table["exl3_moe_coop_a_kernel"]["calls_per_iteration"] == 4
    assert table["exl3_moe_coop_a_kernel"]["us_per_iteration"] == 40.0
    assert table["mystery_small"]["kind"] == "other"  # 2.0 us per iteration: above the floor
    assert b["us_per_iteration"]["norms_mhc"] == 20.0
