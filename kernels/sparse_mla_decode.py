"""Split-K sparse MLA decode: stage 1 (an attention kernel, one program per (token, head block,
split) writing fp32 partials: :mod:`.sparse_mla_prefill`'s heads-as-M kernel or, for <= 16 heads
per rank, :mod:`.sparse_mla_heads_n`'s; the plan's configuration, from
:func:`.sparse_mla_configs.pick_decode_config`, says which) and stage 2 (this module's combine
kernel, a log-sum-exp merge in a fixed split order, so results are bit-reproducible).

Tensors are exactly those of :func:`.sparse_mla_prefill.sparse_mla_prefill` (q ``[T, H, 512]``
bf16, vLLM's latent cache in bf16, ``fp8`` (+ ``kv_scale``, the per-tensor scale read on the
device) or ``fp8_ds_mla``, ``indices [T, K]`` int32 flat rows, -1 = none); decode tokens include
MTP verification tokens (1 + num_speculative per sequence), each with its own index row, so no
per-sequence metadata is needed.

CUDA-graph use: call :func:`plan_sparse_mla_decode` once per captured batch size (the split count
depends on the SM count and on the batch), allocate one :class:`SparseMLADecodeWorkspace` for the
largest plan (:func:`sparse_mla_decode_workspace`), and pass both to every call. The call
allocates nothing and never syncs with the host; its grid depends only on the plan and on
``q.shape``. Index validity is read on the device.

``sparse_mla_decode_ref`` is the same maths as ``sparse_mla_prefill_ref`` (torch, gather + matmul).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .layouts import KV_FP8_DS_MLA, mla_kv_format
from .sparse_mla_configs import (
    LAYOUT_HEADS_M,
    LAYOUT_HEADS_N,
    MLATileConfig,
    pick_decode_config,
)
from .sparse_mla_heads_n import MAX_HEADS as HEADS_N_MAX_HEADS
from .sparse_mla_heads_n import heads_n_block, launch_sparse_mla_heads_n
from .sparse_mla_prefill import launch_sparse_mla_kernel, sparse_mla_prefill_ref

MAX_SPLITS = 16


@dataclass(frozen=True)
class SparseMLADecodePlan:
    """Launch shape of one decode call (fixed for a captured batch size)."""

    num_tokens: int
    num_heads: int
    num_splits: int
    split_len: int
    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    prefetch: bool = False
    kv_format: str = KV_FP8_DS_MLA
    layout: str = LAYOUT_HEADS_M
    reload: bool = False
    config_name: str = ""

    @property
    def partial_rows(self) -> int:
        return self.num_tokens * self.num_splits if self.num_splits > 1 else 0


@dataclass(frozen=True)
class SparseMLADecodeWorkspace:
    """Flat fp32 buffers for stage 1: partial outputs (``rows * H * 512``) and log-sum-exps
    (``rows * H``), viewed per call as ``[T, splits, H, 512]`` and ``[T, splits, H]``."""

    partial_out: torch.Tensor
    partial_lse: torch.Tensor


def plan_sparse_mla_decode(num_tokens: int, num_heads: int, topk_width: int, num_sms: int,
                           kv_format: str = KV_FP8_DS_MLA,
                           config: MLATileConfig | None = None,
                           num_splits: int | None = None) -> SparseMLADecodePlan:
    """Pick the split count from the SM count and the batch: as many splits as keep the grid
    within ``config.programs_per_sm`` programs per SM (one wave; a partial second wave would
    wait on the slowest split), at most ``MAX_SPLITS`` and at least two tiles per split. The
    tile configuration comes from the cache format (``layouts.KV_FP8``, ``KV_FP8_DS_MLA`` or
    ``KV_BF16``; pass ``layouts.mla_kv_format(cache)``), the head count and the batch
    (:func:`.sparse_mla_configs.pick_decode_config`) unless ``config`` is given;
    ``num_splits`` overrides the split count (benchmarks)."""
    cfg = config or pick_decode_config(kv_format, num_heads, num_tokens)
    if cfg.layout == LAYOUT_HEADS_N and num_heads > HEADS_N_MAX_HEADS:
        raise ValueError(f"config {cfg.name} takes <= {HEADS_N_MAX_HEADS} heads per rank")
    head_blocks = triton.cdiv(num_heads, heads_n_block(num_heads) if cfg.layout ==
                              LAYOUT_HEADS_N else cfg.block_h)
    programs = max(1, num_tokens) * head_blocks
    most = max(1, min(MAX_SPLITS, topk_width // (2 * cfg.block_n)))
    want = num_splits or max(1, (cfg.programs_per_sm * num_sms) // programs)
    splits = max(1, min(want, most))  # MAX_SPLITS bounds the combine kernel's BLOCK_S
    split_len = triton.cdiv(triton.cdiv(topk_width, splits), cfg.block_n) * cfg.block_n
    splits = triton.cdiv(topk_width, split_len)
    return SparseMLADecodePlan(num_tokens, num_heads, splits, split_len, cfg.block_h,
                               cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.prefetch,
                               kv_format, cfg.layout, cfg.reload, cfg.name)


def sparse_mla_decode_workspace(plans: list[SparseMLADecodePlan],
                                device: torch.device | str) -> SparseMLADecodeWorkspace:
    """One workspace that serves every plan given (allocate it before graph capture)."""
    lse_len = max([p.partial_rows * p.num_heads for p in plans] + [1])
    return SparseMLADecodeWorkspace(
        torch.empty((lse_len * 512,), dtype=torch.float32, device=device),
        torch.empty((lse_len,), dtype=torch.float32, device=device),
    )


@triton.jit
def _combine_kernel(part_out_ptr, part_lse_ptr, out_ptr, out_stride_t, out_stride_h,
                    lse_ptr, lse_stride_t, num_heads, num_splits,
                    BLOCK_S: tl.constexpr, DIM: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    lse_row = part_lse_ptr + (tok * num_splits + splits) * num_heads + head
    lses = tl.load(lse_row, mask=splits < num_splits, other=float("-inf"))
    m = tl.max(lses, axis=0)
    m_shift = tl.where(m == float("-inf"), 0.0, m)
    d = tl.arange(0, DIM)
    acc = tl.zeros([DIM], tl.float32)
    total = 0.0
    # Fixed split order: the merge adds the same numbers in the same order every call.
    for s in range(num_splits):
        lse_s = tl.load(part_lse_ptr + (tok * num_splits + s) * num_heads + head)
        w = tl.exp(lse_s - m_shift)
        part = tl.load(part_out_ptr + ((tok * num_splits + s) * num_heads + head) * DIM + d)
        acc += w * part
        total += w
    has_any = total > 0.0
    inv = tl.where(has_any, 1.0 / tl.where(has_any, total, 1.0), 0.0)
    tl.store(out_ptr + tok * out_stride_t + head * out_stride_h + d,
             (acc * inv).to(out_ptr.dtype.element_ty))
    lse = tl.where(has_any, m_shift + tl.log(tl.where(has_any, total, 1.0)), float("-inf"))
    tl.store(lse_ptr + tok * lse_stride_t + head, lse)


def sparse_mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor,
                      softmax_scale: float, out: torch.Tensor, lse: torch.Tensor,
                      plan: SparseMLADecodePlan, workspace: SparseMLADecodeWorkspace, *,
                      kv_scale: torch.Tensor | None = None) -> None:
    """Sparse MLA decode into ``out [T, H, 512]`` / ``lse [T, H]`` (see module doc)."""
    num_tokens, num_heads, _ = q.shape
    if num_tokens == 0:
        return
    if num_tokens > plan.num_tokens or num_heads != plan.num_heads:
        raise ValueError(f"plan is for {plan.num_tokens} tokens x {plan.num_heads} heads, "
                         f"got {num_tokens} x {num_heads}")
    if indices.shape[1] > plan.num_splits * plan.split_len:
        raise ValueError(f"plan covers {plan.num_splits * plan.split_len} index columns, "
                         f"got {indices.shape[1]}: plan with the index buffer's width")
    if mla_kv_format(kv_cache) != plan.kv_format:
        raise ValueError(f"plan is for a {plan.kv_format} cache, got {mla_kv_format(kv_cache)}")
    if plan.layout == LAYOUT_HEADS_N:
        launch = launch_sparse_mla_heads_n
        common = dict(split_len=plan.split_len, block_n=plan.block_n, num_warps=plan.num_warps,
                      num_stages=plan.num_stages, reload=plan.reload, kv_scale=kv_scale)
    else:
        launch = launch_sparse_mla_kernel
        common = dict(split_len=plan.split_len, block_h=plan.block_h, block_n=plan.block_n,
                      num_warps=plan.num_warps, num_stages=plan.num_stages, skip_empty=False,
                      prefetch=plan.prefetch, reload=plan.reload, kv_scale=kv_scale)
    if plan.num_splits == 1:
        launch(q, kv_cache, indices, softmax_scale, out, lse, num_splits=1, partial=False,
               **common)
        return
    need = num_tokens * plan.num_splits * num_heads
    if workspace.partial_lse.numel() < need:
        raise ValueError(f"workspace holds {workspace.partial_lse.numel()} partial rows x heads, "
                         f"this call needs {need}: size it with sparse_mla_decode_workspace")
    part_out = workspace.partial_out[: need * 512].view(num_tokens, plan.num_splits, num_heads,
                                                        512)
    part_lse = workspace.partial_lse[:need].view(num_tokens, plan.num_splits, num_heads)
    launch(q, kv_cache, indices, softmax_scale, part_out, part_lse, num_splits=plan.num_splits,
           partial=True, **common)
    _combine_kernel[(num_tokens, num_heads)](
        part_out, part_lse, out, out.stride(0), out.stride(1), lse, lse.stride(0), num_heads,
        plan.num_splits, BLOCK_S=MAX_SPLITS, DIM=512,
        num_warps=4,
    )


def sparse_mla_decode_ref(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor,
                          softmax_scale: float, out: torch.Tensor | None = None,
                          lse: torch.Tensor | None = None, *,
                          kv_scale: torch.Tensor | None = None,
                          compute_dtype: torch.dtype = torch.float32
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`sparse_mla_decode` (no plan or workspace needed)."""
    return sparse_mla_prefill_ref(q, kv_cache, indices, softmax_scale, out, lse,
                                  kv_scale=kv_scale, compute_dtype=compute_dtype)
