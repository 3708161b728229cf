"""Block-FP8 weight-only linear for decode batches: y[M, N] = x[M, K] @ dequant(W)^T (+ bias).

Layouts (the checkpoint's, unchanged by loading):
  - ``x``: [M, K] bf16 (any row stride, unit column stride);
  - ``weight``: [N, K] float8_e4m3fn, row-major (K contiguous);
  - ``weight_scale_inv``: [ceil(N/128), ceil(K/128)] fp32, row-major; element (i, j) multiplies
    the 128x128 block W[128i:128i+128, 128j:128j+128];
  - ``bias``: [N] (any float dtype) or None; ``y``: [M, N] bf16, contiguous.

One program owns ``block_n`` output columns of every token (``block_m`` >= M rows, padded to at
least 16 for the mma) and one split of K: it streams its weight tiles [block_n, 128] once,
converts e4m3 -> bf16 in registers (exact: every e4m3 value is a bf16 value), takes the
bf16 x fp32-accumulated product of the tile and multiplies it by the tile's block scale before
adding it to the fp32 accumulator. Each weight byte is read by exactly one program.

Split-K (``split_k`` > 1, where N alone gives too few programs): split s covers the K blocks
[s * blocks_per_split, (s + 1) * blocks_per_split) and writes fp32 partials [split_k, M, N];
a second kernel sums them in split order (0, 1, ...), adds the bias and rounds to bf16 once.
No atomics, so results are bit-for-bit deterministic; the partials come from torch's caching
allocator (graph-private pool under CUDA-graph capture, no host sync).

`plan(M, N, K)` picks a named config from ``CONFIGS`` and the split from shapes only.
``fp8_block_linear_ref`` is the reference: dequantise in fp32, fp32 matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_env import dot_dtype

BLOCK = 128  # the checkpoint's scale block, K tile of every config
MAX_M = 64  # the decode path covers M <= MAX_M (one M tile)
TARGET_PROGRAMS = 264  # ~2 programs per SM on a 132-SM H200 (142 on an L40): shapes only, no device query
MIN_BLOCKS_PER_SPLIT = 2  # a split streams at least two 128-wide K tiles
MAX_SPLIT_K = 16


@dataclass(frozen=True)
class Fp8LinearConfig:
    """One compiled variant: tile sizes and launch options (all within sm_89's limits: shared
    memory per block = num_stages x (block_m x 128 x 2 + block_n x 128) bytes <= 99 KiB)."""

    name: str
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    @property
    def shared_bytes(self) -> int:
        """The pipelined operand buffers (x tile bf16 + weight tile fp8) per block."""
        return self.num_stages * (self.block_m * BLOCK * 2 + self.block_n * BLOCK)


CONFIGS: dict[str, Fp8LinearConfig] = {c.name: c for c in (
    Fp8LinearConfig("m16_n32", block_m=16, block_n=32, num_warps=4, num_stages=4),
    Fp8LinearConfig("m16_n64", block_m=16, block_n=64, num_warps=4, num_stages=4),
    Fp8LinearConfig("m32_n32", block_m=32, block_n=32, num_warps=4, num_stages=4),
    Fp8LinearConfig("m32_n64", block_m=32, block_n=64, num_warps=4, num_stages=4),
    Fp8LinearConfig("m64_n32", block_m=64, block_n=32, num_warps=4, num_stages=3),
    Fp8LinearConfig("m64_n64", block_m=64, block_n=64, num_warps=4, num_stages=3),
)}
REDUCE_BLOCK = 1024


@dataclass(frozen=True)
class Fp8LinearPlan:
    config: Fp8LinearConfig
    split_k: int
    blocks_per_split: int


def plan(m: int, n: int, k: int) -> Fp8LinearPlan:
    """The config and split for an [m, k] x [n, k]^T product (m <= MAX_M), from shapes only.

    block_m: the smallest of 16 / 32 / 64 that holds m. block_n: 64, or 32 when 64-wide tiles
    with the largest split allowed would still leave fewer than ~1 program per SM. split_k:
    the fewest splits that bring the programs to TARGET_PROGRAMS, each split at least
    MIN_BLOCKS_PER_SPLIT K tiles, at most MAX_SPLIT_K."""
    if not 1 <= m <= MAX_M:
        raise ValueError(f"fp8_block_linear's decode path takes 1..{MAX_M} rows, got {m}")
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    k_blocks = triton.cdiv(k, BLOCK)
    max_split = max(1, min(MAX_SPLIT_K, k_blocks // MIN_BLOCKS_PER_SPLIT))
    block_n = 64
    if triton.cdiv(n, 64) * max_split < TARGET_PROGRAMS // 2:
        block_n = 32
    tiles = triton.cdiv(n, block_n)
    split = max(1, min(max_split, triton.cdiv(TARGET_PROGRAMS, tiles)))
    per_split = triton.cdiv(k_blocks, split)
    split = triton.cdiv(k_blocks, per_split)  # no empty split
    return Fp8LinearPlan(CONFIGS[f"m{block_m}_n{block_n}"], split, per_split)


@triton.jit
def _fp8_block_linear_kernel(
    x_ptr, x_stride_m, w_ptr, w_stride_n, s_ptr, s_stride_n, bias_ptr, out_ptr, part_ptr,
    M, size_n, size_k, blocks_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < size_n
    k_blocks = tl.cdiv(size_k, BLOCK_K)
    kb_start = pid_s * blocks_per_split
    kb_end = tl.minimum(kb_start + blocks_per_split, k_blocks)
    # each column's own scale row: right for any BLOCK_N (a tile of BLOCK_N <= 128 dividing 128 sees
    # one row, and the gather then hits one L1 line)
    s_row = s_ptr + (offs_n // BLOCK_K) * s_stride_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb_start, kb_end):
        k = kb * BLOCK_K + offs_k
        mask_k = k < size_k
        x = tl.load(x_ptr + offs_m[:, None] * x_stride_m + k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * w_stride_n + k[None, :],
                    mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        scale = tl.load(s_row + kb, mask=mask_n, other=0.0)
        part = tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), out_dtype=tl.float32)
        acc += part * scale[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT:
        tl.store(part_ptr + (pid_s * M + offs_m[:, None]) * size_n + offs_n[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * size_n + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def _split_reduce_kernel(part_ptr, bias_ptr, out_ptr, M, size_n, split_k,
                         HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    total = M * size_n
    mask = offs < total
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, split_k):  # fixed order: deterministic
        acc += tl.load(part_ptr + s * total + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % size_n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                     bias: torch.Tensor | None = None, config: Fp8LinearPlan | None = None) -> torch.Tensor:
    """y = x @ dequant(weight, weight_scale_inv)^T (+ bias), bf16 [*, N], for x [*, K] with at
    most MAX_M rows. `config`: a plan to use instead of `plan(M, N, K)` (benchmarks)."""
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if weight.stride(-1) != 1 or weight_scale_inv.stride(-1) != 1:
        raise ValueError("fp8_block_linear needs K-contiguous weight and scales")
    if weight_scale_inv.shape != (triton.cdiv(n, BLOCK), triton.cdiv(k, BLOCK)):
        raise ValueError(f"weight_scale_inv {tuple(weight_scale_inv.shape)} is not the 128x128 block "
                         f"grid of a [{n}, {k}] weight")
    out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return out.view(*lead, n)
    p = config or plan(m, n, k)
    cfg = p.config
    split = p.split_k > 1
    part = torch.empty((p.split_k, m, n), dtype=torch.float32, device=x.device) if split else out
    has_bias = bias is not None
    bias_arg = bias if has_bias else out
    _fp8_block_linear_kernel[(triton.cdiv(n, cfg.block_n), p.split_k)](
        x2, x2.stride(0), weight, weight.stride(0), weight_scale_inv, weight_scale_inv.stride(0),
        bias_arg, out, part, m, n, k, p.blocks_per_split,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=BLOCK, SPLIT=split, HAS_BIAS=has_bias,
        DOT_DTYPE=dot_dtype(), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split:
        _split_reduce_kernel[(triton.cdiv(m * n, REDUCE_BLOCK),)](
            part, bias_arg, out, m, n, p.split_k, HAS_BIAS=has_bias, BLOCK=REDUCE_BLOCK,
            num_warps=4)
    return out.view(*lead, n)


def dequantize_ref(weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K]: every weight times its 128x128 block's scale."""
    n, k = weight.shape
    scale = weight_scale_inv.float().repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    return weight.float() * scale


