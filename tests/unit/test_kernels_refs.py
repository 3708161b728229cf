"""The torch references (the CPU serving path) against naive per-row oracles written from the
layout documents, on vLLM's real cache shapes at tiny sizes. Fresh random inputs every run."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from glmctl.kernels import layouts  # noqa: E402
from glmctl.kernels.indexer_logits_paged import indexer_logits_paged_ref  # noqa: E402
from glmctl.kernels.indexer_logits_ragged import (  # noqa: E402
    gather_indexer_keys_ref,
    indexer_logits_ragged_ref,
)
from glmctl.kernels.kpool_cache_write import (  # noqa: E402
    hadamard128_ref,
    indexer_q_quant_ref,
    kpool_compress_ref,
    kpool_decode_update_ref,
    kpool_prefill_write_ref,
    kpool_tail_seed_ref,
)
from glmctl.kernels.kpool_topk import kpool_topk_ref  # noqa: E402
from glmctl.kernels.mla_cache_write import mla_cache_write_ref  # noqa: E402
from glmctl.kernels.sparse_mla_decode import sparse_mla_decode_ref  # noqa: E402
from glmctl.kernels.sparse_slots import sparse_rows_ref  # noqa: E402

KPOOL = 4


def _fp8_row_oracle(row_bytes: torch.Tensor) -> torch.Tensor:
    """Decode one 656-byte fp8_ds_mla row from the byte offsets in layouts' docstring."""
    values = row_bytes[:512].view(torch.float8_e4m3fn).double()
    scales = row_bytes[512:528].view(torch.float32).double()
    return values * scales.repeat_interleave(128)


