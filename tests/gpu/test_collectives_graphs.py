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


@pytest.mark.parametrize("world", [2, 4])
def test_direct_two_shot_int8_in_graphs_with_ranks_as_threads(world):
    """INT8 all-reduce on the direct path's two shots, ranks as threads of this process on one GPU
    (the thread rig's `Rig`, bench/gpu/collectives_threads.py): each size captured as one graph
    of 20 calls, replayed 6 times (the epochs walk both parities many times over). The rig's
    #wrong counts every element of a result over 1% relative RMS error from the exact sum, and
    every element not bitwise equal to rank 0's."""
    import sys

    from glmctl.collectives.call_plan import CopyEngines
    from tests.conftest import REPO

    sys.path.insert(0, str(REPO / "bench" / "gpu"))
    import collectives_threads as threads

    rig = threads.Rig(world, 4 << 20, CopyEngines())
    try:
        for numel in (4096, 4 * 4096, 32 * 4096, 3 * 4096 + 5):  # 1, 4, 32 tokens; odd
            res = rig.run(threads.Case("all_reduce", "int8", numel))
            bad = [r for r in res if not r or "error" in r]
            assert not bad, (numel, bad)
            row = res[0]
            assert row["algorithm"] == "direct_2s", (numel, row)
            assert row["wrong"] == 0 and row["rel_err"] <= 0.01, (numel, row)
            print(f"world {world}, {numel * 2} B INT8 direct_2s: {max(r['us'] for r in res):.1f} us "
                  f"per call, rel RMS {100 * row['rel_err']:.2f}%")
    finally:
        rig.close()