def fp8_block_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: dequantise in fp32, fp32 matmul (+ bias), fp32 [*, N]."""
    y = x.float() @ dequantize_ref(weight, weight_scale_inv).t()
    return y + bias.float() if bias is not None else y


def sm89_configs():
    """(name, jit function, {arg: type}, {constexpr: value}, options) for `sm89_check`."""
    import triton.language as tl

    types = dict(x_ptr="*bf16", x_stride_m="i32", w_ptr="*fp8e4nv", w_stride_n="i32", s_ptr="*fp32",
                 s_stride_n="i32", bias_ptr="*bf16", out_ptr="*bf16", part_ptr="*fp32", M="i32",
                 size_n="i32", size_k="i32", blocks_per_split="i32")
    for cfg in CONFIGS.values():
        for split in (False, True):
            yield (f"fp8_block_linear[{cfg.name}{' split' if split else ''}]", _fp8_block_linear_kernel,
                   types, dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=BLOCK, SPLIT=split,
                               HAS_BIAS=False, DOT_DTYPE=tl.bfloat16),
                   dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    yield ("fp8_block_linear_reduce", _split_reduce_kernel,
           dict(part_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16", M="i32", size_n="i32", split_k="i32"),
           dict(HAS_BIAS=False, BLOCK=REDUCE_BLOCK), dict(num_warps=4, num_stages=1))
