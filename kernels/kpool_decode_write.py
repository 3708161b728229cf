"""The kpool indexer's decode / MTP-verify cache update (Triton), for any tail-ring size.

``kpool_decode_update(kv_cache, tail_cache, tail_slots, k, gate, ape, slot_mapping, positions,
kpool)``: the contract of :func:`kpool_cache_write.kpool_decode_update_ref`. vLLM's own kernel
(``kpool_decode_update_and_maybe_write_cache_batched``) assumes a ring of exactly one pool; with
MTP the plugin gives the ring ``kpool + drafts - 1`` slots (``layouts.kpool_tail_ring``: a
rejected draft past a pool boundary must not overwrite an accepted token of the pool), and this
kernel addresses position ``p`` at ring slot ``p % ring`` (``ring = tail_cache.shape[2]``).

* ``kv_cache``: pool cache ``[pages, page_pools, 132]`` uint8 (``layouts``: values, then scales).
* ``tail_cache``: ``[blocks, 2, ring, 128]`` bf16 (raw key, gate score).
* ``tail_slots`` / ``slot_mapping`` / ``positions``: ``[B, N]`` (block * ring + p % ring; the
  pool-granular slot, valid only on a pool's last token; the position), negative = none.
* ``k``, ``gate``: ``[B, N, 128]`` bf16; ``ape``: ``[kpool, 128]``.

One program per request loads its ``N`` tokens' inputs at once, then walks them in position
order: a token that ends a pool
(``p % kpool == kpool - 1`` with a valid slot) compresses the pool from the ring and itself,
then every valid token is stashed in the ring. Compression as the reference (and vLLM): softmax
over the pool of ``gate + ape`` per channel (max-subtracted, fp32, accumulated in pool order),
pooled key rounded to bf16, Hadamard-128 butterflies (strides 1..64) times ``1/sqrt(128)``
rounded to bf16, ue8m0 scale ``2^ceil(log2(max(amax, 1e-4) / 448))``, e4m3 values (RTNE).
Graph safe: no allocation, no host sync, lengths from the tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_bits import e4m3_bits
from .layouts import FP8_MAX, INDEXER_HEAD_DIM, INDEXER_ROW_BYTES

# Two warps: the up-front loads of four tokens' keys and gates fit in 128 registers (one warp
# needs 255, at sm_89's limit; tests/unit/test_kernels_sm89.py).
DECODE_UPDATE_WARPS = 2


@triton.jit
def _round_bf16(x):
    """fp32 -> nearest bf16 (ties to even), returned as fp32, in integer operations: what the
    GPU's cvt.rn gives for finite values, and also right under the Triton interpreter, whose
    own conversion truncates."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _butterfly(x, STRIDE: tl.constexpr, D: tl.constexpr):
    """One Hadamard stage: (x_i, x_{i+STRIDE}) -> (x_i + x_{i+STRIDE}, x_i - x_{i+STRIDE})
    within groups of 2 * STRIDE."""
    pairs = tl.permute(tl.reshape(x, [D // (2 * STRIDE), 2, STRIDE]), (0, 2, 1))
    a, b = tl.split(pairs)
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), [D])


@triton.jit
def _hadamard128(x, D: tl.constexpr):
    x = _butterfly(x, 1, D)
    x = _butterfly(x, 2, D)
    x = _butterfly(x, 4, D)
    x = _butterfly(x, 8, D)
    x = _butterfly(x, 16, D)
    x = _butterfly(x, 32, D)
    x = _butterfly(x, 64, D)
    return x * 0.08838834764831845


@triton.jit
def _kpool_decode_update_kernel(
    cache_u8_ptr, cache_f32_ptr, page_stride, page_pools,
    tail_ptr, tail_block_stride, tail_half_stride,
    tail_slot_ptr, k_ptr, k_stride_b, k_stride_t, gate_ptr, gate_stride_b, gate_stride_t,
    ape_ptr, slot_ptr, pos_ptr, next_n,
    KPOOL: tl.constexpr, RING: tl.constexpr, D: tl.constexpr, N_PAD: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, D)
    # Every token's inputs are loaded up front (one memory round trip, not one per token: the
    # loop's ring stores would otherwise order each token's loads after the previous token's
    # stores); the loop picks token t's values out of registers with an exact max.
    toks = tl.arange(0, N_PAD)
    live = toks < next_n
    idx = req * next_n + toks
    all_pos = tl.load(pos_ptr + idx, mask=live, other=-1).to(tl.int64)
    all_loc = tl.load(slot_ptr + idx, mask=live, other=-1).to(tl.int64)
    all_tail = tl.load(tail_slot_ptr + idx, mask=live, other=-1).to(tl.int64)
    rows = toks[:, None]
    # keys and gates as their fp32 bit patterns: picking one row by an integer max is exact
    all_key = tl.load(k_ptr + req * k_stride_b + rows * k_stride_t + d[None, :],
                      mask=live[:, None], other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
    all_gate = tl.load(gate_ptr + req * gate_stride_b + rows * gate_stride_t + d[None, :],
                       mask=live[:, None], other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
    for t in range(next_n):  # in position order: a completion reads the stashes before it
        pick = toks == t
        pos = tl.max(tl.where(pick, all_pos, -1), axis=0)
        loc = tl.max(tl.where(pick, all_loc, -1), axis=0)
        tail_slot = tl.max(tl.where(pick, all_tail, -1), axis=0)
        ring = tail_ptr + (tl.maximum(tail_slot, 0) // RING) * tail_block_stride
        key = tl.max(tl.where(pick[:, None], all_key, -2147483648), axis=0)
        key = key.to(tl.float32, bitcast=True)
        gate = tl.max(tl.where(pick[:, None], all_gate, -2147483648), axis=0)
        gate = gate.to(tl.float32, bitcast=True)
        if (loc >= 0) & (pos >= 0) & (pos % KPOOL == KPOOL - 1):
            first = pos - (KPOOL - 1)
            top = tl.full([D], float("-inf"), tl.float32)
            for j in tl.static_range(KPOOL):
                if j == KPOOL - 1:
                    score = gate
                else:
                    score = tl.load(ring + tail_half_stride + ((first + j) % RING) * D + d)
                    score = score.to(tl.float32)
                top = tl.maximum(top, score + tl.load(ape_ptr + j * D + d).to(tl.float32))
            acc = tl.zeros([D], tl.float32)
            den = tl.zeros([D], tl.float32)
            for j in tl.static_range(KPOOL):
                if j == KPOOL - 1:
                    score = gate
                    member = key
                else:
                    slot = ((first + j) % RING) * D
                    score = tl.load(ring + tail_half_stride + slot + d).to(tl.float32)
                    member = tl.load(ring + slot + d).to(tl.float32)
                prob = tl.exp(score + tl.load(ape_ptr + j * D + d).to(tl.float32) - top)
                den += prob
                acc += member * prob
            x = _round_bf16(_hadamard128(_round_bf16(acc / den), D))
            amax = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-4)
            scale = tl.exp2(tl.ceil(tl.log2(amax / 448.0)))
            page = loc // page_pools
            entry = loc % page_pools
            base = page * page_stride
            tl.store(cache_u8_ptr + base + entry * D + d, e4m3_bits(x / scale).to(tl.uint8))
            tl.store(cache_f32_ptr + (base + page_pools * D) // 4 + entry, scale)
        if (pos >= 0) & (tail_slot >= 0):
            at = (pos % RING) * D
            tl.store(ring + at + d, key.to(tl.bfloat16))
            tl.store(ring + tail_half_stride + at + d, gate.to(tl.bfloat16))
        tl.debug_barrier()  # the stash visible to every thread before a later token's completion


def kpool_decode_update(kv_cache: torch.Tensor, tail_cache: torch.Tensor,
                        tail_slots: torch.Tensor, k: torch.Tensor, gate: torch.Tensor,
                        ape: torch.Tensor, slot_mapping: torch.Tensor,
                        positions: torch.Tensor, kpool: int) -> None:
    """Triton kernel; same contract as ``kpool_cache_write.kpool_decode_update_ref``."""
    num_requests, next_n = positions.shape
    if num_requests == 0 or next_n == 0:
        return
    dim = INDEXER_HEAD_DIM
    assert kv_cache.dtype == torch.uint8 and kv_cache.shape[2] == INDEXER_ROW_BYTES
    assert kv_cache.stride(0) % 4 == 0 and kv_cache.stride(1) == INDEXER_ROW_BYTES
    assert tail_cache.dtype == torch.bfloat16 and tail_cache.shape[1] == 2
    assert tail_cache.shape[2] >= kpool and tail_cache.shape[3] == dim
    assert tail_cache.stride(3) == 1 and tail_cache.stride(2) == dim
    assert k.stride(-1) == 1 and gate.stride(-1) == 1 and ape.shape == (kpool, dim)
    assert FP8_MAX == 448.0  # the kernel's constant
    _kpool_decode_update_kernel[(num_requests,)](
        kv_cache, kv_cache.view(torch.float32), kv_cache.stride(0), kv_cache.shape[1],
        tail_cache, tail_cache.stride(0), tail_cache.stride(1),
        tail_slots.contiguous(), k, k.stride(0), k.stride(1), gate, gate.stride(0),
        gate.stride(1), ape.contiguous(), slot_mapping.contiguous(), positions.contiguous(),
        next_n, KPOOL=kpool, RING=tail_cache.shape[2], D=dim,
        N_PAD=triton.next_power_of_2(next_n), num_warps=DECODE_UPDATE_WARPS,
    )
