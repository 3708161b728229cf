"""The kpool indexer's cache writes (torch references; vLLM's own Triton kernels for these run
unchanged on sm_8x, so the GPU path keeps them and the CPU path uses these).

Numerics follow vLLM 0.30's ``models/glm5next/nvidia/ops/kpool_compress.py`` step for step (same
roundings, same butterfly order, sums accumulated in pool order), so a pool written here matches
one written there except where ``exp`` differs in its last bit:

1. pool = ``sum_i softmax_i(gate_i + ape_i) * k_i`` per channel over the ``kpool`` tokens (fp32,
   max-subtracted), rounded to bf16;
2. Hadamard-128 rotation as seven fp32 butterfly stages (strides 1, 2, ..., 64) times
   ``1/sqrt(128)``, rounded to bf16;
3. ue8m0 fp8: ``scale = 2^ceil(log2(max(amax, 1e-4) / 448))``, values ``clamp(x / scale, +-448)``
   rounded to e4m3 (RTNE).

Public functions (shapes; bf16 unless noted):

* ``hadamard128_ref(x [..., 128] fp32) -> fp32``.
* ``indexer_q_quant_ref(q [rows, 128]) -> (q_fp8 [rows, 128] e4m3, scale [rows, 1] fp32)``
  (vLLM's ``fwht128_quant_fp8``: Hadamard, bf16, ue8m0 fp8).
* ``kpool_compress_ref(slot_k [n, kpool, 128], slot_score [n, kpool, 128], ape [kpool, 128] fp32)
  -> (fp8 [n, 128], scale [n] fp32)``.
* ``indexer_cache_store_ref(kv_cache, values [n, 128] e4m3, scales [n] fp32, loc [n] int64)``:
  store pools at pool-granular slots ``loc`` (page ``loc // page_pools``), skipping ``loc < 0``.
* ``kpool_prefill_write_ref(kv_cache, k [T, 128], gate [T, 128], ape, slot_mapping [T], kpool)``:
  the prefill write (vLLM ``_kpool_compress_insert``): token ``i`` with ``slot_mapping[i] >= 0``
  and ``i >= kpool - 1`` completes the pool of tokens ``i - kpool + 1 .. i``.
* ``kpool_tail_seed_ref(tail_cache [blocks, 2, kpool, 128], k, gate, tail_slots [T], kpool)``: copy
  each request's last (up to) ``kpool`` prefill tokens into its tail ring.
* ``kpool_decode_update_ref(kv_cache, tail_cache, tail_slots [B, N], k [B, N, 128],
  gate [B, N, 128], ape, slot_mapping [B, N], positions [B, N], kpool)``: decode / MTP verify:
  tokens of one request in order; a token at ``position % kpool == kpool - 1`` with a valid slot
  completes its pool from the ring (and itself), then every valid token is stashed in the ring.
"""

from __future__ import annotations

import torch

from .layouts import FP8_MAX, INDEXER_HEAD_DIM, indexer_page_views

INV_SQRT_128 = 0.08838834764831845


