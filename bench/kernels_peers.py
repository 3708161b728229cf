"""The two public Triton peers, run beside ours on identical inputs (``bench/kernels.py --peers
DIR``). DIR holds copies of their files, fetched by whoever runs the bench and never committed:

* ``triton_sparse_mla_kernel.py`` (vLLM's SM8x sparse-MLA PR, entry point
  ``triton_sparse_mla_attention``): bf16 only, 576-wide rows (512 latent + 64 RoPE). We give it
  the same latents with a zero RoPE part and zero RoPE queries, so its attention equals ours.
  Its two ``vllm`` imports are answered by stand-ins while it loads (``LOG2E``/``LOGE2``, Triton,
  an SM count), since vLLM is not installed where the bench runs.
* ``sm89_paged_indexer.py`` (SGLang, entry point ``sm89_paged_fp8_index_logits``): one token per
  request, a 64-pool page of ``[64 x 128 e4m3 | 64 x fp32 scales]`` per program, which is our
  page layout byte for byte. MTP rows run as B x N single-token requests (the interface takes
  one token per request), so it reads each request's keys N times.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import types
from pathlib import Path

import torch
import triton
import triton.language as tl


def _load(path: Path, name: str, stand_ins: dict | None = None):
    saved = {k: sys.modules.get(k) for k in (stand_ins or {})}
    sys.modules.update(stand_ins or {})
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        for key, old in saved.items():
            if old is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = old


def _vllm_stand_ins() -> dict:
    vllm, utils = types.ModuleType("vllm"), types.ModuleType("vllm.utils")
    triton_utils = types.ModuleType("vllm.triton_utils")
    triton_utils.LOG2E, triton_utils.LOGE2 = math.log2(math.e), math.log(2.0)
    triton_utils.tl, triton_utils.triton = tl, triton
    platform = types.ModuleType("vllm.utils.platform_utils")
    platform.num_compute_units = lambda index=None: torch.cuda.get_device_properties(
        index or 0).multi_processor_count
    return {"vllm": vllm, "vllm.utils": utils, "vllm.triton_utils": triton_utils,
            "vllm.utils.platform_utils": platform}


class Peers:
    """The peers found in ``folder`` (either may be missing: its module is then None and its
    ``has_`` flag False). The loaded modules are ``mla_module`` / ``indexer_module``; ``mla`` and
    the ``indexer_`` methods call into them."""

    def __init__(self, folder: Path):
        mla, idx = folder / "triton_sparse_mla_kernel.py", folder / "sm89_paged_indexer.py"
        self.mla_module = (_load(mla, "peer_vllm_sparse_mla", _vllm_stand_ins())
                           if mla.exists() else None)
        self.indexer_module = (_load(idx, "peer_sglang_paged_indexer")
                               if idx.exists() else None)

    @property
    def has_mla(self) -> bool:
        return self.mla_module is not None

    @property
    def has_indexer(self) -> bool:
        return self.indexer_module is not None

    # -- sparse MLA --------------------------------------------------------------------------

    @staticmethod
    def mla_inputs(q: torch.Tensor, cache_bf16: torch.Tensor, indices: torch.Tensor):
        """The peer's tensors for our bf16 decode case: q [T, H, 576], kv [rows, 1, 576],
        indices [T, 1, K] (flat rows; -1 = none, as ours)."""
        rows = cache_bf16.reshape(-1, 512)
        kv = torch.zeros(rows.shape[0], 1, 576, dtype=torch.bfloat16, device=rows.device)
        kv[:, 0, :512] = rows
        q576 = torch.zeros(*q.shape[:2], 576, dtype=q.dtype, device=q.device)
        q576[..., :512] = q
        return q576, kv, indices[:, None, :].contiguous()

    def mla(self, q576, kv, indices, scale, sm_count):
        return self.mla_module.triton_sparse_mla_attention(q576, kv, indices, scale,
                                                           sm_count=sm_count)

    # -- indexer -----------------------------------------------------------------------------

    @staticmethod
    def indexer_inputs(q, w, cache, block_table, ctx):
        """Single-token requests: q [B*N, 1, 32, 128], cache [pages, 8448] u8, weights, pool
        lengths [B*N], page table rows repeated per token, max length (pools)."""
        requests, next_n = q.shape[:2]
        flat_q = q.reshape(requests * next_n, 1, *q.shape[2:]).contiguous()
        table = block_table.repeat_interleave(next_n, dim=0).contiguous()
        return (flat_q, cache.view(cache.shape[0], -1), w.contiguous(),
                ctx.reshape(-1).contiguous(), table, table.shape[1] * cache.shape[1])

    def indexer_entry(self, flat_q, cache_u8, w, lens, table, max_len):
        """The peer's entry point as a caller uses it (it allocates and -inf-fills the logits)."""
        return self.indexer_module.sm89_paged_fp8_index_logits(flat_q, cache_u8, w, lens, table,
                                                               max_len)

    def indexer_kernel(self, flat_q, cache_u8, w, lens, table, max_len, logits):
        """The peer's kernel alone, into preallocated logits (its entry point's launch)."""
        page_bytes = 64 * 128
        scales = cache_u8[:, page_bytes:].view(torch.float32)
        fp8 = cache_u8.view(torch.float8_e4m3fn)
        grid = (flat_q.shape[0], triton.cdiv(max_len, 64))
        self.indexer_module._sm89_paged_fp8_index_logits_kernel[grid](
            flat_q, flat_q.stride(0), flat_q.stride(2), flat_q.stride(3), fp8, fp8.stride(0),
            scales, scales.stride(0), w, w.stride(0), lens, lens.stride(0), table,
            table.stride(0), table.stride(1), logits, logits.stride(0), cache_u8.shape[0],
            max_len, PAGE_SIZE=64, NUM_HEADS=32, HEAD_DIM=128, num_warps=4, num_stages=4)
        return logits
