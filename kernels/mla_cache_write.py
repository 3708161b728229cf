"""Write MLA latent rows into vLLM's latent cache (``concat_and_cache_mla`` for GLM-5.3-Flash).

``mla_cache_write(kv_c, slot_mapping, kv_cache)`` / ``mla_cache_write_ref`` (same signature).

* ``kv_c``: ``[T, 512]`` bf16 (the normalised latent, ``kv_a_layernorm`` output; no RoPE part).
* ``slot_mapping``: ``[T]`` int64, vLLM's slots (``block * block_size + row``); negative = skip.
* ``kv_cache``: ``[num_blocks, block_size, 512]`` bf16 (copied as is) or
  ``[num_blocks, block_size, 656]`` uint8 in the ``fp8_ds_mla`` layout (``layouts`` module doc):
  per 128-wide tile ``scale = max(amax / 448, FLT_MIN)``, values ``rtne_sat(x / scale)``; bytes
  [528, 656) are written as zeros (GLM-5.3-Flash has no RoPE part).

One program per token; no allocation; lengths come from the tensors (graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_bits import e4m3_bits
from .layouts import (
    FP8_DS_MLA_ROW_BYTES,
    FP8_DS_MLA_SCALE_OFFSET,
    FP8_MAX,
    KV_BF16,
    LATENT_DIM,
    SCALE_TILE,
    mla_kv_format,
)

FLT_MIN = 1.1754943508222875e-38


@triton.jit
def _mla_cache_write_kernel(
    kv_c_ptr,
    kv_c_stride,
    slot_ptr,
    cache_u8_ptr,  # the cache as bytes (fp8 layout) or as bf16 elements (bf16 layout)
    cache_f32_ptr,  # the same cache viewed as fp32 (scales); unused for bf16
    block_size,
    block_stride,  # in elements of cache_u8_ptr
    row_stride,
    FP8: tl.constexpr,
    TILES: tl.constexpr,
    TILE: tl.constexpr,
    SCALE_OFFSET: tl.constexpr,
    ROW_BYTES: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    row = (slot // block_size) * block_stride + (slot % block_size) * row_stride
    tile = tl.arange(0, TILES)[:, None]
    lane = tl.arange(0, TILE)[None, :]
    x = tl.load(kv_c_ptr + token * kv_c_stride + tile * TILE + lane)
    if FP8:
        xf = x.to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(xf), axis=1) / 448.0, 1.1754943508222875e-38)
        q = e4m3_bits(xf / scale[:, None])
        tl.store(cache_u8_ptr + row + tile * TILE + lane, q.to(tl.uint8))
        tl.store(cache_f32_ptr + (row + SCALE_OFFSET) // 4 + tl.arange(0, TILES), scale)
        rope = tl.arange(0, ROW_BYTES - SCALE_OFFSET - 4 * TILES)
        tl.store(cache_u8_ptr + row + SCALE_OFFSET + 4 * TILES + rope, tl.zeros_like(rope).to(tl.uint8))
    else:
        tl.store(cache_u8_ptr + row + tile * TILE + lane, x)


def mla_cache_write(kv_c: torch.Tensor, slot_mapping: torch.Tensor, kv_cache: torch.Tensor) -> None:
    """Quantise (fp8_ds_mla) or copy (bf16) ``kv_c`` rows into ``kv_cache`` at ``slot_mapping``."""
    fmt = mla_kv_format(kv_cache)
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    assert kv_c.shape[-1] == LATENT_DIM and kv_c.stride(-1) == 1
    if fmt == KV_BF16:
        cache, cache_f32 = kv_cache, kv_cache
    else:
        cache, cache_f32 = kv_cache, kv_cache.view(torch.float32)
    _mla_cache_write_kernel[(num_tokens,)](
        kv_c,
        kv_c.stride(0),
        slot_mapping,
        cache,
        cache_f32,
        kv_cache.shape[1],
        kv_cache.stride(0),
        kv_cache.stride(1),
        FP8=fmt != KV_BF16,
        TILES=LATENT_DIM // SCALE_TILE,
        TILE=SCALE_TILE,
        SCALE_OFFSET=FP8_DS_MLA_SCALE_OFFSET,
        ROW_BYTES=FP8_DS_MLA_ROW_BYTES,
        num_warps=2,
    )


def mla_cache_write_ref(
    kv_c: torch.Tensor, slot_mapping: torch.Tensor, kv_cache: torch.Tensor
) -> None:
    """Torch reference of :func:`mla_cache_write` (vectorised; used by the CPU plugin path)."""
    fmt = mla_kv_format(kv_cache)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    if slots.numel() == 0:
        return
    block_size = kv_cache.shape[1]
    block, row = slots // block_size, slots % block_size
    x = kv_c[keep]
    if fmt == KV_BF16:
        kv_cache[block, row] = x.to(kv_cache.dtype)
        return
    tiles = x.float().unflatten(-1, (LATENT_DIM // SCALE_TILE, SCALE_TILE))
    scale = (tiles.abs().amax(-1) / FP8_MAX).clamp_min(FLT_MIN)
    values = (tiles / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    packed = torch.zeros((x.shape[0], FP8_DS_MLA_ROW_BYTES), dtype=torch.uint8, device=x.device)
    packed[:, :LATENT_DIM] = values.flatten(-2).view(torch.uint8)
    packed[:, FP8_DS_MLA_SCALE_OFFSET : FP8_DS_MLA_SCALE_OFFSET + 16] = (
        scale.contiguous().view(torch.uint8)
    )
    kv_cache[block, row] = packed
