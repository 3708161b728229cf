"""GPU lane: the Triton kernels at GLM-5.3-Flash shapes against float64 references, bit-exact
cache writes, determinism, and CUDA-graph capture replayed 100 times with new inputs and lengths.

Shapes: 64 attention heads split over TP 1/2/4/8 (64/32/16/8 heads per rank), latent 512, index
buffer 2176 wide with 2048 + 15 selected tokens, contexts up to 256k tokens, indexer 32 heads x
128 with kpool 16 (pool pages of 64 pools). Latent caches in all three layouts: bf16, fp8
(512 e4m3 bytes per row, one per-tensor scale that the kernels read on the device) and
fp8_ds_mla. Tolerances are those of the operand types: bf16 products (2^-8 relative per
element), fp8 keys used exactly.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

TOPK, KPOOL, WIDTH = 2048, 16, 2176
SCALE = 0.0883883  # 1/sqrt(128); any explicit scale works, the kernel never defaults one


def _dev():
    return torch.device("cuda")


ROW = {"bf16": (512, torch.bfloat16), "fp8": (512, torch.uint8), "fp8_ds_mla": (656, torch.uint8)}


def _kv_scale(fmt, value=0.0173):
    """The fp8 layout's per-tensor scale (vLLM's layer._k_scale: a 0-d fp32 device tensor)."""
    return torch.tensor(value, device=_dev()) if fmt == "fp8" else None


def _latent_cache(fmt, num_tokens, block_size=64, seed=0, kv_scale=None):
    """The cache as the attention backend receives it (fp8: vLLM's uint8 storage viewed as
    float8_e4m3fn), filled by the Triton cache writer."""
    from glmctl.kernels.mla_cache_write import mla_cache_write

    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks = -(-num_tokens // block_size)
    row, dtype = ROW[fmt]
    cache = torch.zeros(blocks, block_size, row, dtype=dtype, device=_dev())
    latent = torch.randn(blocks * block_size, 512, generator=g, device=_dev())
    latent = (latent * (0.5 + torch.rand(blocks * block_size, 1, generator=g, device=_dev()))).to(
        torch.bfloat16)
    mla_cache_write(latent, torch.arange(blocks * block_size, device=_dev()), cache, kv_scale)
    return cache.view(torch.float8_e4m3fn) if fmt == "fp8" else cache


def _selection(rows, context, seed=0, valid=None):
    """Index rows as the indexer writes them: 128 random whole pools + a 15-token tail."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pools = context // KPOOL
    chosen = torch.rand(rows, pools, generator=g, device=_dev()).argsort(dim=1)[:, : TOPK // KPOOL]
    tokens = (chosen[:, :, None] * KPOOL + torch.arange(KPOOL, device=_dev())).reshape(rows, -1)
    idx = torch.full((rows, WIDTH), -1, dtype=torch.int32, device=_dev())
    idx[:, :TOPK] = tokens.int()
    idx[:, TOPK : TOPK + 15] = (pools * KPOOL - 15 + torch.arange(15, device=_dev())).int()
    if valid is not None:  # fewer valid entries (short context rows)
        keep = torch.arange(WIDTH, device=_dev())[None, :] < valid[:, None]
        idx = torch.where(keep, idx, -1)
    return idx


def _rel_err(got, want):
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("fmt", ["fp8", "fp8_ds_mla", "bf16"])
@pytest.mark.parametrize("heads", [64, 32, 16, 8])
def test_sparse_mla_decode_and_prefill_real_shapes(fmt, heads):
    from glmctl.kernels.sparse_mla_decode import (
        plan_sparse_mla_decode,
        sparse_mla_decode,
        sparse_mla_decode_ref,
        sparse_mla_decode_workspace,
    )
    from glmctl.kernels.sparse_mla_prefill import sparse_mla_prefill

    context = 256 * 1024 if heads == 8 else 64 * 1024
    kv_scale = _kv_scale(fmt)
    cache = _latent_cache(fmt, context, kv_scale=kv_scale)
    rows = 32  # 8 sequences x (1 + 3 MTP drafts)
    valid = torch.full((rows,), TOPK + 15, device=_dev())
    valid[3], valid[7] = 1, 0  # one token; nothing valid
    idx = _selection(rows, context, valid=valid)
    q = torch.randn(rows, heads, 512, device=_dev()).to(torch.bfloat16)
    want_out, want_lse = sparse_mla_decode_ref(q, cache, idx, SCALE, kv_scale=kv_scale,
                                               compute_dtype=torch.float64)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plan = plan_sparse_mla_decode(rows, heads, WIDTH, sms, kv_format=fmt)
    ws = sparse_mla_decode_workspace([plan], _dev())
    for run in ("decode", "prefill"):
        out = torch.full_like(q, float("nan"))
        lse = torch.full((rows, heads), float("nan"), device=_dev())
        if run == "decode":
            sparse_mla_decode(q, cache, idx, SCALE, out, lse, plan, ws, kv_scale=kv_scale)
        else:
            sparse_mla_prefill(q, cache, idx, SCALE, out, lse, kv_scale=kv_scale)
        assert not torch.isnan(out).any()
        assert _rel_err(out, want_out) < 1.5e-2, run
        finite = torch.isfinite(want_lse)
        assert torch.equal(finite, torch.isfinite(lse))
        assert float((lse[finite].double() - want_lse[finite]).abs().max()) < 2e-3, run
        assert bool((out[7] == 0).all())
    # Deterministic: same inputs, same bits.
    out2, lse2 = torch.empty_like(q), torch.empty((rows, heads), device=_dev())
    sparse_mla_decode(q, cache, idx, SCALE, out2, lse2, plan, ws, kv_scale=kv_scale)
    out3, lse3 = torch.empty_like(q), torch.empty((rows, heads), device=_dev())
    sparse_mla_decode(q, cache, idx, SCALE, out3, lse3, plan, ws, kv_scale=kv_scale)
    assert torch.equal(out2, out3) and torch.equal(lse2.nan_to_num(), lse3.nan_to_num())


@pytest.mark.parametrize("fmt", ["fp8", "fp8_ds_mla"])
def test_sparse_mla_decode_cuda_graph_replays_with_new_inputs_and_lengths(fmt):
    """fp8: the per-tensor scale changes between replays too (the graph must read it on the
    device, not bake in the value seen at capture)."""
    from glmctl.kernels.sparse_mla_decode import (
        plan_sparse_mla_decode,
        sparse_mla_decode,
        sparse_mla_decode_ref,
        sparse_mla_decode_workspace,
    )

    heads, rows, context = 8, 32, 64 * 1024
    kv_scale = _kv_scale(fmt)
    cache = _latent_cache(fmt, context, kv_scale=kv_scale)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plan = plan_sparse_mla_decode(rows, heads, WIDTH, sms, kv_format=fmt)
    ws = sparse_mla_decode_workspace([plan], _dev())
    q = torch.zeros(rows, heads, 512, dtype=torch.bfloat16, device=_dev())
    idx = torch.full((rows, WIDTH), -1, dtype=torch.int32, device=_dev())
    out = torch.zeros_like(q)
    lse = torch.zeros(rows, heads, device=_dev())
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # compile outside capture
        sparse_mla_decode(q, cache, idx, SCALE, out, lse, plan, ws, kv_scale=kv_scale)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        sparse_mla_decode(q, cache, idx, SCALE, out, lse, plan, ws, kv_scale=kv_scale)
    worst = 0.0
    for step in range(100):
        valid = torch.randint(0, TOPK + 16, (rows,), device=_dev())
        q.copy_(torch.randn(rows, heads, 512, device=_dev()))
        idx.copy_(_selection(rows, context, seed=step + 1, valid=valid))
        if kv_scale is not None:
            kv_scale.fill_(0.0173 * (1 + step % 7))
        graph.replay()
        want_out, want_lse = sparse_mla_decode_ref(q, cache, idx, SCALE, kv_scale=kv_scale)
        worst = max(worst, _rel_err(out, want_out.double()))
        finite = torch.isfinite(want_lse)
        assert torch.equal(finite, torch.isfinite(lse)), step
    torch.cuda.synchronize()
    assert worst < 1.5e-2


@pytest.mark.parametrize("fmt, k_scale", [("fp8_ds_mla", None), ("bf16", None), ("fp8", 1.0),
                                           ("fp8", 0.0173)])
def test_mla_cache_write_bit_exact_on_gpu(fmt, k_scale):
    """Bit for bit against the torch reference on the GPU (IEEE division, round to nearest
    even, saturating: vLLM's concat_and_cache_mla for fp8); magnitudes from 1e-4 to 1e3 cover
    the fp8 layout's subnormals and its saturation at 448 * k_scale."""
    from glmctl.kernels.mla_cache_write import mla_cache_write, mla_cache_write_ref

    row, dtype = ROW[fmt]
    got = torch.zeros(40, 64, row, dtype=dtype, device=_dev())
    want = got.clone()
    latent = (torch.randn(2000, 512, device=_dev()) * torch.logspace(-4, 3, 2000,
                                                                     device=_dev())[:, None])
    latent = latent.to(torch.bfloat16)
    slots = torch.randperm(40 * 64, device=_dev())[:2000]
    slots[::7] = -1
    kv_scale = None if k_scale is None else torch.tensor(k_scale, device=_dev())
    mla_cache_write(latent, slots, got, kv_scale)
    mla_cache_write_ref(latent, slots, want, kv_scale)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def _pool_cache(pages, page_pools=64, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    cache = torch.zeros(pages, page_pools, 132, dtype=torch.uint8, device=_dev())
    flat = cache.view(pages, -1)
    values = torch.randn(pages, page_pools * 128, generator=g, device=_dev())
    flat[:, : page_pools * 128] = values.to(torch.float8_e4m3fn).view(torch.uint8)
    scales = torch.exp2(torch.randint(-9, -2, (pages, page_pools), generator=g, device=_dev()).float())
    flat[:, page_pools * 128 :] = scales.view(torch.uint8).view(pages, -1)
    return cache


@pytest.mark.parametrize("next_n", [1, 4])
def test_indexer_logits_paged_and_topk_real_shapes(next_n):
    from glmctl.kernels.indexer_logits_paged import indexer_logits_paged, indexer_logits_paged_ref
    from glmctl.kernels.kpool_topk import kpool_topk, kpool_topk_ref, kpool_topk_workspace

    heads, page_pools, num_req = 32, 64, 8
    max_tokens = 256 * 1024
    max_pools = max_tokens // KPOOL
    pages_per_req = max_pools // page_pools
    cache = _pool_cache(num_req * pages_per_req + 3)
    block_table = torch.randperm(num_req * pages_per_req + 3, device=_dev())[
        : num_req * pages_per_req].view(num_req, -1).int()
    seq = torch.tensor([max_tokens, 240_000, 64_000, 22_000, 2_047, 2_048 + 17, 16, 1],
                       device=_dev())
    tok_len = (seq[:, None] - next_n + 1 + torch.arange(next_n, device=_dev())).clamp_min(0)
    ctx = (tok_len // KPOOL).int().contiguous()
    q = torch.randn(num_req, next_n, heads, 128, device=_dev()).to(torch.float8_e4m3fn)
    w = torch.randn(num_req * next_n, heads, device=_dev())
    out = torch.full((num_req * next_n, max_pools), float("nan"), device=_dev())
    indexer_logits_paged(q, w, cache, block_table, ctx, out)
    want = indexer_logits_paged_ref(q, w, cache, block_table, ctx, compute_dtype=torch.float64)
    visible = torch.isfinite(want)
    assert not torch.isnan(out[visible]).any()
    err = (out[visible].double() - want[visible]).abs()
    assert float((err / (want[visible].abs() + 1e-3 * want[visible].abs().max())).max()) < 1e-4
    # Top-k on the kernel's own logits: kernel and reference must agree exactly.
    sel = torch.full((num_req * next_n, WIDTH), 7, dtype=torch.int32, device=_dev())
    kpool_topk(out, tok_len.reshape(-1).int(), sel, kpool=KPOOL, select_pools=TOPK // KPOOL)
    ref_sel = torch.full_like(sel, 9)
    clean = torch.where(visible, out, float("-inf"))
    kpool_topk_ref(clean, tok_len.reshape(-1).int(), ref_sel, kpool=KPOOL,
                   select_pools=TOPK // KPOOL)
    assert torch.equal(sel, ref_sel)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ws = kpool_topk_workspace(num_req * next_n, TOPK // KPOOL, sms, _dev())
    two = torch.full_like(sel, 5)
    kpool_topk(out, tok_len.reshape(-1).int(), two, kpool=KPOOL, select_pools=TOPK // KPOOL,
               workspace=ws)
    assert torch.equal(two, ref_sel)


def test_indexer_decode_cuda_graph_replays_with_new_lengths():
    from glmctl.kernels.indexer_logits_paged import indexer_logits_paged, indexer_logits_paged_ref
    from glmctl.kernels.kpool_topk import kpool_topk, kpool_topk_ref, kpool_topk_workspace

    heads, page_pools, num_req, next_n = 32, 64, 8, 4
    max_pools = 64 * 1024 // KPOOL
    pages_per_req = max_pools // page_pools
    cache = _pool_cache(num_req * pages_per_req)
    block_table = torch.randperm(num_req * pages_per_req, device=_dev()).view(num_req, -1).int()
    q = torch.zeros(num_req, next_n, heads, 128, device=_dev()).to(torch.float8_e4m3fn)
    w = torch.zeros(num_req * next_n, heads, device=_dev())
    ctx = torch.zeros(num_req, next_n, dtype=torch.int32, device=_dev())
    tok_len = torch.zeros(num_req * next_n, dtype=torch.int32, device=_dev())
    logits = torch.zeros(num_req * next_n, max_pools, device=_dev())
    sel = torch.zeros(num_req * next_n, WIDTH, dtype=torch.int32, device=_dev())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ws = kpool_topk_workspace(num_req * next_n, TOPK // KPOOL, sms, _dev())

    def step():
        indexer_logits_paged(q, w, cache, block_table, ctx, logits)
        kpool_topk(logits, tok_len, sel, kpool=KPOOL, select_pools=TOPK // KPOOL, workspace=ws)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    for i in range(100):
        seq = torch.randint(1, 64 * 1024 - next_n, (num_req,), device=_dev())
        lens = seq[:, None] + torch.arange(next_n, device=_dev())
        tok_len.copy_(lens.reshape(-1).int())
        ctx.copy_((lens // KPOOL).int())
        q.copy_(torch.randn(num_req, next_n, heads, 128, device=_dev()).to(torch.float8_e4m3fn))
        w.copy_(torch.randn(num_req * next_n, heads, device=_dev()))
        graph.replay()
        want = indexer_logits_paged_ref(q, w, cache, block_table, ctx)
        visible = torch.isfinite(want)
        assert torch.allclose(logits[visible], want[visible], rtol=1e-4, atol=1e-4), i
        ref_sel = torch.empty_like(sel)
        kpool_topk_ref(torch.where(visible, logits, float("-inf")), tok_len, ref_sel,
                       kpool=KPOOL, select_pools=TOPK // KPOOL)
        assert torch.equal(sel, ref_sel), i


def test_indexer_logits_ragged_prefill_real_shapes():
    from glmctl.kernels.indexer_logits_ragged import (
        indexer_logits_ragged,
        indexer_logits_ragged_ref,
    )

    heads, tokens, first = 32, 1024, 30_000  # a chunk of 1024 prompt tokens after 30k
    keys = (first + tokens) // KPOOL
    q = torch.randn(tokens, heads, 128, device=_dev()).to(torch.float8_e4m3fn)
    w = torch.randn(tokens, heads, device=_dev())
    k = torch.randn(keys, 128, device=_dev()).to(torch.float8_e4m3fn)
    k_scale = torch.exp2(torch.randint(-9, -2, (keys,), device=_dev()).float())
    pos = first + torch.arange(tokens, device=_dev())
    starts = torch.zeros(tokens, dtype=torch.int32, device=_dev())
    ends = ((pos + 1) // KPOOL).int()
    out = torch.full((tokens, keys), float("nan"), device=_dev())
    indexer_logits_ragged(q, w, k, k_scale, starts, ends, out)
    want = indexer_logits_ragged_ref(q, w, k, k_scale, starts, ends, compute_dtype=torch.float64)
    visible = torch.isfinite(want)
    err = (out[visible].double() - want[visible]).abs()
    assert float((err / (want[visible].abs() + 1e-3 * want[visible].abs().max())).max()) < 1e-4


def test_kpool_decode_update_mtp_ring_matches_reference_and_replays_in_a_graph():
    """The Triton kpool decode update the plugin uses with MTP (tail ring of kpool + 3 - 1 = 18
    slots) against the torch reference: 48 requests x 4 verify tokens per step, rejected drafts,
    pool boundaries crossed; then the same step captured in a CUDA graph and replayed with new
    tokens. Rings must match exactly; pools bit for bit but for rare last-bit exp/FMA flips."""
    from glmctl.kernels.kpool_cache_write import kpool_decode_update_ref
    from glmctl.kernels.kpool_decode_write import kpool_decode_update
    from glmctl.kernels.layouts import indexer_page_views

    ring, num_req, next_n, page_pools = KPOOL + 2, 48, 4, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    ape = torch.randn(KPOOL, 128, generator=g, device=_dev())
    base = _pool_cache(400, page_pools)
    caches = [base, base.clone()]
    tail = torch.randn(num_req, 2, ring, 128, generator=g, device=_dev()).to(torch.bfloat16)
    tails = [tail, tail.clone()]
    # disjoint per request, as vLLM's allocator gives them (shared pages would race)
    pages = torch.randperm(400, generator=g, device=_dev())[: num_req * 8].view(num_req, 8)
    first = torch.randint(0, 400, (num_req,), generator=g, device=_dev())
    blocks = torch.randperm(num_req, generator=g, device=_dev())

    def step_inputs(first):
        pos = first[:, None] + torch.arange(next_n, device=_dev())[None]
        pool = pos // KPOOL
        slots = pages.gather(1, pool // page_pools) * page_pools + pool % page_pools
        slots = torch.where((pos + 1) % KPOOL == 0, slots, -1)
        tail_slots = blocks[:, None] * ring + pos % ring
        k = torch.randn(num_req, next_n, 128, generator=g, device=_dev()).to(torch.bfloat16)
        gate = (3 * torch.randn(num_req, next_n, 128, generator=g, device=_dev())).to(torch.bfloat16)
        return tail_slots, k, gate, slots, pos.int()

    written = []
    for _ in range(12):
        args = step_inputs(first)
        written.append(args[3].flatten())
        kpool_decode_update(caches[0], tails[0], *args[:3], ape, *args[3:], KPOOL)
        kpool_decode_update_ref(caches[1], tails[1], *args[:3], ape, *args[3:], KPOOL)
        first = first + torch.randint(1, next_n + 1, (num_req,), generator=g, device=_dev())

    def compare():
        assert torch.equal(tails[0], tails[1])
        (v0, s0), (v1, s1) = indexer_page_views(caches[0]), indexer_page_views(caches[1])
        assert torch.equal(s0, s1)
        differ = (v0.view(torch.uint8) != v1.view(torch.uint8)).any(-1).flatten()
        slots = torch.cat(written)
        slots = slots[slots >= 0].unique()
        assert slots.numel() > 50
        outside = torch.ones_like(differ)
        outside[slots] = False
        assert not differ[outside].any()  # nothing but completed pools was written
        assert int(differ.sum()) <= max(2, slots.numel() // 20)
        # a last-bit exp flip moves one pooled value by a bf16 ulp; the Hadamard rotation spreads
        # it over the row, so small outputs may land a few fp8 codes apart (scales are equal)
        rows = differ.view(v0.shape[:2])
        a, b = v0[rows].double(), v1[rows].double()
        assert torch.allclose(a, b, rtol=0.13, atol=448 * 2**-10), (a, b)

    compare()
    # Captured once, replayed with new tokens at the same positions (a static graph's inputs).
    static = step_inputs(first)
    kpool_decode_update(caches[0], tails[0], *static[:3], ape, *static[3:], KPOOL)  # warm-up
    kpool_decode_update_ref(caches[1], tails[1], *static[:3], ape, *static[3:], KPOOL)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kpool_decode_update(caches[0], tails[0], *static[:3], ape, *static[3:], KPOOL)
    for _ in range(5):
        fresh = step_inputs(first)
        static[1].copy_(fresh[1])
        static[2].copy_(fresh[2])
        graph.replay()
        kpool_decode_update_ref(caches[1], tails[1], *static[:3], ape, *static[3:], KPOOL)
    written.append(static[3].flatten())
    torch.cuda.synchronize()
    compare()


def test_kpool_topk_threshold_fallback_and_prefill_offsets_real_shapes():
    """The threshold top-k at GLM-5.3-Flash's selection on rows that take each of its paths
    (random logits: candidates; heavy ties: the radix fallback; a row of one repeated value;
    -inf; prefill row offsets) equals the reference exactly, as do the radix kernels."""
    from glmctl.kernels.kpool_topk import RADIX, kpool_topk, kpool_topk_ref

    g = torch.Generator(device="cuda").manual_seed(3)
    rows, pools = 48, 15_360
    logits = torch.randn(rows, pools, generator=g, device=_dev())
    logits[1] = torch.randint(0, 3, (pools,), generator=g, device=_dev()).float()
    logits[2] = 1.0
    logits[3] = float("-inf")
    logits[4] = torch.arange(pools, device=_dev()).float()  # the best pools are the last ones
    logits[5] = logits[5].to(torch.float8_e4m3fn).float()  # coarse values, many ties
    seq = torch.randint(1, (pools - 2 * KPOOL) * KPOOL, (rows,), generator=g, device=_dev()).int()
    seq[:6] = pools * KPOOL - 3
    starts = torch.randint(0, 2 * KPOOL, (rows,), generator=g, device=_dev()).int()
    starts[:6] = 0
    want = torch.full((rows, WIDTH), 7, dtype=torch.int32, device=_dev())
    kpool_topk_ref(logits, seq, want, kpool=KPOOL, select_pools=TOPK // KPOOL, row_starts=starts)
    for config in (None, RADIX):
        got = torch.full_like(want, 9)
        kpool_topk(logits, seq, got, kpool=KPOOL, select_pools=TOPK // KPOOL, row_starts=starts,
                   config=config)
        assert torch.equal(got, want), config