def hadamard128_ref(x: torch.Tensor) -> torch.Tensor:
    """Hadamard-128 rotation in vLLM's butterfly order (fp32, bit-identical to its kernel)."""
    assert x.shape[-1] == INDEXER_HEAD_DIM
    lead = x.shape[:-1]
    x = x.float().reshape(-1, INDEXER_HEAD_DIM)
    stride = 1
    while stride < INDEXER_HEAD_DIM:
        pairs = x.view(-1, INDEXER_HEAD_DIM // (2 * stride), 2, stride)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        x = torch.stack((a + b, a - b), dim=2).reshape(-1, INDEXER_HEAD_DIM)
        stride *= 2
    return (x * INV_SQRT_128).reshape(*lead, INDEXER_HEAD_DIM)


def _ue8m0_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    absmax = x.abs().amax(-1).clamp_min(1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(absmax / FP8_MAX)))
    q = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def indexer_q_quant_ref(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM ``fwht128_quant_fp8``: rotate each 128-row, round to bf16, ue8m0 fp8 per row."""
    x = hadamard128_ref(q.float()).to(torch.bfloat16).float()
    values, scale = _ue8m0_quant(x)
    return values, scale.unsqueeze(-1)


def kpool_compress_ref(slot_k: torch.Tensor, slot_score: torch.Tensor,
                       ape: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool ``kpool`` tokens into one Hadamard-rotated ue8m0 fp8 key (see module doc)."""
    logits = slot_score.float() + ape.float()
    probs = torch.exp(logits - logits.amax(dim=1, keepdim=True))
    # Accumulated in pool order, as vLLM's kernels (and ours) do: the fp32 sums then round
    # to bf16 identically.
    pooled = torch.zeros_like(probs[:, 0])
    total = torch.zeros_like(probs[:, 0])
    for i in range(probs.shape[1]):
        total += probs[:, i]
        pooled += slot_k[:, i].float() * probs[:, i]
    pooled = pooled / total
    x = hadamard128_ref(pooled.to(torch.bfloat16).float()).to(torch.bfloat16).float()
    return _ue8m0_quant(x)


def indexer_cache_store_ref(kv_cache: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
                            loc: torch.Tensor) -> None:
    """Store pooled keys at pool-granular slots (negative slots are skipped)."""
    page_values, page_scales = indexer_page_views(kv_cache)
    keep = loc >= 0
    loc = loc[keep].long()
    page_pools = kv_cache.shape[1]
    page, slot = loc // page_pools, loc % page_pools
    page_values[page, slot] = values[keep].to(torch.float8_e4m3fn)
    page_scales[page, slot] = scales[keep].float()


def kpool_prefill_write_ref(kv_cache: torch.Tensor, k: torch.Tensor, gate: torch.Tensor,
                            ape: torch.Tensor, slot_mapping: torch.Tensor, kpool: int) -> None:
    """Compress every pool a prefill batch completes and store it (vLLM's prefill write)."""
    num_tokens = slot_mapping.shape[0]
    if num_tokens < kpool:
        return
    pos = torch.arange(num_tokens, device=k.device)
    write = (slot_mapping >= 0) & (pos >= kpool - 1)
    ends = pos[write]
    if ends.numel() == 0:
        return
    window = ends[:, None] - (kpool - 1) + torch.arange(kpool, device=k.device)[None, :]
    values, scales = kpool_compress_ref(k[window], gate[window], ape)
    indexer_cache_store_ref(kv_cache, values, scales, slot_mapping[write])


def kpool_tail_seed_ref(tail_cache: torch.Tensor, k: torch.Tensor, gate: torch.Tensor,
                        tail_slots: torch.Tensor, kpool: int) -> None:
    """Seed each request's tail ring with its last (up to) ``kpool`` prefill tokens.

    Token ``i`` is in its request's tail iff token ``i + kpool`` is past the batch, padding
    (slot < 0) or in another tail block (vLLM ``kpool_seed_tail_cache``). The ring has
    ``tail_cache.shape[2]`` slots (see ``layouts``); ``tail_slots`` are
    ``block * ring + position % ring``."""
    num_tokens = tail_slots.shape[0]
    if num_tokens == 0:
        return
    ring_size = tail_cache.shape[2]
    slots = tail_slots.long()
    block = torch.div(slots, ring_size, rounding_mode="floor")
    ahead = torch.full_like(slots, -1)
    ahead[: max(0, num_tokens - kpool)] = slots[kpool:]
    ahead_block = torch.where(ahead >= 0, torch.div(ahead, ring_size, rounding_mode="floor"), -1)
    in_tail = (slots >= 0) & ~((ahead >= 0) & (ahead_block == block))
    blk, ring = block[in_tail], slots[in_tail] % ring_size
    tail_cache[blk, 0, ring] = k[in_tail].to(tail_cache.dtype)
    tail_cache[blk, 1, ring] = gate[in_tail].to(tail_cache.dtype)


def kpool_decode_update_ref(kv_cache: torch.Tensor, tail_cache: torch.Tensor,
                            tail_slots: torch.Tensor, k: torch.Tensor, gate: torch.Tensor,
                            ape: torch.Tensor, slot_mapping: torch.Tensor,
                            positions: torch.Tensor, kpool: int) -> None:
    """Decode-step kpool update, batched over requests, in token order within a request.

    The ring has ``tail_cache.shape[2]`` slots (``kpool``, or whole pools more with MTP, see
    ``layouts``); position ``p`` lives in slot ``p % ring``."""
    num_requests, next_n = positions.shape
    ring_size = tail_cache.shape[2]
    offs = torch.arange(kpool, device=k.device)
    for t in range(next_n):  # next_n <= 1 + num_speculative_tokens; batched over requests
        pos = positions[:, t].long()
        loc = slot_mapping[:, t].long()
        tslot = tail_slots[:, t].long()
        block = tslot.clamp_min(0) // ring_size
        ring = pos.clamp_min(0) % ring_size
        completes = (loc >= 0) & (pos >= 0) & (pos % kpool == kpool - 1)
        if bool(completes.any()):
            rows = completes.nonzero().squeeze(1)
            # The pool's tokens pos - kpool + 1 .. pos, in pool order; the last is this token.
            members = (pos[rows, None] - (kpool - 1) + offs[None, :]) % ring_size
            pool_k = tail_cache[block[rows, None], 0, members]  # [n, kpool, 128]
            pool_g = tail_cache[block[rows, None], 1, members]
            is_current = offs[None, :] == kpool - 1
            pool_k = torch.where(is_current[..., None], k[rows, t, None].to(pool_k.dtype), pool_k)
            pool_g = torch.where(is_current[..., None], gate[rows, t, None].to(pool_g.dtype),
                                 pool_g)
            values, scales = kpool_compress_ref(pool_k, pool_g, ape)
            indexer_cache_store_ref(kv_cache, values, scales, loc[rows])
        stash = (pos >= 0) & (tslot >= 0)
        tail_cache[block[stash], 0, ring[stash]] = k[stash, t].to(tail_cache.dtype)
        tail_cache[block[stash], 1, ring[stash]] = gate[stash, t].to(tail_cache.dtype)

