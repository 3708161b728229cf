"""Host-staged all-reduce / all-gather across 2 and 4 processes sharing one GPU: every dtype, sizes
from 1 KB to 256 MB (odd ones too), both copy paths, the direct path (LL words, one and two native
shots, and the default for the rank count), fresh random data, against fp64 sums or exact concatenation;
every rank's output bitwise equal to every other's."""

from __future__ import annotations

import os

import pytest

from glmctl.collectives.harness import run_ranks
from tests.gpu.collectives_workers import DTYPES, MiB, correctness

pytestmark = pytest.mark.gpu


def _cases(world: int) -> list[dict]:
    cases = []
    small = [1024 + 6, 4096, 64 * 1024 + 2, 2 * MiB + 2 * 333, 8 * MiB]  # bytes (bf16); odd counts
    for nbytes in small:
        for dtype in DTYPES:
            eb = 4 if dtype == "float32" else 2
            numel = max(1, nbytes // eb)
            for engines in ("ce", "sm"):
                base = {"dtype": dtype, "numel": numel, "engines": engines}
                cases.append({**base, "op": "all_reduce", "int8": False})
                cases.append({**base, "op": "all_reduce", "int8": True})
                shape, dim = ([numel], 0) if numel % 8 else ([8, numel // 8], -1)
                cases.append({**base, "op": "all_gather", "int8": False, "shape": shape, "dim": dim})
                cases.append({**base, "op": "all_gather", "int8": True, "shape": shape, "dim": dim})
            if nbytes <= 64 * 1024 + 2:  # the direct path, every way
                for kind in ("ll", "1s", "2s", "default"):
                    base = {"dtype": dtype, "numel": numel, "engines": "auto", "direct": kind}
                    cases.append({**base, "op": "all_reduce", "int8": False})
                    shape, dim = ([numel], 0) if numel % 8 else ([8, numel // 8], -1)
                    cases.append({**base, "op": "all_gather", "int8": False, "shape": shape,
                                  "dim": dim})
            if world > 2 and nbytes < 64 * 1024:  # reduce-scatter + all-gather at tiny sizes too
                for int8 in (False, True):
                    cases.append({"dtype": dtype, "numel": numel, "engines": "ce", "op": "all_reduce",
                                  "int8": int8, "one_shot_max_bytes": 0})
    for nbytes in (2 * MiB + 666, 8 * MiB):  # the copy engine both ways
        numel = nbytes // 2
        base = {"dtype": "bfloat16", "numel": numel, "engines": "ce"}
        for int8 in (False, True):
            cases.append({**base, "op": "all_reduce", "int8": int8})
            shape, dim = ([numel], 0) if numel % 8 else ([8, numel // 8], -1)
            cases.append({**base, "op": "all_gather", "int8": int8, "shape": shape, "dim": dim})
    for nbytes in (64 * MiB, 256 * MiB):  # bf16 only, the calibrated copy paths
        numel = nbytes // 2 - 3
        ar = {"dtype": "bfloat16", "numel": numel, "engines": "auto", "op": "all_reduce"}
        cases += [{**ar, "int8": False}, {**ar, "int8": True}]
        m = numel // world  # all-gather: the output is the large message
        ag = {"dtype": "bfloat16", "numel": m, "engines": "auto", "op": "all_gather", "shape": [m],
              "dim": 0}
        cases += [{**ag, "int8": False}, {**ag, "int8": True}]
    return cases


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_match_fp64_and_agree_bitwise(world):
    cases = _cases(world)
    results = run_ranks(correctness, world, cases, 256 * MiB, timeout_s=420)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error}"
    per_rank = [r.value for r in results]
    bad = [(c, row) for c, row in zip(cases, per_rank[0], strict=True) if not row["ok"]]
    assert not bad, f"{len(bad)} cases off; first: {bad[0]}"
    for rank_rows in per_rank[1:]:
        for c, a, b in zip(cases, per_rank[0], rank_rows, strict=True):
            assert a["checksum"] == b["checksum"], f"ranks disagree bitwise on {c}"
            assert b["ok"], (c, b)
    rows = per_rank[0]
    assert {r["algorithm"] for r in rows} >= ({"one_shot", "gather", "two_shot", "direct_ll",
                                              "direct_1s", "direct_2s"} if world > 2 else
                                             {"one_shot", "gather", "direct_ll", "direct_1s",
                                              "direct_2s"})
    assert {(r["d2h"], r["h2d"]) for r in rows} >= {("ce", "ce"), ("sm", "sm")}
    assert all(r["in_place"] for c, r in zip(cases, rows, strict=True) if c["op"] == "all_reduce")
    worst_int8 = max(r["err"] for c, r in zip(cases, rows, strict=True) if c["int8"])
    print(f"world {world}: {len(cases)} cases, worst INT8 relative RMS error {worst_int8:.4f}")
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("glmctl-coll-h")]
