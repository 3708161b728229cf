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
"""

from __future__ import annotations

import torch

from .layouts import indexer_page_views


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
