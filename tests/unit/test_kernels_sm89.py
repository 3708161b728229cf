"""Every shipped and every benchmarked kernel configuration fits Ada: cross-compiled for sm_89 on
this (GPU-less) machine with ``triton.compile``, it needs <= 99 KB of shared memory per block,
uses no Hopper ``wgmma`` and spills no registers (SASS local loads/stores, where Triton ships
``cuobjdump``; the prefill entries, unchanged from their measured state, are reported, not
held to it). Runs in a fresh process (the unit lane's other kernel tests load the kernels into
the Triton interpreter, which cannot compile)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SM89_SHARED_LIMIT = 99 * 1024


@pytest.mark.slow
def test_every_shipped_config_fits_sm89():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    result = subprocess.run(
        [sys.executable, "-m", "glmctl.kernels.sm89_check"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert rows, result.stderr[-3000:]
    names = {row["kernel"].split("[")[0] for row in rows}
    assert names >= {"sparse_mla", "sparse_mla_heads_n", "sparse_mla_combine", "mla_cache_write",
                     "indexer_logits_paged", "indexer_logits_ragged", "kpool_topk",
                     "kpool_topk_slices", "kpool_topk_threshold", "mhc_mix_partials", "mhc_mix_finalize",
                     "mhc_block",
                     "fp8_block_linear", "fp8_block_linear_reduce",
                     "direct_int8_publish", "direct_int8_collect"}
    # Every cache layout's attention and cache-write kernels are among them.
    kernels = {row["kernel"] for row in rows}
    for fmt in ("bf16", "fp8", "fp8_ds_mla"):
        assert any(k.startswith(f"sparse_mla[{fmt} ") for k in kernels), fmt
    assert {"mla_cache_write[fp8]", "mla_cache_write[fp8_ds_mla]"} <= kernels
    for row in rows:
        assert 0 <= row["shared"] <= SM89_SHARED_LIMIT, row
        assert not row["wgmma"], row
        assert row["local_loads"] == 0, row
        if "prefill" not in row["kernel"]:
            assert row["spills"] in (0, None), row
    assert result.returncode == 0, result.stderr[-3000:]
