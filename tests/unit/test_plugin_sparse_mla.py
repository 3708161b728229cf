"""The sparse-MLA backend's computation (`glmctl.plugin.attention.sparse_mla_compute`) on CPU: which batches
take split-K decode, the CPU path on the 512-byte fp8 cache, and the CUDA kernel table run in the
Triton interpreter (split-K decode and prefill over fp8 / fp8_ds_mla / bf16 caches) against the CPU
torch path, with vLLM-shaped metadata (block tables in any order, a strided cache view)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.unit.interpreted_kernels import interpreted_kernels  # noqa: E402

_modules, interpreted, test_in_fresh_process, _interpreter = interpreted_kernels(
    __file__, "glmctl.kernels.sparse_mla_prefill", "glmctl.kernels.mla_cache_write",
    "glmctl.kernels.sparse_mla_decode", "glmctl.kernels.sparse_slots")

from glmctl.kernels.layouts import kv_format, normalise_kv_cache_dtype  # noqa: E402

from glmctl.plugin.attention.kernel_table import sparse_mla_kernels  # noqa: E402
from glmctl.plugin.attention.sparse_mla_compute import (  # noqa: E402
    DecodeSetup,
    decode_batch_sizes,
    make_decode_setup,
    request_ids_per_token,
    sparse_mla_forward,
)
from glmctl.plugin.policy import Target  # noqa: E402

BLOCK, WIDTH, HEADS, SCALE = 16, 256, 4, 0.07
ROW = {"bf16": (512, torch.bfloat16), "fp8": (512, torch.uint8), "fp8_ds_mla": (656, torch.uint8)}


def test_kv_cache_dtype_to_layout():
    assert kv_format("auto").name == kv_format("bf16").name == "bf16"
    assert kv_format("fp8") == kv_format("fp8_e4m3") and kv_format("fp8").row_bytes == 512
    assert kv_format("fp8_ds_mla").row_bytes == 656 and kv_format("bfloat16").row_bytes == 1024
    assert normalise_kv_cache_dtype(" BF16 ") == "bfloat16" and normalise_kv_cache_dtype("fp8_e4m3") == "fp8"
    with pytest.raises(ValueError, match="fp8_e5m2"):
        kv_format("fp8_e5m2")


def test_decode_batch_sizes_cover_capture_sizes_and_the_eager_ladder():
    sizes = decode_batch_sizes([1, 2, 4, 8, 16, 24, 32, 48, 64, 256, 512, 1024], 4 * 64)
    assert sizes[0] == 1 and sizes[-1] == 256  # the most decode tokens a batch can hold
    assert {12, 40, 48, 64} <= set(sizes) and 512 not in sizes
    assert decode_batch_sizes([], 20) == [1, 2, 4, 8, 12, 16, 20]  # enforce-eager: ladder only
    assert max(decode_batch_sizes(None, 10_000)) == 512


def test_decode_setup_picks_the_smallest_plan_that_holds_the_batch():
    plans = tuple(type("Plan", (), {"num_tokens": n})() for n in (1, 4, 16, 48))
    setup = DecodeSetup(plans, workspace=None, max_query_len=4)
    assert setup.plan_for(1, 1).num_tokens == 1
    assert setup.plan_for(3, 4).num_tokens == 4
    assert setup.plan_for(17, 1).num_tokens == 48
    assert setup.plan_for(49, 1) is None  # more tokens than any plan: prefill kernel
    assert setup.plan_for(8, 5) is None  # a prefill (or mixed) batch: prefill kernel


def test_cpu_target_has_no_split_k_setup():
    torch_k = sparse_mla_kernels(Target.TORCH)
    assert make_decode_setup(torch_k, num_heads=8, topk_width=128, kv_format="fp8",
                             batch_sizes=[1, 4], max_query_len=4, device="cpu") is None


def _batch(fmt, gen, tokens_per_req, seq_lens=(300, 37, 190)):
    """Latent cache (a strided view inside a page buffer shared with another layer), block
    table in shuffled block order, request-local top-k rows, queries."""
    row, dtype = ROW[fmt]
    num_blocks = sum(-(-s // BLOCK) for s in seq_lens) + 2
    pages = torch.zeros((num_blocks, 2, BLOCK, row), dtype=dtype)
    cache = pages[:, 0]
    kv_scale = torch.tensor(0.031) if fmt == "fp8" else None
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    cols = max(-(-s // BLOCK) for s in seq_lens)
    table = torch.zeros((len(seq_lens), cols), dtype=torch.int32)
    used = 0
    torch_k = sparse_mla_kernels(Target.TORCH)
    for r, s in enumerate(seq_lens):
        n = -(-s // BLOCK)
        table[r, :n] = perm[used:used + n]
        used += n
        pos = torch.arange(s)
        slots = table[r, pos // BLOCK].long() * BLOCK + pos % BLOCK
        latent = (torch.randn(s, 512, generator=gen) * 2).to(torch.bfloat16)
        torch_k.cache_write(latent, slots, cache, kv_scale)
    topk = []
    for s in seq_lens:
        for j in range(tokens_per_req):
            visible = s - tokens_per_req + j + 1
            row_idx = torch.full((WIDTH,), -1, dtype=torch.int32)
            pick = torch.randperm(visible, generator=gen)[:WIDTH - 8]
            row_idx[: pick.numel()] = pick.to(torch.int32)
            topk.append(row_idx)
    topk = torch.stack(topk)
    qsl = torch.arange(len(seq_lens) + 1) * tokens_per_req
    req_ids = request_ids_per_token(qsl, torch.empty(64, dtype=torch.int32))
    q = torch.randn(topk.shape[0], HEADS, 512, generator=gen).to(torch.bfloat16)
    view = cache.view(torch.float8_e4m3fn) if fmt == "fp8" else cache  # as vLLM hands it over
    return q, view, topk, req_ids, table, kv_scale


def test_cpu_path_on_the_fp8_cache_is_the_dequantised_reference():
    """The CPU (torch) path reads the 512-byte rows as e4m3 values times k_scale (a float64
    oracle over the rows the block table names)."""
    from glmctl.kernels.sparse_slots import sparse_rows_ref

    gen = torch.Generator().manual_seed(1)
    q, cache, topk, req_ids, table, kv_scale = _batch("fp8", gen, 1)
    torch_k = sparse_mla_kernels(Target.TORCH)
    out, lse = sparse_mla_forward(q, cache, topk, req_ids, table, BLOCK, SCALE, torch_k,
                                  kv_scale=kv_scale)
    rows = sparse_rows_ref(topk, req_ids[: topk.shape[0]], table, BLOCK, 2 * BLOCK).long()
    flat = cache.as_strided((cache.shape[0] * 2 * BLOCK, 512), (512, 1))
    for t in range(q.shape[0]):
        kv = flat[rows[t][rows[t] >= 0]].double() * 0.031
        scores = q[t].double() @ kv.T * SCALE
        torch.testing.assert_close(lse[t].double(), torch.logsumexp(scores, 1), rtol=0,
                                   atol=1e-4)
        torch.testing.assert_close(out[t].double(), torch.softmax(scores, 1) @ kv, rtol=1e-2,
                                   atol=1e-2)
    with pytest.raises(ValueError, match="kv_scale"):
        sparse_mla_forward(q, cache, topk, req_ids, table, BLOCK, SCALE, torch_k)


@interpreted
@pytest.mark.parametrize("fmt", ["fp8", "fp8_ds_mla", "bf16"])
@pytest.mark.parametrize("tokens_per_req", [1, 4])
def test_triton_table_decode_and_prefill_match_the_torch_path(fmt, tokens_per_req, monkeypatch):
    gen = torch.Generator().manual_seed(10 * tokens_per_req + len(fmt))
    q, cache, topk, req_ids, table, kv_scale = _batch(fmt, gen, tokens_per_req)
    triton_k, torch_k = sparse_mla_kernels(Target.TRITON), sparse_mla_kernels(Target.TORCH)
    setup = make_decode_setup(triton_k, num_heads=HEADS, topk_width=WIDTH, kv_format=fmt,
                              batch_sizes=[1, 4, 16], max_query_len=4, device="cpu", num_sms=64)
    calls = []
    for name in ("decode", "attention"):
        real = getattr(triton_k, name)
        monkeypatch.setattr(triton_k, name, lambda *a, _real=real, _name=name, **k:
                            calls.append(_name) or _real(*a, **k))
    ref_out, ref_lse = sparse_mla_forward(q, cache, topk, req_ids, table, BLOCK, SCALE, torch_k,
                                          kv_scale=kv_scale)
    for max_query_len, path in ((tokens_per_req, "decode"), (64, "attention")):
        calls.clear()
        out, lse = sparse_mla_forward(q, cache, topk, req_ids, table, BLOCK, SCALE, triton_k,
                                      kv_scale=kv_scale, decode=setup,
                                      max_query_len=max_query_len)
        assert calls == [path]
        torch.testing.assert_close(out.float(), ref_out.float(), rtol=2e-2, atol=3e-2)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=2e-3)
    plan = setup.plan_for(q.shape[0], tokens_per_req)
    assert plan.num_splits > 1 and plan.kv_format == fmt  # split-K really ran


@interpreted
def test_triton_rows_are_the_references():
    """Request-local positions -> cache rows in one launch: -1 and out-of-table positions give
    -1, a strided cache (rows_per_block > block size) and an index buffer wider than the batch's
    rows (a view with a row stride) map as in the reference."""
    gen = torch.Generator().manual_seed(2)
    _, cache, topk, req_ids, table, _ = _batch("fp8", gen, 4)
    wide = torch.full((topk.shape[0] + 3, WIDTH + 128), -1, dtype=torch.int32)
    wide[: topk.shape[0], :WIDTH] = topk
    wide[0, 5] = table.shape[1] * BLOCK + 3  # past the block table
    view = wide[: topk.shape[0], :WIDTH]
    triton_k, torch_k = sparse_mla_kernels(Target.TRITON), sparse_mla_kernels(Target.TORCH)
    ids = req_ids[: topk.shape[0]]
    got = triton_k.rows(view, ids, table, BLOCK, 2 * BLOCK)
    want = torch_k.rows(view, ids, table, BLOCK, 2 * BLOCK)
    assert got.dtype == torch.int32 and torch.equal(got, want)
    assert got[0, 5] == -1 and (got[view < 0] == -1).all()
    assert int((got >= 0).sum()) == int((view >= 0).sum()) - 1
