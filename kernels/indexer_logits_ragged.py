"""Lightning-indexer logits of prefill queries against gathered (contiguous) pooled keys.

``indexer_logits_ragged(q_fp8, weights, k_fp8, k_scale, row_starts, row_ends, out)`` and
``indexer_logits_ragged_ref``; ``gather_indexer_keys_ref`` builds the contiguous keys from the
paged cache (vLLM's ``cp_gather_indexer_k_quant_cache``). DeepGEMM ``fp8_mqa_logits`` semantics:

* ``q_fp8``: ``[T, H, 128]`` e4m3; ``weights``: ``[T, H]`` fp32 (scales folded in, as in
  :mod:`.indexer_logits_paged`).
* ``k_fp8``: ``[S, 128]`` e4m3 and ``k_scale``: ``[S]`` fp32, the chunk's requests' pools back to
  back (request ``r`` at rows ``[cu_pools[r], cu_pools[r + 1])``).
* ``row_starts`` / ``row_ends``: ``[T]`` int32, query ``t`` sees rows ``[row_starts[t],
  row_ends[t])`` (vLLM's ``cu_seqlen_ks`` / ``cu_seqlen_ke``; ``ke - ks = (position + 1) // kpool``).
* ``out``: ``[T, S]`` fp32, ``out[t, s] = k_scale[s] * sum_h weights[t, h] * relu(q[t, h] . k[s])``
  inside the row's range; -inf outside in the reference, unspecified in the kernel.

Kernel: one program per ``BLOCK_M`` query tokens walks the keys between its tokens' smallest
start and largest end, ``BLOCK_N`` at a time: ``[BLOCK_N, 128] x [128, BLOCK_M * H]`` products
with fp16 operands (e4m3 converts exactly) and fp32 accumulation, as in the paged kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layouts import INDEXER_HEAD_DIM, indexer_page_views
from .triton_env import dot_dtype

# (BLOCK_M tokens, BLOCK_N keys, num_warps, num_stages) by head count; each compiled for sm_89
# in tests/unit/test_kernels_sm89.py.
RAGGED_CONFIGS = {16: (8, 64, 4, 3), 32: (4, 64, 4, 3), 64: (2, 64, 4, 3)}


@triton.jit
def _indexer_logits_ragged_kernel(
    q_ptr, w_ptr, k_ptr, k_scale_ptr, starts_ptr, ends_ptr, out_ptr, out_stride, num_tokens,
    H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    first_tok = tl.program_id(0) * BLOCK_M
    toks = first_tok + tl.arange(0, BLOCK_M)
    tok_ok = toks < num_tokens
    starts = tl.load(starts_ptr + toks, mask=tok_ok, other=2147483647)
    ends = tl.load(ends_ptr + toks, mask=tok_ok, other=0)
    lo = tl.min(starts, axis=0)
    hi = tl.max(ends, axis=0)
    rows = first_tok.to(tl.int64) * H + tl.arange(0, BLOCK_M * H)  # row = token * H + head
    row_ok = rows < num_tokens * H
    d = tl.arange(0, 128)
    q = tl.load(q_ptr + rows[:, None] * 128 + d[None, :], mask=row_ok[:, None],
                other=0.0).to(DOT_DTYPE)
    w = tl.load(w_ptr + rows, mask=row_ok, other=0.0)
    for k0 in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        keys = k0 + tl.arange(0, BLOCK_N)
        key_ok = keys < hi
        k = tl.load(k_ptr + keys.to(tl.int64)[:, None] * 128 + d[None, :], mask=key_ok[:, None],
                    other=0.0).to(DOT_DTYPE)
        k_scale = tl.load(k_scale_ptr + keys, mask=key_ok, other=0.0)
        scores = tl.maximum(tl.dot(k, tl.trans(q)), 0.0) * w[None, :]  # [BLOCK_N, BLOCK_M*H]
        logits = tl.sum(tl.reshape(scores, [BLOCK_N, BLOCK_M, H]), axis=2) * k_scale[:, None]
        keep = (keys[:, None] >= starts[None, :]) & (keys[:, None] < ends[None, :])
        tl.store(out_ptr + toks.to(tl.int64)[None, :] * out_stride + keys[:, None], logits,
                 mask=keep)


def ragged_config(num_heads: int) -> tuple[int, int, int, int]:
    for limit in sorted(RAGGED_CONFIGS):
        if num_heads <= limit:
            return RAGGED_CONFIGS[limit]
    raise ValueError(f"indexer with {num_heads} heads: at most {max(RAGGED_CONFIGS)} supported")


def indexer_logits_ragged(q_fp8: torch.Tensor, weights: torch.Tensor, k_fp8: torch.Tensor,
                          k_scale: torch.Tensor, row_starts: torch.Tensor, row_ends: torch.Tensor,
                          out: torch.Tensor) -> torch.Tensor:
    """Triton kernel; same contract as :func:`indexer_logits_ragged_ref` (see module doc)."""
    num_tokens, heads, dim = q_fp8.shape
    assert dim == INDEXER_HEAD_DIM and q_fp8.is_contiguous() and weights.is_contiguous()
    assert k_fp8.is_contiguous() and k_scale.is_contiguous() and out.stride(1) == 1
    if num_tokens == 0:
        return out
    block_m, block_n, num_warps, num_stages = ragged_config(heads)
    _indexer_logits_ragged_kernel[(triton.cdiv(num_tokens, block_m),)](
        q_fp8, weights, k_fp8, k_scale, row_starts, row_ends, out, out.stride(0), num_tokens,
        H=heads, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_DTYPE=dot_dtype(tl.float16),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def gather_indexer_keys_ref(kv_cache: torch.Tensor, block_table: torch.Tensor,
                            cu_pools: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous ``(k_fp8 [S, 128], k_scale [S])`` of requests ``r`` with ``cu_pools[r + 1] -
    cu_pools[r]`` pools each, pages from ``block_table[r]``."""
    page_values, page_scales = indexer_page_views(kv_cache)
    page_pools = kv_cache.shape[1]
    lens = (cu_pools[1:] - cu_pools[:-1]).long()
    total = int(cu_pools[-1].item())
    req = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens,
                                  output_size=total)
    pool = torch.arange(total, device=lens.device) - cu_pools[:-1].long()[req]
    pages = block_table[req, pool // page_pools].long()
    slots = pool % page_pools
    return page_values[pages, slots].clone(), page_scales[pages, slots].clone()


def indexer_logits_ragged_ref(q_fp8: torch.Tensor, weights: torch.Tensor, k_fp8: torch.Tensor,
                              k_scale: torch.Tensor, row_starts: torch.Tensor,
                              row_ends: torch.Tensor, out: torch.Tensor | None = None, *,
                              compute_dtype: torch.dtype = torch.float32,
                              chunk_tokens: int = 256) -> torch.Tensor:
    """Torch reference, chunked over query tokens to bound memory."""
    num_tokens = q_fp8.shape[0]
    num_keys = k_fp8.shape[0]
    if out is None:
        out = torch.empty((num_tokens, num_keys), dtype=torch.float32, device=q_fp8.device)
    keys = k_fp8.to(compute_dtype)
    cols = torch.arange(num_keys, device=q_fp8.device)
    for lo in range(0, num_tokens, chunk_tokens):
        hi = min(num_tokens, lo + chunk_tokens)
        scores = torch.relu(torch.einsum("thd,sd->ths", q_fp8[lo:hi].to(compute_dtype), keys))
        logits = torch.einsum("ths,th->ts", scores, weights[lo:hi].to(compute_dtype))
        logits = logits * k_scale.to(compute_dtype)[None, :]
        inside = (cols[None, :] >= row_starts[lo:hi, None]) & (cols[None, :] < row_ends[lo:hi, None])
        out[lo:hi] = torch.where(inside, logits, float("-inf")).to(out.dtype)
    return out