def test_fp8_cache_write_ref_layout():
    """The 512-byte fp8 row: byte d is e4m3(latent[d] / k_scale), rounded to nearest (ties to
    even) and saturated at +-448; nothing else is stored; other rows are untouched."""
    cache = torch.full((3, 4, 512), 0xAB, dtype=torch.uint8)
    latent = (torch.randn(4, 512) * torch.rand(4, 1) * 10).to(torch.bfloat16)
    latent[3, :4] = torch.tensor([1e4, -1e4, 0.0, 2.0 ** -14])
    k_scale = torch.tensor(0.0625 * 1.37)
    slots = torch.tensor([0, 5, -1, 11])
    mla_cache_write_ref(latent, slots, cache, k_scale)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        row = cache[slot // 4, slot % 4]
        decoded = row.view(torch.float8_e4m3fn).double()
        scaled = (latent[i].double() / k_scale.double()).clamp(-448, 448)
        # e4m3: 3 mantissa bits (half a step: 2^-4 relative), subnormal step 2^-9
        assert bool(((decoded - scaled).abs() <= scaled.abs() * 2**-4 + 2**-10).all())
    assert cache[2, 3, 0].view(torch.float8_e4m3fn).item() == 448.0
    assert cache[2, 3, 1].view(torch.float8_e4m3fn).item() == -448.0
    assert cache[2, 3, 3].item() == 0  # below half the smallest subnormal: flushed
    assert bool((cache[0, 2] == 0xAB).all())  # slot 2 was never written


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
def test_mla_cache_write_ref_layout(fmt):
    num_blocks, block_size = 3, 4
    if fmt == "bf16":
        cache = torch.full((num_blocks, block_size, 512), 7.0, dtype=torch.bfloat16)
    else:
        cache = torch.full((num_blocks, block_size, 656), 0xAB, dtype=torch.uint8)
    latent = (torch.randn(4, 512) * torch.rand(4, 1) * 10).to(torch.bfloat16)
    slots = torch.tensor([0, 5, -1, 11])
    mla_cache_write_ref(latent, slots, cache)
    for i, slot in enumerate(slots.tolist()):
        row = cache[slot // block_size, slot % block_size] if slot >= 0 else None
        if row is None:
            continue
        if fmt == "bf16":
            assert torch.equal(row, latent[i])
            continue
        decoded = _fp8_row_oracle(row)
        tiles = latent[i].double().view(4, 128)
        scale = tiles.abs().amax(1) / 448
        assert torch.allclose(row[512:528].view(torch.float32).double(), scale, rtol=1e-6)
        # e4m3 keeps 3 mantissa bits: error <= half a step (2^-4 relative) of each value
        err = (decoded - latent[i].double()).abs()
        assert bool((err <= latent[i].double().abs() * 2**-4 + scale.repeat_interleave(128) * 2**-9).all())
        assert bool((row[528:] == 0).all())
    untouched = cache[0, 2] if fmt == "bf16" else cache[0, 2]
    assert bool((untouched == (7.0 if fmt == "bf16" else 0xAB)).all())


def _sparse_mla_oracle(q, latents, indices, scale):
    """Per token and head, in float64, from a dense [rows, 512] latent table."""
    num_tokens, num_heads, _ = q.shape
    out = torch.zeros(num_tokens, num_heads, 512, dtype=torch.float64)
    lse = torch.full((num_tokens, num_heads), -math.inf, dtype=torch.float64)
    for t in range(num_tokens):
        rows = [int(i) for i in indices[t] if 0 <= int(i) < latents.shape[0]]
        if not rows:
            continue
        kv = latents[rows]
        s = q[t].double() @ kv.T * scale
        lse[t] = torch.logsumexp(s, dim=1)
        out[t] = torch.softmax(s, dim=1) @ kv
    return out, lse


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_ds_mla"])
def test_sparse_mla_ref_matches_oracle(fmt):
    num_blocks, block_size = 4, 8
    row = 656 if fmt == "fp8_ds_mla" else 512
    dtype = torch.bfloat16 if fmt == "bf16" else torch.uint8
    k_scale = torch.tensor(0.021) if fmt == "fp8" else None
    # Non-contiguous blocks (a page of another layer in between), as vLLM may allocate.
    backing = torch.zeros(num_blocks, block_size + 2, row, dtype=dtype)
    cache = backing[:, :block_size]
    latent = torch.randn(num_blocks * block_size, 512).to(torch.bfloat16)
    slots = torch.arange(num_blocks * block_size)
    mla_cache_write_ref(latent, slots, cache, k_scale)
    rows_per_block = block_size + 2
    flat = (slots // block_size) * rows_per_block + slots % block_size
    table = torch.zeros(num_blocks * rows_per_block, 512, dtype=torch.float64)
    stored = cache[slots // block_size, slots % block_size]
    if fmt == "fp8":  # from the layout document: e4m3 value times the per-tensor scale
        table[flat] = stored.view(torch.float8_e4m3fn).double() * 0.021
        cache = cache.view(torch.float8_e4m3fn)  # as vLLM's attention layer hands it over
    else:
        table[flat] = layouts.dequant_latent_rows(stored, fmt).double()
    q = torch.randn(4, 3, 512).to(torch.bfloat16)
    indices = flat[torch.randint(0, len(flat), (4, 10))].int()
    indices[1, 4:] = -1  # fewer valid than k
    indices[2] = -1  # none valid
    indices[3, 0] = 10**6  # out of range: ignored, never read
    out, lse = sparse_mla_decode_ref(q, cache, indices, 0.07, kv_scale=k_scale)
    want_out, want_lse = _sparse_mla_oracle(q, table, indices, 0.07)
    assert torch.allclose(out.double(), want_out, atol=2e-2, rtol=2e-2)
    assert torch.allclose(lse.double(), want_lse, atol=1e-4)
    assert bool((out[2] == 0).all()) and bool(torch.isneginf(lse[2]).all())


def _indexer_cache(num_pages, page_pools, pad_bytes=0):
    backing = torch.zeros(num_pages, page_pools * 132 + pad_bytes, dtype=torch.uint8)
    cache = backing[:, : page_pools * 132].view(num_pages, page_pools, 132)
    values = torch.randn(num_pages, page_pools, 128).to(torch.float8_e4m3fn)
    scales = torch.exp2(torch.randint(-8, 0, (num_pages, page_pools)).float())
    for p in range(num_pages):
        backing[p, : page_pools * 128] = values[p].reshape(-1).view(torch.uint8)
        backing[p, page_pools * 128 : page_pools * 132] = scales[p].view(torch.uint8)
    return cache, values, scales


def test_indexer_page_views_follow_the_page_layout():
    cache, values, scales = _indexer_cache(3, 8, pad_bytes=12)
    v, s = layouts.indexer_page_views(cache)
    assert torch.equal(v.view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(s, scales)


def test_indexer_logits_paged_ref_matches_oracle():
    page_pools, num_pages = 8, 6
    cache, values, scales = _indexer_cache(num_pages, page_pools)
    num_req, next_n, heads = 2, 3, 4
    q = torch.randn(num_req, next_n, heads, 128).to(torch.float8_e4m3fn)
    w = torch.randn(num_req * next_n, heads)
    block_table = torch.tensor([[5, 0, 3], [1, 4, 2]], dtype=torch.int32)
    lens = torch.tensor([[9, 10, 11], [0, 1, 24]], dtype=torch.int32)
    got = indexer_logits_paged_ref(q, w, cache, block_table, lens)
    for b in range(num_req):
        for n in range(next_n):
            r = b * next_n + n
            for p in range(24):
                if p >= lens[b, n]:
                    assert got[r, p] == -math.inf
                    continue
                page, slot = int(block_table[b, p // page_pools]), p % page_pools
                k = values[page, slot].double()
                dots = q[b, n].double() @ k
                want = scales[page, slot].double() * (w[r].double() * dots.clamp_min(0)).sum()
                assert abs(float(got[r, p]) - float(want)) <= 1e-4 * (1 + abs(float(want)))


def test_indexer_logits_ragged_ref_and_gather():
    page_pools = 4
    cache, values, scales = _indexer_cache(5, page_pools)
    block_table = torch.tensor([[4, 1, 0], [2, 3, 0]], dtype=torch.int32)
    cu = torch.tensor([0, 6, 9], dtype=torch.int32)
    k, ks = gather_indexer_keys_ref(cache, block_table, cu)
    want_rows = [(4, 0), (4, 1), (4, 2), (4, 3), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2)]
    for i, (page, slot) in enumerate(want_rows):
        assert torch.equal(k[i].view(torch.uint8), values[page, slot].view(torch.uint8))
        assert ks[i] == scales[page, slot]
    q = torch.randn(3, 2, 128).to(torch.float8_e4m3fn)
    w = torch.randn(3, 2)
    starts = torch.tensor([0, 0, 6], dtype=torch.int32)
    ends = torch.tensor([2, 6, 8], dtype=torch.int32)
    got = indexer_logits_ragged_ref(q, w, k, ks, starts, ends)
    for t in range(3):
        for s in range(9):
            if not starts[t] <= s < ends[t]:
                assert got[t, s] == -math.inf
                continue
            dots = q[t].double() @ k[s].double()
            want = ks[s].double() * (w[t].double() * dots.clamp_min(0)).sum()
            assert abs(float(got[t, s]) - float(want)) <= 1e-4 * (1 + abs(float(want)))


def _topk_oracle(scores, seq_len, kpool, select_pools, width):
    n = seq_len // kpool
    ranked = sorted(range(n), key=lambda p: (-scores[p], p))[:select_pools]
    row = [-1] * width
    for j, p in enumerate(sorted(ranked)):
        for o in range(kpool):
            row[j * kpool + o] = p * kpool + o
    for i in range(seq_len - n * kpool):
        row[select_pools * kpool + i] = n * kpool + i
    return row


def test_kpool_topk_ref_matches_oracle_with_ties_and_tail():
    select, width = 3, 3 * KPOOL + KPOOL - 1 + 5
    logits = torch.randn(6, 12)
    logits[2, :] = 1.0  # all tied: the lowest pools win
    logits[3, 4] = float("-inf")  # a visible -inf still ranks above nothing
    seq = torch.tensor([0, 7, 40, 22, 3 * KPOOL, 9], dtype=torch.int32)
    starts = torch.tensor([0, 0, 1, 2, 0, 3], dtype=torch.int32)
    out = torch.full((6, width), 99, dtype=torch.int32)
    kpool_topk_ref(logits, seq, out, kpool=KPOOL, select_pools=select, row_starts=starts)
    for r in range(6):
        scores = [float(x) for x in logits[r, int(starts[r]):]]
        want = _topk_oracle(scores, int(seq[r]), KPOOL, select, width)
        assert out[r].tolist() == want, r


def test_hadamard_and_q_quant_match_the_matrix_definition():
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 128:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    x = torch.randn(5, 128)
    assert torch.allclose(hadamard128_ref(x).double(), x.double() @ h / math.sqrt(128), atol=1e-5)
    q = (torch.randn(6, 128) * 3).to(torch.bfloat16)
    q8, scale = indexer_q_quant_ref(q)
    assert q8.dtype == torch.float8_e4m3fn and scale.shape == (6, 1)
    assert bool((torch.log2(scale) == torch.round(torch.log2(scale))).all())  # ue8m0
    rotated = q.double() @ h / math.sqrt(128)
    assert torch.allclose(q8.double() * scale.double(), rotated, rtol=0.07, atol=scale.max().item() * 0.07)


def _pool_oracle(k, g, ape):
    """One pool from the definition: softmax(gate + ape) over tokens per channel."""
    p = torch.softmax(g.double() + ape.double(), dim=0)
    return (p * k.double()).sum(0)


def test_kpool_prefill_seed_and_decode_write_every_pool_from_the_right_tokens():
    """A request prefills 10 tokens then decodes 3 MTP steps of 3 tokens: every completed pool in
    the cache must be the compression of exactly its kpool raw tokens."""
    torch.manual_seed(torch.seed() % 2**31)
    total, prefill = 19, 10
    k = torch.randn(total, 128).to(torch.bfloat16)
    g = torch.randn(total, 128).to(torch.bfloat16)
    ape = torch.randn(KPOOL, 128)
    page_pools = 4
    cache = torch.zeros(4, page_pools, 132, dtype=torch.uint8)
    pool_pages = [2, 0]  # request's pool pages
    tail = torch.zeros(3, 2, KPOOL, 128, dtype=torch.bfloat16)
    tail_block = 1

    def pool_slot(pos):
        if (pos + 1) % KPOOL:
            return -1
        p = pos // KPOOL
        return pool_pages[p // page_pools] * page_pools + p % page_pools

    pos = torch.arange(prefill)
    slots = torch.tensor([pool_slot(int(p)) for p in pos])
    kpool_prefill_write_ref(cache, k[:prefill], g[:prefill], ape, slots, KPOOL)
    kpool_tail_seed_ref(tail, k[:prefill], g[:prefill], tail_block * KPOOL + pos % KPOOL, KPOOL)
    start = prefill
    while start < total:
        n = min(3, total - start)
        p = torch.arange(start, start + n)[None]
        kpool_decode_update_ref(cache, tail, tail_block * KPOOL + p % KPOOL, k[p], g[p], ape,
                                torch.tensor([[pool_slot(int(x)) for x in p[0]]]), p, KPOOL)
        start += n
    values, scales = layouts.indexer_page_views(cache)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 128:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    for pool in range(total // KPOOL):
        page, slot = pool_pages[pool // page_pools], pool % page_pools
        got = values[page, slot].double() * scales[page, slot].double()
        toks = slice(pool * KPOOL, pool * KPOOL + KPOOL)
        want = _pool_oracle(k[toks], g[toks], ape) @ h / math.sqrt(128)
        # e4m3 rounding (2^-4 relative) plus the two bf16 roundings the Hadamard spreads
        assert torch.allclose(got, want, rtol=0.07, atol=2**-7 * float(want.abs().max())), pool
        exact = kpool_compress_ref(k[toks][None], g[toks][None], ape)
        assert torch.equal(values[page, slot].view(torch.uint8), exact[0][0].view(torch.uint8))
    # The ring holds the in-progress pool's raw tokens (positions 16..18).
    for pos in range(16, total):
        assert torch.equal(tail[tail_block, 0, pos % KPOOL], k[pos])
        assert torch.equal(tail[tail_block, 1, pos % KPOOL], g[pos])


def test_sparse_rows_ref_matches_vllm_conversion():
    block_table = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    tok = torch.tensor([[0, 5, 9, -1, 16], [3, 12, -1, -1, 8]], dtype=torch.int32)
    rows = sparse_rows_ref(tok, torch.tensor([0, 1], dtype=torch.int32), block_table, 8, 10)
    assert rows.tolist() == [[30, 35, 11, -1, -1], [3, 24, -1, -1, 20]]


def _mtp_verify_schedule(cache, tail, k_true, g_true, ape, prefill, accepted, pool_slot, decode,
                         kpool=KPOOL, drafts=3):
    """Drive a kpool decode update through MTP verify steps: each step writes the first unverified
    token (true) and `drafts` drafts, of which the first `accepted[i]` are true and the rest
    carry garbage keys (rejected); the next step starts right after the accepted ones."""
    ring = tail.shape[2]
    f = prefill
    for a in accepted:
        pos = torch.arange(f, f + 1 + drafts)
        k = torch.randn(1 + drafts, 128).to(torch.bfloat16) * 9
        g = torch.randn(1 + drafts, 128).to(torch.bfloat16) * 9
        k[: 1 + a], g[: 1 + a] = k_true[f : f + 1 + a], g_true[f : f + 1 + a]
        slots = torch.tensor([pool_slot(int(p)) for p in pos])
        decode(cache, tail, (pos % ring)[None], k[None], g[None], ape, slots[None],
               pos[None].int(), kpool)
        f += a + 1
    return f  # tokens 0 .. f - 1 are final


@pytest.mark.parametrize("drafts", [2, 3])
def test_kpool_mtp_rejections_keep_every_pool_exact_with_the_policy_ring(drafts):
    """Verify steps that accept 0..drafts drafts, with rejected drafts crossing pool boundaries:
    with the plugin's ring (kpool + drafts - 1 slots) every final pool is the compression of its
    true tokens; vLLM's one-pool ring loses an accepted token to a rejected draft."""
    from glmctl.kernels.layouts import kpool_tail_ring

    torch.manual_seed(torch.seed() % 2**31)
    total, prefill = 64, 6
    k_true = torch.randn(total, 128).to(torch.bfloat16)
    g_true = torch.randn(total, 128).to(torch.bfloat16)
    ape = torch.randn(KPOOL, 128)
    accepted = [0, drafts, 1, 0, 0, drafts - 1, 1, 0, drafts, 0, 0, 1, 0, 0, 0, 1, 0, 0]

    def pool_slot(pos):
        return pos // KPOOL if (pos + 1) % KPOOL == 0 else -1

    def run(ring):
        cache = torch.zeros(1, 32, 132, dtype=torch.uint8)
        tail = torch.zeros(1, 2, ring, 128, dtype=torch.bfloat16)
        pos = torch.arange(prefill)
        slots = torch.tensor([pool_slot(int(p)) for p in pos])
        kpool_prefill_write_ref(cache, k_true[:prefill], g_true[:prefill], ape, slots, KPOOL)
        kpool_tail_seed_ref(tail, k_true[:prefill], g_true[:prefill], pos % ring, KPOOL)
        done = _mtp_verify_schedule(cache, tail, k_true, g_true, ape, prefill, accepted, pool_slot,
                                    kpool_decode_update_ref, drafts=drafts)
        values, scales = layouts.indexer_page_views(cache)
        wrong = []
        for pool in range(done // KPOOL):
            want = kpool_compress_ref(k_true[pool * KPOOL : pool * KPOOL + KPOOL][None],
                                      g_true[pool * KPOOL : pool * KPOOL + KPOOL][None], ape)
            if not (torch.equal(values[0, pool].view(torch.uint8), want[0][0].view(torch.uint8))
                    and scales[0, pool] == want[1][0]):
                wrong.append(pool)
        return done, wrong

    done, wrong = run(kpool_tail_ring(KPOOL, drafts))
    assert done // KPOOL >= 8 and wrong == []
    _, wrong = run(KPOOL)
    assert wrong, "the schedule must exercise the one-pool ring's hazard"
