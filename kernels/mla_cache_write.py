"""Write MLA latent rows into vLLM's latent cache (``concat_and_cache_mla`` for GLM-5.3-Flash).

``mla_cache_write(kv_c, slot_mapping, kv_cache, kv_scale=None)`` / ``mla_cache_write_ref`` (same
signature).

* ``kv_c``: ``[T, 512]`` bf16 (the normalised latent, ``kv_a_layernorm`` output; no RoPE part).
* ``slot_mapping``: ``[T]`` int64, vLLM's slots (``block * block_size + row``); negative = skip.
* ``kv_cache`` (see the ``layouts`` module doc):
  - ``[num_blocks, block_size, 512]`` bf16: copied as is;
  - ``[num_blocks, block_size, 512]`` uint8 or float8_e4m3fn (``fp8``): values
    ``rtne_sat(x / kv_scale)`` with an IEEE fp32 division, exactly as vLLM's CUDA
    ``concat_and_cache_mla`` writes ``fp8`` (vLLM CPU has no fp8 MLA cache write at all);
  - ``[num_blocks, block_size, 656]`` uint8 (``fp8_ds_mla``): per 128-wide tile
    ``scale = max(amax / 448, FLT_MIN)``, values ``rtne_sat(x / scale)``; bytes [528, 656) are
    written as zeros (GLM-5.3-Flash has no RoPE part).
* ``kv_scale``: the layer's ``_k_scale`` (0-d fp32 device tensor), required for ``fp8`` only;
  the kernel reads it on the device (no host sync: CUDA-graph safe).

One program per token; no allocation; lengths come from the tensors (graph safe). The divisions
are ``div_rn`` (IEEE), not Triton's default ``/`` (``div.full.f32``, up to 2 ulp off), so the
kernel gives vLLM's and the reference's bits exactly.
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
    KV_FP8,
    LATENT_DIM,
    SCALE_TILE,
    mla_kv_format,
    require_kv_scale,
)

FLT_MIN = 1.1754943508222875e-38
# Kernel modes (the MODE constexpr), one per layout.
MODE_BF16, MODE_FP8_DS_MLA, MODE_FP8 = 0, 1, 2


@triton.jit
def _mla_cache_write_kernel(
    kv_c_ptr,
    kv_c_stride,
    slot_ptr,
    cache_u8_ptr,  # the cache as bytes (fp8 layouts) or as bf16 elements (bf16 layout)
    cache_f32_ptr,  # the same cache viewed as fp32 (fp8_ds_mla scales); unused otherwise
    kv_scale_ptr,  # fp8: the per-tensor scale (fp32 scalar on the device); unused otherwise
    block_size,
    block_stride,  # in elements of cache_u8_ptr
    row_stride,
    MODE: tl.constexpr,
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
    if MODE == 1:  # fp8_ds_mla
        xf = x.to(tl.float32)
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(xf), axis=1), 448.0),
                           1.1754943508222875e-38)
        q = e4m3_bits(tl.math.div_rn(xf, scale[:, None]))
        tl.store(cache_u8_ptr + row + tile * TILE + lane, q.to(tl.uint8))
        tl.store(cache_f32_ptr + (row + SCALE_OFFSET) // 4 + tl.arange(0, TILES), scale)
        rope = tl.arange(0, ROW_BYTES - SCALE_OFFSET - 4 * TILES)
        tl.store(cache_u8_ptr + row + SCALE_OFFSET + 4 * TILES + rope, tl.zeros_like(rope).to(tl.uint8))
    elif MODE == 2:  # fp8, one per-tensor scale
        k_scale = tl.load(kv_scale_ptr)
        q = e4m3_bits(tl.math.div_rn(x.to(tl.float32), k_scale))
        tl.store(cache_u8_ptr + row + tile * TILE + lane, q.to(tl.uint8))
    else:
        tl.store(cache_u8_ptr + row + tile * TILE + lane, x)


def mla_cache_write(kv_c: torch.Tensor, slot_mapping: torch.Tensor, kv_cache: torch.Tensor,
                    kv_scale: torch.Tensor | None = None) -> None:
    """Copy (bf16) or quantise (fp8, fp8_ds_mla) ``kv_c`` rows into ``kv_cache`` at
    ``slot_mapping``."""
    fmt = mla_kv_format(kv_cache)
    require_kv_scale(fmt, kv_scale)
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    assert kv_c.shape[-1] == LATENT_DIM and kv_c.stride(-1) == 1
    if fmt == KV_BF16:
        mode, cache, cache_f32 = MODE_BF16, kv_cache, kv_cache
    elif fmt == KV_FP8:
        mode, cache = MODE_FP8, kv_cache.view(torch.uint8)
        cache_f32 = cache
    else:
        mode, cache, cache_f32 = MODE_FP8_DS_MLA, kv_cache, kv_cache.view(torch.float32)
    _mla_cache_write_kernel[(num_tokens,)](
        kv_c,
        kv_c.stride(0),
        slot_mapping,
        cache,
        cache_f32,
        kv_scale if kv_scale is not None else cache_f32,
        kv_cache.shape[1],
        kv_cache.stride(0),
        kv_cache.stride(1),
        MODE=mode,
        TILES=LATENT_DIM // SCALE_TILE,
        TILE=SCALE_TILE,
        SCALE_OFFSET=FP8_DS_MLA_SCALE_OFFSET,
        ROW_BYTES=FP8_DS_MLA_ROW_BYTES,
        num_warps=2,
    )


def mla_cache_write_ref(kv_c: torch.Tensor, slot_mapping: torch.Tensor, kv_cache: torch.Tensor,
                        kv_scale: torch.Tensor | None = None) -> None:
    """Torch reference of :func:`mla_cache_write` (vectorised; the CPU plugin path's writer)."""
    fmt = mla_kv_format(kv_cache)
    require_kv_scale(fmt, kv_scale)
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
    if fmt == KV_FP8:
        # torch's float -> e4m3fn conversion rounds to nearest even; clamp first = saturate.
        scaled = x.float() / kv_scale.reshape(()).float()
        values = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        kv_cache.view(torch.uint8)[block, row] = values.view(torch.uint8)
        return
    tiles = x.float().unflatten(-1, (LATENT_DIM // SCALE_TILE, SCALE_TILE))
    amax = tiles.abs().amax(-1)
    # A tensor divisor, not the Python scalar: torch on CUDA turns `t / 448.0` into `t * (1/448)`,
    # which is not the IEEE quotient the kernel (div_rn) and the CPU compute (1 ulp apart, seen
    # on the H200 gpu lane).
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp_min(FLT_MIN)
    values = (tiles / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    packed = torch.zeros((x.shape[0], FP8_DS_MLA_ROW_BYTES), dtype=torch.uint8, device=x.device)
    packed[:, :LATENT_DIM] = values.flatten(-2).view(torch.uint8)
    packed[:, FP8_DS_MLA_SCALE_OFFSET : FP8_DS_MLA_SCALE_OFFSET + 16] = (
        scale.contiguous().view(torch.uint8)
    )
    kv_cache[block, row] = packed
