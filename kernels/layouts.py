"""Cache layouts that vLLM 0.30 allocates and writes for GLM-5.3-Flash, and torch views of them.

Every kernel and reference in this package reads these layouts byte for byte; nothing here invents
a layout of its own.

MLA latent cache (one row per token, GLM-5.3-Flash has no RoPE dims: the latent is 512 wide)
----------------------------------------------------------------------------------------------
Tensor ``kv_cache[num_blocks, block_size, row]``; a token's row is addressed by vLLM's slot
(``slot // block_size`` = block, ``slot % block_size`` = row in block) when writing, and by the
*flat row index* ``block * (kv_cache.stride(0) // kv_cache.stride(1)) + row_in_block`` when
reading (what ``triton_convert_req_index_to_global_index`` produces; equal to the slot when blocks
are contiguous).

* ``KV_BF16`` (``--kv-cache-dtype auto``): row = 512 x bf16 = 1024 B.
* ``KV_FP8`` (``--kv-cache-dtype fp8`` / ``fp8_e4m3``; vLLM's standard FP8 MLA cache, which
  ``MLAAttentionSpec`` sizes as ``block_size x 512 x 1`` B), rows of 512 B::

      bytes [0, 512)  512 x float8_e4m3fn   rtne_sat(float32(latent[d]) / k_scale)

  ``k_scale`` is one fp32 for the whole layer (vLLM's ``layer._k_scale``, a 0-d device tensor:
  1.0 unless the checkpoint carries KV scales); it is not stored in the cache and kernels read
  it on the device. The quotient is an IEEE (round-to-nearest) fp32 division, then rounded to
  e4m3 to nearest even, saturating to +-448 - CUDA's ``__nv_cvt_float_to_fp8(x / scale,
  __NV_SATFINITE, __NV_E4M3)``, which is what vLLM's ``concat_and_cache_mla`` does for ``fp8``.
  vLLM allocates the cache as uint8 and hands the attention backend the same storage viewed as
  ``float8_e4m3fn`` (``MLAAttention.forward_impl``); both dtypes are accepted.
  Dequantised latent: ``latent[d] = float(fp8[d]) * k_scale``. No RoPE tail, no per-row scales:
  GLM-5.3-Flash has no RoPE dims, so this is the smallest exact-layout FP8 row (512 B vs 656).
* ``KV_FP8_DS_MLA`` (``--kv-cache-dtype fp8_ds_mla``; vLLM sizes it with
  ``state_content_bytes = 656``), uint8 rows of 656 B::

      bytes [  0, 512)  512 x float8_e4m3fn   latent[d] / scale[d // 128], RTNE, saturating
      bytes [512, 528)  4 x float32           scale[t] = max(amax(latent[128t:128t+128]) / 448,
                                                             FLT_MIN)   (an arbitrary fp32, not
                                                             a power of two)
      bytes [528, 656)  64 x bf16             the RoPE part of DeepSeek V3.2; GLM-5.3-Flash has
                                              qk_rope_head_dim = 0, so nothing reads it (our
                                              writer stores zeros there)

  Dequantised latent: ``latent[d] = float(fp8[d]) * scale[d // 128]``.  All offsets are 16-byte
  aligned; the row is 41 x 16 B.

Indexer key cache (kpool pools: one entry per ``index_kpool`` = 16 tokens)
--------------------------------------------------------------------------
Tensor ``kv_cache[num_pages, page_pools, 132]`` uint8 (``head_dim + 4``), but the 132-byte "row"
is a stride trick: each page stores all its values first, then all its scales::

      page base = page * kv_cache.stride(0)
      values  of pool-slot j : bytes [base + 128 j, base + 128 j + 128)   128 x e4m3 (Hadamard-
                                rotated pooled key / scale)
      scale   of pool-slot j : bytes [base + 128 page_pools + 4 j, ... + 4)   float32, a power of
                                two (ue8m0 rounding: 2^ceil(log2(max(amax, 1e-4) / 448)))

A request's pool ``p`` lives in page ``block_table[row, p // page_pools]`` at slot
``p % page_pools``; a write goes to the pool-granular slot ``loc`` (page ``loc // page_pools``).

Kpool tail cache
----------------
``tail[num_blocks, 2, kpool, 128]`` bf16: ``[b, 0, i]`` is the raw key and ``[b, 1, i]`` the gate
score of the request's token whose ``position % kpool == i`` (a ring over the in-progress pool).
The tail slot of a token is ``block * kpool + position % kpool``.

Sparse-attention index rows
---------------------------
The indexer writes, per query token, ``topk + kpool - 1`` request-logical token positions
(``2048 + 15`` = 2063): the expanded selected pools (``16 p + o``), then the always-selected tail
(``[16 * (seq_len // 16), seq_len)``), -1 for every unused entry; vLLM pads the buffer to a
multiple of 128 columns (2176) with -1. Sparse MLA reads flat row indices (see above), -1 = none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    import torch

LATENT_DIM = 512
SCALE_TILE = 128
FP8_MAX = 448.0
# fp8_ds_mla row: 512 fp8 values, 4 fp32 scales, 64 bf16 RoPE values (unused by GLM-5.3-Flash).
FP8_DS_MLA_ROW_BYTES = 656
FP8_DS_MLA_SCALE_OFFSET = 512

INDEXER_HEAD_DIM = 128
INDEXER_ROW_BYTES = INDEXER_HEAD_DIM + 4

FP8_ROW_BYTES = LATENT_DIM

KV_BF16 = "bf16"
KV_FP8 = "fp8"
KV_FP8_DS_MLA = "fp8_ds_mla"

# The --kv-cache-dtype values glmctl plans, serves and writes, in vLLM's spelling ("auto": the
# model's dtype, bf16 for GLM-5.3-Flash); other spellings of the same layouts: vLLM's fp8_e4m3
# and bf16 (glmctl's shorthand, which vLLM does not take).
KvCacheDtype = Literal["auto", "bfloat16", "fp8", "fp8_ds_mla"]
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KvCacheDtype)
KV_CACHE_DTYPE_ALIASES = {"fp8_e4m3": "fp8", "bf16": "bfloat16"}


@dataclass(frozen=True)
class KvFormat:
    """An MLA latent-cache layout: bytes of one stored latent value and of one token's row (per
    MLA layer)."""

    name: str
    value_bytes: int
    row_bytes: int


KV_FORMATS = {
    KV_BF16: KvFormat(KV_BF16, 2, 2 * LATENT_DIM),
    KV_FP8: KvFormat(KV_FP8, 1, FP8_ROW_BYTES),
    KV_FP8_DS_MLA: KvFormat(KV_FP8_DS_MLA, 1, FP8_DS_MLA_ROW_BYTES),
}
_FORMAT_OF_DTYPE = {"auto": KV_BF16, "bfloat16": KV_BF16, "fp8": KV_FP8, "fp8_ds_mla": KV_FP8_DS_MLA}


def normalise_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """A --kv-cache-dtype value in vLLM's spelling (`KV_CACHE_DTYPES`); ValueError for one glmctl
    has no layout for."""
    value = kv_cache_dtype.strip().lower()
    value = KV_CACHE_DTYPE_ALIASES.get(value, value)
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)} "
                         f"(or {', '.join(KV_CACHE_DTYPE_ALIASES)})")
    return value


def kv_format(kv_cache_dtype: str) -> KvFormat:
    """The layout vLLM allocates for a ``--kv-cache-dtype`` value (after vLLM's own mapping)."""
    return KV_FORMATS[_FORMAT_OF_DTYPE[normalise_kv_cache_dtype(kv_cache_dtype)]]


# The kpool indexer caches' block-size rules (vLLM's `Glm5NextIndexerCache` and tail cache), which
# the plugin installs in vLLM and the planner predicts with.
def kpool_tail_ring(index_kpool: int, num_speculative_tokens: int = 0) -> int:
    """Slots of a request's kpool tail ring: one pool (vLLM's), or ``kpool + drafts - 1`` with MTP.

    A verify step writes the ring at positions ``f .. f + s`` (``f``: the first unverified
    position, ``s``: draft tokens), position ``p`` at slot ``p % ring``, so a write at ``q``
    replaces position ``q - ring``. When a draft at or before a pool boundary is rejected, a
    later step completes that pool again and needs its accepted tokens, which start as early as
    ``f + 2 - kpool``; so ``f + s - ring < f + 2 - kpool``: ``ring >= kpool + s - 1``. vLLM's
    one-pool ring is safe for ``s <= 1`` only: with more drafts, a rejected draft past the
    boundary overwrites an accepted token of the pool, which is then compressed from the wrong
    key (a silent change of the sparse selection; measured on the tiny checkpoint).
    """
    if not index_kpool or index_kpool <= 1:
        return index_kpool or 0
    return index_kpool + max(num_speculative_tokens, 1) - 1


def kpool_block_size(block_size: int, index_kpool: int | None, index_head_dim: int = 128,
                     num_speculative_tokens: int = 0) -> int:
    """Smallest KV block size >= `block_size` that vLLM's kpool indexer caches accept.

    vLLM stores one indexer entry (head_dim fp8 values + a 4-byte scale) per `index_kpool`
    tokens and splits each block's entries into pages of 32, so the block must be a multiple of
    32 * index_kpool (`Glm5NextIndexerCache` asserts it). vLLM also pads the tail cache's page
    (raw bf16 key + gate of the tail ring: 2 * ring * head_dim * 2 bytes, `kpool_tail_ring`) to
    the indexer page, so the indexer page must be at least that large.
    """
    if not index_kpool or index_kpool <= 1:
        return block_size
    unit = 32 * index_kpool
    tail_page = 2 * kpool_tail_ring(index_kpool, num_speculative_tokens) * index_head_dim * 2
    size = max(unit, -(-block_size // unit) * unit)
    while (size // index_kpool) * (index_head_dim + 4) < tail_page:
        size += unit
    return size


def kpool_indexer_alignment(index_kpool: int, index_head_dim: int = 128, num_speculative_tokens: int = 0,
                            stock_alignment: int | None = None) -> int:
    """The block-size multiple the plugin reports to vLLM's hybrid block sizing
    (`Platform._get_indexer_block_alignment`): `kpool_block_size(1, ...)` (the 32 * kpool page
    rule plus room for the tail ring in one indexer page), combined with the platform's own
    multiple (`stock_alignment`; CUDA: 32 * kpool, CPU: none) so that both divide the result."""
    return math.lcm(kpool_block_size(1, index_kpool, index_head_dim, num_speculative_tokens), stock_alignment or 1)


def mla_kv_format(kv_cache: torch.Tensor) -> str:
    """Which latent-cache layout a vLLM MLA cache tensor holds (from its dtype and row width)."""
    import torch

    width = kv_cache.shape[-1]
    if kv_cache.dtype == torch.bfloat16 and width == LATENT_DIM:
        return KV_BF16
    if kv_cache.dtype in (torch.uint8, torch.float8_e4m3fn) and width == FP8_ROW_BYTES:
        return KV_FP8
    if kv_cache.dtype == torch.uint8 and width == FP8_DS_MLA_ROW_BYTES:
        return KV_FP8_DS_MLA
    raise ValueError(
        f"unsupported MLA cache: dtype {kv_cache.dtype}, row width {width} (expected bf16 x "
        f"{LATENT_DIM}, uint8/float8_e4m3fn x {FP8_ROW_BYTES} or uint8 x {FP8_DS_MLA_ROW_BYTES})"
    )


def require_kv_scale(kv_format: str, kv_scale):
    """The per-tensor scale a ``KV_FP8`` cache needs (a device tensor; never read on the host)."""
    if kv_format == KV_FP8 and kv_scale is None:
        raise ValueError("an fp8 (512-byte) MLA cache needs kv_scale (the layer's _k_scale)")
    return kv_scale


def flat_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """``[num_flat_rows, row]`` view of a paged MLA cache, indexed by flat row (see module doc)."""
    num_blocks, block_size, row = kv_cache.shape
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != row or kv_cache.stride(0) % row:
        raise ValueError("MLA cache rows must be contiguous and blocks a whole number of rows")
    rows_per_block = kv_cache.stride(0) // row
    num_rows = (num_blocks - 1) * rows_per_block + block_size
    return kv_cache.as_strided((num_rows, row), (row, 1))


def dequant_latent_rows(rows: torch.Tensor, kv_format: str,
                        kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 latents ``[..., 512]`` from cache rows ``[..., row]`` of any layout (``kv_scale``:
    the per-tensor scale of a ``KV_FP8`` cache)."""
    import torch

    if kv_format == KV_BF16:
        return rows.float()
    if kv_format == KV_FP8:
        scale = require_kv_scale(kv_format, kv_scale).reshape(()).float()
        return rows.view(torch.float8_e4m3fn).float() * scale
    values = rows[..., :LATENT_DIM].contiguous().view(torch.float8_e4m3fn).float()
    scales = (
        rows[..., FP8_DS_MLA_SCALE_OFFSET : FP8_DS_MLA_SCALE_OFFSET + 16].contiguous()
        .view(torch.float32)
    )
    tiles = values.unflatten(-1, (LATENT_DIM // SCALE_TILE, SCALE_TILE))
    return (tiles * scales.unsqueeze(-1)).flatten(-2)


def indexer_page_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values ``[pages, page_pools, 128]`` fp8, scales ``[pages, page_pools]`` fp32) views of the
    indexer key cache, honouring its page stride."""
    import torch

    num_pages, page_pools, width = kv_cache.shape
    if kv_cache.dtype != torch.uint8 or width != INDEXER_ROW_BYTES:
        raise ValueError(f"indexer cache must be uint8 [pages, pools, {INDEXER_ROW_BYTES}]")
    page_stride = kv_cache.stride(0)
    if page_stride % 4 or kv_cache.stride(1) != INDEXER_ROW_BYTES or kv_cache.stride(2) != 1:
        raise ValueError("indexer pages must be dense [pools, 132] byte blocks, 4-byte aligned")
    base = kv_cache.storage_offset()
    values = kv_cache.as_strided(
        (num_pages, page_pools, INDEXER_HEAD_DIM), (page_stride, INDEXER_HEAD_DIM, 1), base
    ).view(torch.float8_e4m3fn)
    scale_bytes = kv_cache.as_strided(
        (num_pages, page_pools, 4), (page_stride, 4, 1), base + page_pools * INDEXER_HEAD_DIM
    )
    return values, scale_bytes.view(torch.float32).squeeze(-1)
