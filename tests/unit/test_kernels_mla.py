"""Sparse-MLA and MLA cache-write Triton kernels under TRITON_INTERPRET=1 against their torch
references, at tiny shapes, on vLLM's cache layouts (bf16, fp8 = 512 e4m3 bytes with one
per-tensor scale, fp8_ds_mla). Outputs are poisoned with NaN first so an unwritten element fails;
inputs are fresh random tensors every run."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from tests.unit.interpreted_kernels import interpreted_kernels  # noqa: E402

# Before anything imports triton: the interpreter is chosen at decoration time. If triton was
# imported earlier in this process, every test here is skipped and re-run in a fresh process.
_modules, interpreted, test_in_fresh_process, _interpreter = interpreted_kernels(
    __file__, "glmctl.kernels.sparse_mla_prefill", "glmctl.kernels.mla_cache_write",
    "glmctl.kernels.sparse_mla_decode")


prefill_mod, cache_write_mod, decode_mod = _modules or (None, None, None)
sparse_mla_prefill = getattr(prefill_mod, "sparse_mla_prefill", None)
sparse_mla_prefill_ref = getattr(prefill_mod, "sparse_mla_prefill_ref", None)
mla_cache_write = getattr(cache_write_mod, "mla_cache_write", None)
mla_cache_write_ref = getattr(cache_write_mod, "mla_cache_write_ref", None)
plan_sparse_mla_decode = getattr(decode_mod, "plan_sparse_mla_decode", None)
sparse_mla_decode = getattr(decode_mod, "sparse_mla_decode", None)
sparse_mla_decode_ref = getattr(decode_mod, "sparse_mla_decode_ref", None)
sparse_mla_decode_workspace = getattr(decode_mod, "sparse_mla_decode_workspace", None)


FORMATS = ["bf16", "fp8", "fp8_ds_mla"]
ROW = {"bf16": (512, torch.bfloat16), "fp8": (512, torch.uint8), "fp8_ds_mla": (656, torch.uint8)}


def _kv_scale(fmt):
    """A per-tensor scale that is not a power of two (fp8 only); None for the other layouts."""
    return torch.tensor(0.037 + 0.01 * torch.rand(()).item()) if fmt == "fp8" else None


def _cache(fmt, num_blocks, block_size, pad_rows=0, kv_scale=None):
    """A vLLM-shaped latent cache filled through the reference writer; blocks may be padded
    (rows of another layer in between) to exercise the flat-row convention. The fp8 cache is
    handed over as vLLM's attention layer does: the uint8 storage viewed as float8_e4m3fn."""
    row, dtype = ROW[fmt]
    backing = torch.zeros(num_blocks, block_size + pad_rows, row, dtype=dtype)
    cache = backing[:, :block_size]
    slots = torch.arange(num_blocks * block_size)
    latent = (torch.randn(len(slots), 512) * (1 + 3 * torch.rand(len(slots), 1))).to(torch.bfloat16)
    mla_cache_write_ref(latent, slots, cache, kv_scale)
    flat = (slots // block_size) * (block_size + pad_rows) + slots % block_size
    if fmt == "fp8":
        cache = cache.view(torch.float8_e4m3fn)
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
@pytest.mark.parametrize("fmt", FORMATS)
def test_mla_cache_write_kernel_is_bit_exact(fmt):
    num_blocks, block_size = 3, 4
    row, dtype = ROW[fmt]
    fill = 0xCD if fmt != "bf16" else float("nan")
    got = torch.full((num_blocks, block_size, row), fill, dtype=dtype)
    want = got.clone()
    latent = (torch.randn(6, 512) * torch.logspace(-3, 2, 6)[:, None]).to(torch.bfloat16)
    latent[1, :128] = 0  # an all-zero tile: scale falls back to FLT_MIN
    slots = torch.tensor([0, 5, -1, 11, 3, 6])
    kv_scale = _kv_scale(fmt)
    mla_cache_write(latent, slots, got, kv_scale)
    mla_cache_write_ref(latent, slots, want, kv_scale)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # skipped rows untouched


@interpreted
@pytest.mark.parametrize("view_as_fp8", [False, True])
def test_fp8_cache_write_rounding_edges(view_as_fp8):
    """The 512-byte fp8 row, element by element at the edges of e4m3: saturation at +-448
    (and beyond, as vLLM's __NV_SATFINITE conversion), ties to even in the normal and subnormal
    ranges, flush below half the smallest subnormal, signed zero, a scale that is not a power of
    two; the cache given as vLLM allocates it (uint8) and as its attention layer views it."""
    edges = torch.tensor([
        448.0, 460.0, 464.0, 1.0e4, -448.0, -1.0e4, float("inf"), float("-inf"),
        1.0625, 1.1875, -1.0625, -1.1875,  # normal ties: step 1/8 in [1, 2) -> even mantissa
        2.0 ** -6, 2.0 ** -7, 2.0 ** -10, 3 * 2.0 ** -10, 5 * 2.0 ** -11,  # subnormal ties
        2.0 ** -11, 0.0, -0.0, -(2.0 ** -10),
    ])
    latent = torch.zeros(3, 512)
    latent[0, : edges.numel()] = edges
    latent[1] = torch.randn(512) * 40
    latent[2] = torch.randn(512) * 1e-3
    latent = latent.to(torch.bfloat16)
    slots = torch.tensor([2, 0, 7])
    for scale in (1.0, 0.3):
        kv_scale = torch.tensor(scale)
        got = torch.full((2, 4, 512), 0xCD, dtype=torch.uint8)
        want = got.clone()
        mla_cache_write(latent, slots, got.view(torch.float8_e4m3fn) if view_as_fp8 else got,
                        kv_scale)
        mla_cache_write_ref(latent, slots, want, kv_scale)
        assert torch.equal(got, want), scale
    # With scale 1 the bytes are torch's own RTNE-saturating e4m3 of the values.
    expected = edges.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    kv_scale = torch.tensor(1.0)
    got = torch.zeros((2, 4, 512), dtype=torch.uint8)
    mla_cache_write(latent, slots, got, kv_scale)
    assert torch.equal(got[0, 2, : edges.numel()], expected)
    assert got[0, 2, 8].item() == 0x38 and got[0, 2, 9].item() == 0x3A  # 1.0, 1.25
    assert got[0, 2, 14].item() == 0x00 and got[0, 2, 15].item() == 0x02  # 0, 2 * 2^-9
    assert got[0, 2, 19].item() == 0x80  # -0.0 keeps its sign


@interpreted
def test_fp8_kernels_need_the_scale():
    cache, flat = _cache("fp8", num_blocks=2, block_size=16, kv_scale=torch.tensor(0.5))
    q = torch.randn(2, 4, 512).to(torch.bfloat16)
    idx = flat[:8].int().expand(2, 8).contiguous()
    out, lse = _poisoned(q)
    with pytest.raises(ValueError, match="kv_scale"):
        sparse_mla_prefill(q, cache, idx, 0.1, out, lse)
    with pytest.raises(ValueError, match="kv_scale"):
        mla_cache_write(torch.zeros(1, 512, dtype=torch.bfloat16), torch.tensor([0]), cache)


@interpreted
@pytest.mark.parametrize("fmt", FORMATS)
def test_sparse_mla_prefill_kernel(fmt):
    kv_scale = _kv_scale(fmt)
    cache, flat = _cache(fmt, num_blocks=5, block_size=16, pad_rows=3, kv_scale=kv_scale)
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
    sparse_mla_prefill(q, cache, idx, scale, out, lse, kv_scale=kv_scale)
    want_out, want_lse = sparse_mla_prefill_ref(q, cache, idx, scale, kv_scale=kv_scale)
    _check(out, lse, want_out, want_lse)
    assert bool((out[1] == 0).all()) and bool(torch.isneginf(lse[1]).all())


@interpreted
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("fmt", FORMATS)
def test_sparse_mla_decode_split_k_with_mtp_rows(fmt, prefetch):
    """2 sequences x (1 + 3 MTP) query tokens, each row its own selection, causal tail: the
    draft tokens see one more row each. A tiny SM count forces several splits."""
    kv_scale = _kv_scale(fmt)
    cache, flat = _cache(fmt, num_blocks=6, block_size=16, kv_scale=kv_scale)
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
    sparse_mla_decode(q, cache, idx, 0.05, out, lse, plan, ws, kv_scale=kv_scale)
    want_out, want_lse = sparse_mla_decode_ref(q, cache, idx, 0.05, kv_scale=kv_scale)
    _check(out, lse, want_out, want_lse)
    # Deterministic: the same inputs give the same bits.
    out2, lse2 = _poisoned(q)
    sparse_mla_decode(q, cache, idx, 0.05, out2, lse2, plan, ws, kv_scale=kv_scale)
    assert torch.equal(out2, out) and torch.equal(lse2.nan_to_num(), lse.nan_to_num())


@interpreted
def test_decode_plan_uses_sms_and_batch():
    small = plan_sparse_mla_decode(8, 8, 2176, num_sms=132)
    big = plan_sparse_mla_decode(512, 8, 2176, num_sms=132)
    assert small.num_splits > big.num_splits == 1
    assert small.num_splits * small.split_len >= 2176
    assert plan_sparse_mla_decode(8, 64, 2176, 132).num_splits <= small.num_splits


@interpreted
def test_decode_refuses_a_plan_for_another_layout():
    cache, flat = _cache("fp8", num_blocks=2, block_size=16, kv_scale=torch.tensor(1.0))
    q = torch.randn(2, 4, 512).to(torch.bfloat16)
    idx = flat[:8].int().expand(2, 8).contiguous()
    plan = plan_sparse_mla_decode(2, 4, 8, num_sms=4, kv_format="fp8_ds_mla")
    out, lse = _poisoned(q)
    with pytest.raises(ValueError, match="plan is for a fp8_ds_mla cache"):
        sparse_mla_decode(q, cache, idx, 0.1, out, lse, plan, sparse_mla_decode_workspace(
            [plan], "cpu"), kv_scale=torch.tensor(1.0))
