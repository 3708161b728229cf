"""Indexer Triton kernels (paged and ragged logits, kpool top-k with the tail) under
TRITON_INTERPRET=1 against their torch references on vLLM's pool-cache layout. Outputs are
poisoned first; inputs are fresh random tensors every run."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.unit.interpreted_kernels import interpreted_kernels  # noqa: E402

_modules, interpreted, test_in_fresh_process, _interpreter = interpreted_kernels(
    __file__, "glmctl.kernels.indexer_logits_paged", "glmctl.kernels.indexer_logits_ragged",
    "glmctl.kernels.kpool_topk", "glmctl.kernels.kpool_decode_write")
paged, ragged, topk, decode_write = _modules or (None, None, None, None)


def _pool_cache(num_pages, page_pools, pad_bytes=0):
    backing = torch.zeros(num_pages, page_pools * 132 + pad_bytes, dtype=torch.uint8)
    backing[:, : page_pools * 128] = (
        torch.randn(num_pages, page_pools * 128).to(torch.float8_e4m3fn).view(torch.uint8)
    )
    scales = torch.exp2(torch.randint(-7, 1, (num_pages, page_pools)).float())
    backing[:, page_pools * 128 : page_pools * 132] = scales.view(torch.uint8).view(num_pages, -1)
    return backing[:, : page_pools * 132].view(num_pages, page_pools, 132)


def _compare_visible(got, want):
    visible = torch.isfinite(want)
    assert not torch.isnan(got[visible]).any()
    assert torch.allclose(got[visible], want[visible], rtol=1e-5, atol=1e-5)


@interpreted
@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("next_n", [1, 4])
def test_indexer_logits_paged_mtp_and_page_boundaries(next_n, prefetch, monkeypatch):
    block_n, warps, stages, _ = paged.PAGED_CONFIG
    monkeypatch.setattr(paged, "PAGED_CONFIG", (block_n, warps, stages, prefetch))
    page_pools = 8
    cache = _pool_cache(10, page_pools, pad_bytes=20)  # page stride > page size
    num_req, heads = 3, 16
    q = torch.randn(num_req, next_n, heads, 128).to(torch.float8_e4m3fn)
    w = torch.randn(num_req * next_n, heads)
    block_table = torch.stack([torch.randperm(10)[:5] for _ in range(num_req)]).int()
    # Causal MTP tail: draft j sees one more pool-granular length at pool boundaries.
    last = torch.tensor([page_pools, 1, 4 * page_pools + 3])  # exactly one page; one pool; 4+ pages
    ctx = (last[:, None] - (next_n - 1) + torch.arange(next_n)[None, :]).clamp_min(0).int()
    ctx[1] = 0  # a request with no complete pool yet
    out = torch.full((num_req * next_n, 5 * page_pools), float("nan"))
    paged.indexer_logits_paged(q, w, cache, block_table, ctx.contiguous(), out, num_programs=3)
    want = paged.indexer_logits_paged_ref(q, w, cache, block_table, ctx)
    _compare_visible(out, want)


@interpreted
def test_indexer_logits_ragged_prefill_rows():
    num_tokens, heads, keys = 9, 32, 140
    q = torch.randn(num_tokens, heads, 128).to(torch.float8_e4m3fn)
    w = torch.randn(num_tokens, heads)
    k = torch.randn(keys, 128).to(torch.float8_e4m3fn)
    k_scale = torch.exp2(torch.randint(-7, 1, (keys,)).float())
    # Two requests back to back: causal pool counts grow by one every kpool tokens.
    starts = torch.tensor([0] * 4 + [70] * 5, dtype=torch.int32)
    ends = starts + torch.tensor([0, 1, 1, 66, 3, 4, 30, 69, 70], dtype=torch.int32)
    out = torch.full((num_tokens, keys), float("nan"))
    ragged.indexer_logits_ragged(q, w, k, k_scale, starts, ends, out)
    want = ragged.indexer_logits_ragged_ref(q, w, k, k_scale, starts, ends)
    _compare_visible(out, want)


@interpreted
def test_kpool_topk_matches_reference_on_ties_short_rows_and_tail():
    kpool, select = 4, 16
    rows, width = 8, 1500
    logits = torch.randn(rows, width)
    logits[1] = torch.randint(0, 4, (width,)).float()  # heavy ties across the threshold
    logits[2] = float("-inf")  # every visible pool scores -inf
    logits[3] = torch.randn(width).to(torch.float8_e4m3fn).float()  # coarse values, many ties
    logits[4, :] = -torch.rand(width)  # all negative
    seq = torch.tensor([0, 1400 * kpool + 2, 100 * kpool + 3, 1300 * kpool, select * kpool,
                        select * kpool + 1 + kpool, 5, 1], dtype=torch.int32)
    starts = torch.tensor([0, 7, 0, 100, 3, 0, 1, 0], dtype=torch.int32)
    out_width = select * kpool + kpool - 1 + 9
    got = torch.full((rows, out_width), 12345, dtype=torch.int32)
    topk.kpool_topk(logits, seq, got, kpool=kpool, select_pools=select, row_starts=starts)
    want = torch.full_like(got, 777)
    topk.kpool_topk_ref(logits, seq, want, kpool=kpool, select_pools=select, row_starts=starts)
    assert torch.equal(got, want)
    assert got[0].eq(-1).all()  # an empty (padding) row
    assert got[6, select * kpool : select * kpool + 3].tolist() == [4, -1, -1]  # 1 pool + 1 tail
    # The two-stage (decode) path: per-slice candidates, then a merge; identical output.
    for slices in (2, 5):
        ws = topk.kpool_topk_workspace(rows, select, num_sms=1, device="cpu", slices=slices)
        ws.values.fill_(float("nan"))
        ws.pools.fill_(-7)
        two = torch.full_like(got, 4321)
        topk.kpool_topk(logits, seq, two, kpool=kpool, select_pools=select, row_starts=starts,
                        workspace=ws, direct_max=100)  # rows of > 100 pools take two stages
        assert torch.equal(two, want), slices


@interpreted
@pytest.mark.parametrize("kpool, ring", [(16, 18), (4, 6), (4, 4)])
def test_kpool_decode_update_matches_reference_over_mtp_steps(kpool, ring):
    """Three requests (distinct tail blocks and pool pages, one padded to fewer tokens) through
    MTP verify steps with rejected drafts; the Triton kernel and the reference must leave the
    same ring and the same pools (the pools bit for bit, but for rare last-bit `exp` flips).

    A flip moves one bf16 element of the pooled key by an ulp before the Hadamard rotation,
    which spreads it over all 128 outputs: small outputs may then land a few fp8 codes apart,
    so the tolerance is relative to the row's scale, not to each value."""
    from glmctl.kernels.kpool_cache_write import kpool_decode_update_ref

    seed = torch.seed()  # fresh inputs each run; the seed reproduces a failure
    num_req, next_n, page_pools = 3, 4, 4
    blocks = torch.tensor([2, 0, 3])
    pages = torch.randperm(18).view(num_req, 6)  # disjoint, as vLLM's allocator gives them
    ape = torch.randn(kpool, 128)
    tail = torch.randn(4, 2, ring, 128).to(torch.bfloat16)
    cache = (torch.randn(18, page_pools * 132 + 8) * 50).to(torch.uint8)[:, : page_pools * 132]
    cache = cache.view(18, page_pools, 132)  # page stride > page size, random old contents
    caches, tails = [cache, cache.clone()], [tail, tail.clone()]
    first = torch.tensor([kpool - 2, 3 * kpool - 1, 2 * kpool + 1])
    for _ in range(8):
        pos = first[:, None] + torch.arange(next_n)[None]
        valid = torch.ones_like(pos, dtype=torch.bool)
        valid[1, 3:] = False  # request 1 has fewer tokens this step (padding)
        pool = pos // kpool
        slots = pages.gather(1, (pool // page_pools).clamp_max(5)) * page_pools + pool % page_pools
        slots = torch.where(((pos + 1) % kpool == 0) & valid, slots, -1)
        tail_slots = torch.where(valid, blocks[:, None] * ring + pos % ring, -1)
        positions = torch.where(valid, pos, -1).int()
        k = torch.randn(num_req, next_n, 128).to(torch.bfloat16)
        g = (3 * torch.randn(num_req, next_n, 128)).to(torch.bfloat16)
        decode_write.kpool_decode_update(caches[0], tails[0], tail_slots, k, g, ape, slots,
                                         positions, kpool)
        kpool_decode_update_ref(caches[1], tails[1], tail_slots, k, g, ape, slots, positions,
                                kpool)
        first = first + torch.randint(1, next_n + 1, (num_req,))  # 0..3 drafts accepted
    assert torch.equal(tails[0], tails[1]), seed
    from glmctl.kernels.layouts import indexer_page_views

    (v0, s0), (v1, s1) = indexer_page_views(caches[0]), indexer_page_views(caches[1])
    assert torch.equal(s0.view(torch.int32), s1.view(torch.int32)), seed  # bytes: NaN garbage
    differ = (v0.view(torch.uint8) != v1.view(torch.uint8)).any(-1)
    assert differ.sum() <= 1, seed
    if differ.any():  # a written row (the old contents are identical in both caches)
        a, b = v0[differ].double(), v1[differ].double()
        assert torch.allclose(a, b, rtol=0.13, atol=448 * 2**-10), (seed, a, b)
