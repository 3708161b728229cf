"""GPU lane: the packed-counter top-k and the glue-free decode selection at GLM-5.3-Flash's
decode shapes (select 128 pools of 16 tokens, 2176-wide index rows; 8x22k, 1x64k, 8x64k and
8x227k with MTP-3: 4 query rows per request), exact against the torch references on rows that
take every path (random logits: candidates; heavy ties and constant rows: the radix fallback;
signed zeros; coarse fp8 values; monotone rows; -inf), decode rows whose lengths come from int64
positions and pool-granular context lengths with CUDA-graph padding rows, the glue-free indexer
step against the previous one (torch glue + threshold kernel) on the paged logits, capture and
replay with new lengths, determinism, and the sparse-MLA positions-to-rows kernel.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

TOPK, KPOOL, WIDTH, SELECT = 2048, 16, 2176, 128
PAGE_POOLS, HEADS = 64, 32
# cell: (requests, query rows per request, context tokens)
CELLS = {"8x22k": (8, 4, 22 * 1024), "1x64k": (1, 4, 64 * 1024), "8x64k": (8, 4, 64 * 1024),
         "8x227k": (8, 4, 227 * 1024)}


def _dev():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device("cuda")


def _decode_rows(cell, seed=0):
    """(logits [rows, pools] with special rows, int64 positions, int32 context [B, N])."""
    requests, next_n, context = CELLS[cell]
    g = torch.Generator(device=_dev()).manual_seed(seed)
    last = context - torch.randint(0, 2 * KPOOL, (requests,), generator=g, device=_dev())
    positions = (last[:, None] - (next_n - 1) + torch.arange(next_n, device=_dev())[None])
    positions = positions.reshape(-1).long()
    ctx = ((positions + 1) // KPOOL).int().view(requests, next_n)
    rows, pools = requests * next_n, context // KPOOL + 8
    logits = torch.randn(rows, pools, generator=g, device=_dev())
    special = [
        torch.randint(0, 3, (pools,), generator=g, device=_dev()).float(),  # ties: fallback
        torch.full((pools,), 0.5, device=_dev()),  # one value
        torch.where(torch.rand(pools, generator=g, device=_dev()) < 0.9, -0.0, 0.0),
        torch.randn(pools, generator=g, device=_dev()).to(torch.float8_e4m3fn).float(),
        torch.arange(pools, device=_dev()).float(),  # the best pools are the last ones
        torch.full((pools,), float("-inf"), device=_dev()),
    ]
    for i, row in enumerate(special[: max(0, rows - 1)]):
        logits[1 + i] = row
    if rows > 3:
        logits[3, :: 4 * SELECT] = 1.0  # a few signed-zero winners
    return logits, positions, ctx


@pytest.mark.parametrize("cell", list(CELLS))
def test_packed_topk_decode_rows_are_the_references(cell):
    from glmctl.kernels.kpool_topk import (
        kpool_topk,
        kpool_topk_decode,
        kpool_topk_decode_ref,
        kpool_topk_ref,
    )
    from glmctl.kernels.kpool_topk_packed import PACKED_CANDIDATES

    logits, positions, ctx = _decode_rows(cell)
    rows = positions.numel()
    want = torch.full((rows + 5, WIDTH), 7, dtype=torch.int32, device=_dev())
    kpool_topk_decode_ref(logits, positions, ctx, want, kpool=KPOOL, select_pools=SELECT,
                          valid_rows=rows)
    assert want[rows:].eq(-1).all()
    for cfg in PACKED_CANDIDATES:
        got = torch.full_like(want, 9)
        kpool_topk_decode(logits, positions, ctx, got, kpool=KPOOL, select_pools=SELECT,
                          valid_rows=rows, config=cfg)
        assert torch.equal(got, want), (cfg.name, (got != want).any(1).nonzero().flatten()[:8])
    # the seq-length entry (prefill's) with row offsets, on the same rows
    seq = (positions + 1).int()
    starts = torch.randint(0, 8, (rows,), device=_dev()).int()
    ref = torch.full((rows, WIDTH), 7, dtype=torch.int32, device=_dev())
    kpool_topk_ref(logits, seq, ref, kpool=KPOOL, select_pools=SELECT, row_starts=starts)
    got = torch.full_like(ref, 3)
    kpool_topk(logits, seq, got, kpool=KPOOL, select_pools=SELECT, row_starts=starts)
    assert torch.equal(got, ref)


def test_packed_topk_is_deterministic():
    from glmctl.kernels.kpool_topk import kpool_topk_decode

    logits, positions, ctx = _decode_rows("8x227k", seed=3)
    outs = []
    for _ in range(5):
        out = torch.empty(positions.numel(), WIDTH, dtype=torch.int32, device=_dev())
        kpool_topk_decode(logits, positions, ctx, out, kpool=KPOOL, select_pools=SELECT)
        outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert (outs[0][:, :TOPK] >= 0).all()  # every row has >= 128 complete pools


def _pool_cache(pages, seed=0):
    g = torch.Generator(device=_dev()).manual_seed(seed)
    cache = torch.zeros(pages, PAGE_POOLS, 132, dtype=torch.uint8, device=_dev())
    flat = cache.view(pages, -1)
    values = torch.randn(pages, PAGE_POOLS * 128, generator=g, device=_dev())
    flat[:, : PAGE_POOLS * 128] = values.to(torch.float8_e4m3fn).view(torch.uint8)
    scales = torch.exp2(torch.randint(-9, -2, (pages, PAGE_POOLS), generator=g,
                                      device=_dev()).float())
    flat[:, PAGE_POOLS * 128:] = scales.view(torch.uint8).view(pages, -1)
    return cache


def _indexer_inputs(cell, seed=0):
    requests, next_n, context = CELLS[cell]
    pages_per_req = -(-(context // KPOOL + 1) // PAGE_POOLS)
    cache = _pool_cache(requests * pages_per_req + 1, seed)
    g = torch.Generator(device=_dev()).manual_seed(seed)
    block_table = (torch.randperm(requests * pages_per_req, generator=g, device=_dev()) + 1)
    block_table = block_table.view(requests, pages_per_req).int()
    q = torch.randn(requests, next_n, HEADS, 128, generator=g, device=_dev()).to(
        torch.float8_e4m3fn)
    w = torch.randn(requests * next_n, HEADS, generator=g, device=_dev())
    _, positions, ctx = _decode_rows(cell, seed)
    return cache, block_table, q, w, positions, ctx.contiguous()


def previous_decode_select(logits_paged, q, w, cache, block_table, positions, ctx, buffer, rows):
    """The indexer's decode selection as it was: a fill, torch length arithmetic, the threshold
    kernel."""
    from glmctl.kernels.kpool_topk import THRESHOLD_CONFIG, kpool_topk

    n = positions.numel()
    buffer[:rows] = -1
    seq = positions[:n].to(torch.int32) + 1
    logits = logits_paged(q, w, cache, block_table, ctx)
    seq = torch.minimum(seq, (ctx.reshape(-1).to(torch.int32) + 1) * KPOOL - 1)
    kpool_topk(logits, seq, buffer[:n], kpool=KPOOL, select_pools=SELECT, config=THRESHOLD_CONFIG)


def glue_free_decode_select(logits_paged, q, w, cache, block_table, positions, ctx, buffer,
                            rows):
    from glmctl.kernels.kpool_topk import kpool_topk_decode

    n = positions.numel()
    logits = logits_paged(q, w, cache, block_table, ctx)
    kpool_topk_decode(logits, positions, ctx, buffer[:rows], kpool=KPOOL, select_pools=SELECT,
                      valid_rows=n)


def _logits_paged():
    from glmctl.kernels.indexer_logits_paged import indexer_logits_paged

    def call(q, w, cache, block_table, ctx):
        out = torch.empty(q.shape[0] * q.shape[1], block_table.shape[1] * PAGE_POOLS,
                          device=q.device)
        return indexer_logits_paged(q, w, cache, block_table, ctx, out)

    return call


@pytest.mark.parametrize("cell", ["8x22k", "1x64k"])
def test_glue_free_indexer_step_equals_the_previous_one(cell):
    cache, block_table, q, w, positions, ctx = _indexer_inputs(cell)
    rows = positions.numel() + 3  # graph padding rows
    old = torch.full((rows + 4, WIDTH), 11, dtype=torch.int32, device=_dev())
    new = old.clone()
    paged = _logits_paged()
    previous_decode_select(paged, q, w, cache, block_table, positions, ctx, old, rows)
    glue_free_decode_select(paged, q, w, cache, block_table, positions, ctx, new, rows)
    assert torch.equal(old, new)
    assert new[rows:].eq(11).all() and new[positions.numel():rows].eq(-1).all()


def test_glue_free_indexer_step_replays_in_a_graph_with_new_lengths():
    from glmctl.kernels.indexer_logits_paged import indexer_logits_paged_ref
    from glmctl.kernels.kpool_topk import kpool_topk_decode, kpool_topk_decode_ref

    cache, block_table, q, w, positions, ctx = _indexer_inputs("8x64k", seed=1)
    n, rows = positions.numel(), positions.numel() + 4
    buffer = torch.full((rows, WIDTH), 5, dtype=torch.int32, device=_dev())
    paged = _logits_paged()
    seen = []

    def step():
        seen.append(paged(q, w, cache, block_table, ctx))
        kpool_topk_decode(seen[-1], positions, ctx, buffer, kpool=KPOOL, select_pools=SELECT,
                          valid_rows=n)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    logits = seen[-1]
    g = torch.Generator(device=_dev()).manual_seed(9)
    for i in range(30):
        last = torch.randint(1, 64 * 1024 - 4, (8,), generator=g, device=_dev())
        pos = (last[:, None] + torch.arange(4, device=_dev())[None]).reshape(-1)
        positions.copy_(pos)
        ctx.copy_(((pos + 1) // KPOOL).int().view(8, 4))
        q.copy_(torch.randn(q.shape, generator=g, device=_dev()).to(torch.float8_e4m3fn))
        graph.replay()
        want_logits = indexer_logits_paged_ref(q, w, cache, block_table, ctx)
        visible = torch.isfinite(want_logits)
        assert torch.allclose(logits[visible], want_logits[visible], rtol=1e-4, atol=1e-4), i
        want = torch.empty_like(buffer)
        kpool_topk_decode_ref(torch.where(visible, logits, float("-inf")), positions, ctx, want,
                              kpool=KPOOL, select_pools=SELECT, valid_rows=n)
        assert torch.equal(buffer, want), i


def test_sparse_rows_match_the_reference_at_227k():
    from glmctl.kernels.sparse_slots import sparse_rows, sparse_rows_ref

    g = torch.Generator(device=_dev()).manual_seed(2)
    tokens, block_size, blocks_per_req = 32, 64, 227 * 1024 // 64 + 1
    table = torch.randperm(8 * blocks_per_req, generator=g, device=_dev()).view(8, -1).int()
    req = torch.arange(tokens, device=_dev()).div(4, rounding_mode="floor").int()
    idx = torch.randint(-1, 227 * 1024, (tokens, WIDTH), generator=g, device=_dev()).int()
    idx[:, -100:] = -1
    idx[0, 0] = blocks_per_req * block_size + 5  # past the table
    buffer = torch.full((tokens + 8, WIDTH), -1, dtype=torch.int32, device=_dev())
    buffer[:tokens] = idx
    for rows_per_block in (block_size, 2 * block_size):
        got = sparse_rows(buffer[:tokens], req, table, block_size, rows_per_block)
        assert torch.equal(got, sparse_rows_ref(idx, req, table, block_size, rows_per_block))
    assert got[0, 0] == -1


def test_kpool_decode_update_reads_int64_positions():
    """The MTP ring update as the indexer now calls it (vLLM's int64 positions) writes what it
    writes with int32 positions."""
    from glmctl.kernels.kpool_decode_write import kpool_decode_update

    g = torch.Generator(device=_dev()).manual_seed(4)
    ring, num_req, next_n = KPOOL + 2, 8, 4
    ape = torch.randn(KPOOL, 128, generator=g, device=_dev())
    caches = [_pool_cache(64), _pool_cache(64)]
    tail = torch.randn(num_req, 2, ring, 128, generator=g, device=_dev()).to(torch.bfloat16)
    tails = [tail, tail.clone()]
    pos = (torch.arange(num_req, device=_dev()) * 37 + 13)[:, None] + torch.arange(
        next_n, device=_dev())[None]
    pool = pos // KPOOL
    slots = torch.where((pos + 1) % KPOOL == 0, pool, -1)
    tail_slots = torch.arange(num_req, device=_dev())[:, None] * ring + pos % ring
    k = torch.randn(num_req, next_n, 128, generator=g, device=_dev()).to(torch.bfloat16)
    gate = torch.randn(num_req, next_n, 128, generator=g, device=_dev()).to(torch.bfloat16)
    for c, t, p in zip(caches, tails, (pos.int(), pos.long()), strict=True):
        kpool_decode_update(c, t, tail_slots, k, gate, ape, slots, p, KPOOL)
    assert torch.equal(tails[0], tails[1]) and torch.equal(caches[0], caches[1])
    assert (slots >= 0).any()
