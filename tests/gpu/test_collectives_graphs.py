"""1,000 replays of one captured CUDA graph holding six host-staged collectives (the direct path and
the barrier paths), with fresh inputs before every replay: every replay right, every rank bitwise
equal."""

from __future__ import annotations

import pytest

from glmctl.collectives.harness import run_ranks
from tests.gpu.collectives_workers import graph_replays

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("world", [2, 4])
def test_one_thousand_graph_replays(world):
    results = run_ranks(graph_replays, world, 1000, timeout_s=300)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error}"
    values = [r.value for r in results]
    names = ("direct one-shot bf16", "direct one- or two-shot bf16", "one- or two-shot bf16",
             "INT8 all-reduce", "all-gather fp16 (LL)", "INT8 all-gather")
    for name, worst in zip(names, values[0]["worst"], strict=True):
        # native all-reduce: within one bf16 ulp of the fp64 sum; all-gather: exact;
        # INT8: relative RMS error within 1% (the worst values are normalised so that 1.0 is the bar)
        assert worst <= (0.0 if name.startswith("all-gather fp16") else 1.0), (name, worst)
    for v in values[1:]:
        assert v["checksums"] == values[0]["checksums"]
    print(f"world {world}: {values[0]['replays']} replays in {values[0]['seconds']:.1f} s, "
          f"worst {values[0]['worst']}")
