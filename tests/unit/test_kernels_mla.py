"""Sparse-MLA and MLA cache-write Triton kernels under TRITON_INTERPRET=1 against their torch
references, at tiny shapes, on vLLM's cache layouts (bf16 and fp8_ds_mla). Outputs are poisoned
with NaN first so an unwritten element fails; inputs are fresh random tensors every run."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from glmctl.kernels.triton_env import (  # noqa: E402
    import_interpreted,
    run_in_fresh_interpreter_process,
)

# Before anything imports triton: the interpreter is chosen at decoration time. If triton was
# imported earlier in this process, every test here is skipped and re-run in a fresh process.
_modules = import_interpreted(
    "glmctl.kernels.sparse_mla_prefill",
    "glmctl.kernels.mla_cache_write",
    "glmctl.kernels.sparse_mla_decode",
)
interpreted = pytest.mark.skipif(_modules is None, reason="re-run by test_in_fresh_process")


@pytest.mark.skipif(_modules is not None, reason="ran in this process")
def test_in_fresh_process():
    run_in_fresh_interpreter_process(__file__)


prefill_mod, cache_write_mod, decode_mod = _modules or (None, None, None)
sparse_mla_prefill = getattr(prefill_mod, "sparse_mla_prefill", None)
sparse_mla_prefill_ref = getattr(prefill_mod, "sparse_mla_prefill_ref", None)
mla_cache_write = getattr(cache_write_mod, "mla_cache_write", None)
mla_cache_write_ref = getattr(cache_write_mod, "mla_cache_write_ref", None)
plan_sparse_mla_decode = getattr(decode_mod, "plan_sparse_mla_decode", None)
sparse_mla_decode = getattr(decode_mod, "sparse_mla_decode", None)
sparse_mla_decode_ref = getattr(decode_mod, "sparse_mla_decode_ref", None)
sparse_mla_decode_workspace = getattr(decode_mod, "sparse_mla_decode_workspace", None)


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the launchers pick interpreter-safe dtypes


def _cache(fmt, num_blocks, block_size, pad_rows=0):
    """A vLLM-shaped latent cache filled through the reference writer; blocks may be padded
    (rows of another layer in between) to exercise the flat-row convention."""
    row = 512 if fmt == "bf16" else 656
    dtype = torch.bfloat16 if fmt == "bf16" else torch.uint8
    backing = torch.zeros(num_blocks, block_size + pad_rows, row, dtype=dtype)
    cache = backing[:, :block_size]
    slots = torch.arange(num_blocks * block_size)
    latent = (torch.randn(len(slots), 512) * (1 + 3 * torch.rand(len(slots), 1))).to(torch.bfloat16)
    mla_cache_write_ref(latent, slots, cache)
    flat = (slots // block_size) * (block_size + pad_rows) + slots % block_size
    return cache, flat


def _poisoned(q):
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"))
    return out, lse


def _check(out, lse, want_out, want_lse):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    # bf16 products in the kernel vs fp32 in the reference: a few bf16 ulps of |out| <= ~max|kv|
    assert torch.allclose(out.float(), want_out.float(), atol=3e-2, rtol=2e-2)
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert torch.allclose(lse[finite], want_lse[finite], atol=2e-3, rtol=1e-4)


@interpreted
@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
def test_mla_cache_write_kernel_is_bit_exact(fmt):
    num_blocks, block_size = 3, 4
    row, dtype = (512, torch.bfloat16) if fmt == "bf16" else (656, torch.uint8)
    fill = 0xCD if fmt != "bf16" else float("nan")
    got = torch.full((num_blocks, block_size, row), fill, dtype=dtype)
    want = got.clone()
    latent = (torch.randn(6, 512) * torch.logspace(-3, 2, 6)[:, None]).to(torch.bfloat16)
    latent[1, :128] = 0  # an all-zero tile: scale falls back to FLT_MIN
    slots = torch.tensor([0, 5, -1, 11, 3, 6])
    mla_cache_write(latent, slots, got)
    mla_cache_write_ref(latent, slots, want)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@interpreted
@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
def test_sparse_mla_prefill_kernel(fmt):
    cache, flat = _cache(fmt, num_blocks=5, block_size=16, pad_rows=3)
    num_tokens, heads, width = 5, 6, 80
    q = torch.randn(num_tokens, heads, 512).to(torch.bfloat16)
    idx = flat[torch.randint(0, len(flat), (num_tokens, width))].int()
    idx[0, 37:] = -1  # fewer valid slots than the width
    idx[1] = -1  # nothing valid: zeros, lse -inf
    idx[2, 1::3] = -1  # holes (unselected pools) before valid entries
    idx[3, 5] = 10**7  # out of range: ignored
    idx[4, :] = -1
    idx[4, 0] = flat[17]  # a single token
    scale = 0.0625
    out, lse = _poisoned(q)
    sparse_mla_prefill(q, cache, idx, scale, out, lse)
    want_out, want_lse = sparse_mla_prefill_ref(q, cache, idx, scale)
    _check(out, lse, want_out, want_lse)
    assert bool((out[1] == 0).all()) and bool(torch.isneginf(lse[1]).all())


@interpreted
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
def test_sparse_mla_decode_split_k_with_mtp_rows(fmt, prefetch):
    """2 sequences x (1 + 3 MTP) query tokens, each row its own selection, causal tail: the
    draft tokens see one more row each. A tiny SM count forces several splits."""
    cache, flat = _cache(fmt, num_blocks=6, block_size=16)
    heads, width = 4, 128
    rows = []
    for seq_start in (0, 40):
        for j in range(4):
            visible = flat[seq_start : seq_start + 30 + j]  # causal: draft j sees j more tokens
            row = torch.full((width,), -1, dtype=torch.int32)
            row[: len(visible)] = visible[torch.randperm(len(visible))].int()
            rows.append(row)
    idx = torch.stack(rows)
    idx[7, :] = -1  # an all-invalid row inside a split batch
    q = torch.randn(len(rows), heads, 512).to(torch.bfloat16)
    plan = plan_sparse_mla_decode(len(rows), heads, width, num_sms=8, kv_format=fmt)
    assert plan.num_splits > 1 or plan.block_n * 2 > width // 2
    # Four splits of one 32-row tile each, through both gather loops.
    plan = dataclasses.replace(plan, block_n=32, split_len=32, num_splits=4, prefetch=prefetch)
    ws = sparse_mla_decode_workspace([plan], "cpu")
    out, lse = _poisoned(q)
    sparse_mla_decode(q, cache, idx, 0.05, out, lse, plan, ws)
    want_out, want_lse = sparse_mla_decode_ref(q, cache, idx, 0.05)
    _check(out, lse, want_out, want_lse)
    # Deterministic: the same inputs give the same bits.
    out2, lse2 = _poisoned(q)
    sparse_mla_decode(q, cache, idx, 0.05, out2, lse2, plan, ws)
    assert torch.equal(out2, out) and torch.equal(lse2.nan_to_num(), lse.nan_to_num())


@interpreted
def test_decode_plan_uses_sms_and_batch():
    small = plan_sparse_mla_decode(8, 8, 2176, num_sms=132)
    big = plan_sparse_mla_decode(512, 8, 2176, num_sms=132)
    assert small.num_splits > big.num_splits == 1
    assert small.num_splits * small.split_len >= 2176
    assert plan_sparse_mla_decode(8, 64, 2176, 132).num_splits <= small.num_splits
