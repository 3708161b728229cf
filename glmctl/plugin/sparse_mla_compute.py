"""The sparse-MLA backend's computation, free of vLLM imports (so the GPU lane can test it on a
machine without vLLM, with metadata built the way vLLM's builder builds it).

Every query token attends over its own selection: the indexer's request-local token positions
(-1 = none) are mapped through the request's block table to flat rows of the latent cache, and
the kernels do the rest. Graph safe: tensor ops and kernel launches only, no host reads.
"""

from __future__ import annotations

import numpy as np
import torch


def request_ids_per_token(query_start_loc_cpu, out: torch.Tensor) -> torch.Tensor:
    """Fill `out` (a persistent buffer) with each token's request index; padding keeps 0.

    Host-side from the CPU copy of query_start_loc, as vLLM's sparse-MLA builders do; returns
    the `[num_tokens]` view."""
    starts = np.asarray(query_start_loc_cpu, dtype=np.int64)
    ids = np.repeat(np.arange(len(starts) - 1, dtype=np.int32), np.diff(starts))
    out.zero_()
    out[: ids.shape[0]].copy_(torch.from_numpy(ids), non_blocking=True)
    return out[: ids.shape[0]]


def sparse_mla_forward(q: torch.Tensor, kv_cache: torch.Tensor, topk_tokens: torch.Tensor,
                       req_id_per_token: torch.Tensor, block_table: torch.Tensor,
                       block_size: int, softmax_scale: float, kernels
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, 512] (absorbed, latent space); kv_cache [blocks, block_size, 512 | 656 bytes];
    topk_tokens [T, W] request-local positions; returns (out [T, H, 512], lse [T, H])."""
    num_tokens = q.shape[0]
    rows = kernels.rows(topk_tokens[:num_tokens], req_id_per_token[:num_tokens], block_table,
                        block_size, kv_cache.stride(0) // kv_cache.stride(1))
    return kernels.attention(q, kv_cache, rows, softmax_scale)
