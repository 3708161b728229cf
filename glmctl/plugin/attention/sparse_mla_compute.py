"""The sparse-MLA backend's computation, free of vLLM imports (so the GPU lane can test it on a
machine without vLLM, with metadata built the way vLLM's builder builds it).

Every query token attends over its own selection: the indexer's request-local token positions
(-1 = none) are mapped through the request's block table to flat rows of the latent cache, and
the kernels do the rest. Graph safe: tensor ops and kernel launches only, no host reads.

Two kernel paths on CUDA (the CPU target has only the torch reference, which serves both):
  - decode batches (every request brings at most `max_query_len` = 1 + num_speculative tokens,
    and the batch has at most as many tokens as the largest planned size): split-K decode with
    the plan of the smallest planned batch size >= the batch, and one workspace shared by every
    layer of the process (layers run one after another on one stream);
  - everything else (prefill, chunked prefill, mixed batches): the prefill kernel.
The plans and the workspace are made once, before CUDA-graph capture (`make_decode_setup`);
a call allocates only its outputs (as vLLM's own backends do, from the graph's pool).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

import numpy as np
import torch

# Decode batch sizes planned besides vLLM's cudagraph capture sizes (eager batches pick the
# smallest planned size that holds them): up to 48 tokens = 12 requests x MTP-3 verify.
DECODE_LADDER = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48)
# Above this many tokens a decode batch fills the GPU without splitting; no plan is made.
MAX_DECODE_PLAN_TOKENS = 512


def request_ids_per_token(query_start_loc_cpu, out: torch.Tensor) -> torch.Tensor:
    """Fill `out` (a persistent buffer) with each token's request index; padding keeps 0.

    Host-side from the CPU copy of query_start_loc, as vLLM's sparse-MLA builders do; returns
    the `[num_tokens]` view."""
    starts = np.asarray(query_start_loc_cpu, dtype=np.int64)
    ids = np.repeat(np.arange(len(starts) - 1, dtype=np.int32), np.diff(starts))
    out.zero_()
    out[: ids.shape[0]].copy_(torch.from_numpy(ids), non_blocking=True)
    return out[: ids.shape[0]]


@dataclass(frozen=True)
class DecodeSetup:
    """Split-K decode plans by batch size (ascending) and the one workspace they share."""

    plans: tuple
    workspace: object
    max_query_len: int

    def plan_for(self, num_tokens: int, max_query_len: int):
        """The plan for a batch, or None when it is not a decode batch this setup covers."""
        if max_query_len > self.max_query_len or not self.plans:
            return None
        sizes = [plan.num_tokens for plan in self.plans]
        at = bisect_left(sizes, num_tokens)
        return self.plans[at] if at < len(self.plans) else None


def decode_batch_sizes(capture_sizes, max_decode_tokens: int) -> list[int]:
    """The batch sizes to plan: vLLM's cudagraph capture sizes and the eager ladder, up to the
    most decode tokens a batch can hold (and at most MAX_DECODE_PLAN_TOKENS)."""
    limit = max(1, min(max_decode_tokens, MAX_DECODE_PLAN_TOKENS))
    sizes = {int(s) for s in (capture_sizes or ()) if 0 < int(s) <= limit}
    sizes |= {s for s in DECODE_LADDER if s <= limit}
    return sorted(sizes | {limit})


_SHARED: dict = {}


def make_decode_setup(kernels, *, num_heads: int, topk_width: int, kv_format: str,
                      batch_sizes, max_query_len: int, device,
                      num_sms: int | None = None) -> DecodeSetup | None:
    """Plans for every batch size (split count from the device's SM count unless given) and
    one workspace for the largest; shared between the layers that ask with the same shapes.
    None where the kernel table has no split-K decode (the CPU target)."""
    if kernels.plan_decode is None:
        return None
    device = torch.device(device)
    key = (str(device), num_heads, topk_width, kv_format, tuple(batch_sizes), max_query_len,
           num_sms)
    if key not in _SHARED:
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        plans = tuple(kernels.plan_decode(size, num_heads, topk_width, num_sms, kv_format)
                      for size in sorted(batch_sizes))
        _SHARED[key] = DecodeSetup(plans, kernels.decode_workspace(list(plans), device),
                                   max_query_len)
    return _SHARED[key]


def sparse_mla_forward(q: torch.Tensor, kv_cache: torch.Tensor, topk_tokens: torch.Tensor,
                       req_id_per_token: torch.Tensor, block_table: torch.Tensor,
                       block_size: int, softmax_scale: float, kernels, *,
                       kv_scale: torch.Tensor | None = None, decode: DecodeSetup | None = None,
                       max_query_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, 512] (absorbed, latent space); kv_cache [blocks, block_size, row] (bf16 512,
    fp8 512 with `kv_scale`, or fp8_ds_mla 656 bytes); topk_tokens [T, W] request-local
    positions; returns (out [T, H, 512], lse [T, H]). With a `decode` setup and the batch's
    `max_query_len`, a decode batch takes the split-K kernel."""
    num_tokens = q.shape[0]
    rows = kernels.rows(topk_tokens[:num_tokens], req_id_per_token[:num_tokens], block_table,
                        block_size, kv_cache.stride(0) // kv_cache.stride(1))
    plan = None
    if decode is not None and max_query_len is not None:
        plan = decode.plan_for(num_tokens, max_query_len)
    if plan is None:
        return kernels.attention(q, kv_cache, rows, softmax_scale, kv_scale=kv_scale)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    kernels.decode(q, kv_cache, rows, softmax_scale, out, lse, plan, decode.workspace,
                   kv_scale=kv_scale)
    return out, lse
