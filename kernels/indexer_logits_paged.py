"""Lightning-indexer logits of decode queries against the paged kpool key cache.

``indexer_logits_paged(q_fp8, weights, kv_cache, block_table, context_lens, out)`` and
``indexer_logits_paged_ref`` (``out`` optional). DeepGEMM ``fp8_paged_mqa_logits`` semantics,
which is what vLLM 0.30 calls on Hopper:

* ``q_fp8``: ``[B, N, H, 128]`` float8_e4m3fn, ``N`` query tokens per request (1, or 1 + the MTP
  draft count; vLLM's "native" layout; the flattened layout is ``N = 1`` with one row per token),
  ``H`` indexer heads (vLLM zero-pads to 32).
* ``weights``: ``[B * N, H]`` fp32, per-head weights with q's dequant scale and
  ``softmax_scale * H ** -0.5`` already folded in (vLLM's ``_fused_indexer_weight_scale``).
* ``kv_cache``: ``[num_pages, page_pools, 132]`` uint8 pool cache (``layouts`` module doc).
* ``block_table``: ``[B, max_pages]`` int32, pool pages of each request.
* ``context_lens``: ``[B, N]`` int32, visible complete pools of each query token
  (``token_seq_len // kpool``, what vLLM's indexer metadata holds for a kpool cache).
* ``out``: ``[B * N, W]`` fp32; for ``p < context_lens[b, n]``:
  ``out[b*N + n, p] = scale[p] * sum_h weights[b*N + n, h] * relu(q[b, n, h] . k[p])`` with the fp8
  values multiplied exactly and summed in fp32. Columns at or past the context length are -inf
  in the reference and unspecified (not written) in the kernel; the top-k never reads them.
"""

from __future__ import annotations

import torch

from .layouts import indexer_page_views


def indexer_logits_paged_ref(q_fp8: torch.Tensor, weights: torch.Tensor,
                             kv_cache: torch.Tensor, block_table: torch.Tensor,
                             context_lens: torch.Tensor, out: torch.Tensor | None = None, *,
                             compute_dtype: torch.dtype = torch.float32,
                             chunk_pools: int = 4096) -> torch.Tensor:
    """Torch reference: gather each request's pools page by page, score in fp32, chunked."""
    num_req, next_n, num_heads, dim = q_fp8.shape
    page_values, page_scales = indexer_page_views(kv_cache)
    page_pools = kv_cache.shape[1]
    width = out.shape[1] if out is not None else block_table.shape[1] * page_pools
    if out is None:
        out = torch.empty((num_req * next_n, width), dtype=torch.float32, device=q_fp8.device)
    out.fill_(float("-inf"))
    lens = context_lens.reshape(num_req, next_n).long()
    q = q_fp8.to(compute_dtype)
    w = weights.reshape(num_req, next_n, num_heads).to(compute_dtype)
    longest = int(lens.max().item()) if lens.numel() else 0
    for lo in range(0, min(longest, width), chunk_pools):
        pools = torch.arange(lo, min(width, lo + chunk_pools), device=q_fp8.device)
        pages = block_table[:, pools // page_pools].long().clamp_min(0)  # [B, P]
        slots = (pools % page_pools)[None, :].expand_as(pages)
        keys = page_values[pages, slots].to(compute_dtype)  # [B, P, 128]
        scales = page_scales[pages, slots].to(compute_dtype)  # [B, P]
        scores = torch.relu(torch.einsum("bnhd,bpd->bnhp", q, keys))
        logits = torch.einsum("bnhp,bnh->bnp", scores, w) * scales[:, None, :]
        visible = pools[None, None, :] < lens[:, :, None]
        chunk = torch.where(visible, logits, float("-inf")).reshape(num_req * next_n, -1)
        out[:, lo : lo + pools.numel()] = chunk.to(out.dtype)
    return out
