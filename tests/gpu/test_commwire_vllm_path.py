"""glmctl's host-staged collectives as vLLM 0.30 uses them, on 2 and 4 processes sharing one GPU:
out-of-place all-reduce (exact fp32-in-rank-order sums in bf16; INT8 for prefill-size messages,
in pieces above max_bytes), the logits gather and token-id gathers (bit-exact), and all-reduces
captured into CUDA graphs inside `ca_comm.capture()` and replayed with fresh inputs."""

from __future__ import annotations

import os

import pytest

from glmctl.collectives.harness import run_ranks
from tests.gpu.commwire_workers import vllm_path

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("world", [2, 4])
def test_the_vllm_call_path_is_exact_and_replays(world):
    results = run_ranks(vllm_path, world, 50, timeout_s=120)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error}"
    values = [r.value for r in results]
    v = values[0]
    for name, row in v["eager"].items():
        assert row.get("exact", row.get("ok")), (name, row)
    assert v["graph"]["bad"] == 0 and v["graph"]["exact"] == v["graph"]["replays"], v["graph"]
    for other in values[1:]:
        assert other["checksums"] == v["checksums"]  # every rank holds the same bits
        assert other["graph"] == v["graph"]
    assert all(x["closed"] for x in values)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("glmctl-coll-h")]
    print(f"world {world}: {v['eager']}, graph {v['graph']}")
