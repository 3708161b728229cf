"""Block-FP8 weight-only linear: y[M, N] = x[M, K] @ dequant(W)^T (+ bias), W8A16 at every M.

Layouts (the checkpoint's, unchanged by loading):
  - ``x``: [M, K] bf16 (any row stride, unit column stride);
  - ``weight``: [N, K] float8_e4m3fn, row-major (K contiguous);
  - ``weight_scale_inv``: [ceil(N/128), ceil(K/128)] fp32, row-major; element (i, j) multiplies
    the 128x128 block W[128i:128i+128, 128j:128j+128];
  - ``bias``: [N] (any float dtype) or None; ``y``: [M, N] bf16, contiguous.
A fused GEMM whose shards are whole 128-row blocks (all but the last, as vLLM's
``validate_fp8_block_shape`` requires) has exactly this layout over its concatenated rows.

One program owns a [block_m, block_n] output tile and one split of K: it streams its weight
tiles [block_n, 128] once, converts e4m3 -> bf16 in registers (exact: every e4m3 value is a bf16
value), takes the bf16 x fp32-accumulated product of the tile and multiplies it by the tile's
block scale before adding it to the fp32 accumulator. Each weight byte is read by exactly one
program per M tile (decode batches have one M tile).

Split-K, one launch: where the output tiles alone give fewer than ``TARGET_PROGRAMS`` programs,
K is cut into ``split_k`` ranges of whole 128-wide blocks. Every split stores its fp32 partial
tile to ``part`` [split_k, M, N], then takes a ticket from the tile's arrival counter; the
program that arrives last sums the partials in split order (0, 1, ...), adds the bias, rounds to
bf16 once, and resets the counter to 0 for the next call. No float atomics, so results are
bit-for-bit deterministic; the counters (``new_counters()``, zero at rest, one per output tile:
split-K only happens below ``TARGET_PROGRAMS`` tiles) belong to the caller and must not be shared
by two launches in flight at once (one per layer). Without counters the splits are summed by a
second kernel in the same order (same bits). Partials come from torch's caching allocator
(graph-private pool under CUDA-graph capture, no host sync).

``bf16_linear`` runs the same kernel on a bf16 weight [N, K] without scales (``SCALED`` off)
into any output dtype: the MoE router's fp32 logits, a GEMV that cuBLAS splits over two kernels.

`plan(M, N, K)` picks a named config and the split from shapes only (CUDA-graph safe).
``fp8_block_linear_ref`` is the reference: dequantise in fp32, fp32 matmul (``bf16_linear_ref``:
fp32 matmul of the bf16 operands).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_env import dot_dtype

BLOCK = 128  # the checkpoint's scale block, K tile of every config
DECODE_MAX_M = 64  # one M tile of a decode config holds the batch
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
    fp8_bits: bool = False  # e4m3 -> bf16 by integer bit moves instead of cvt instructions

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
    # prefill chunks: 64 x 128 output tiles, 2 x 32 KiB operand stages
    Fp8LinearConfig("prefill_m64_n128", block_m=64, block_n=128, num_warps=8, num_stages=2),
)}
# The decode tiles with the bit-move conversion (an A/B for the GPU: the cvt path converts
# e4m3 -> f16 -> f32 -> bf16, three conversion instructions per pair of weights)
CONFIGS.update({f"{c.name}_bits": Fp8LinearConfig(f"{c.name}_bits", c.block_m, c.block_n, c.num_warps,
                                                  c.num_stages, fp8_bits=True)
                for c in list(CONFIGS.values()) if c.name.startswith("m")})
PREFILL = CONFIGS["prefill_m64_n128"]
REDUCE_BLOCK = 1024


@dataclass(frozen=True)
class Fp8LinearPlan:
    config: Fp8LinearConfig
    split_k: int
    blocks_per_split: int

    def grid(self, m: int, n: int) -> tuple[int, int, int]:
        return (triton.cdiv(n, self.config.block_n), self.split_k, triton.cdiv(m, self.config.block_m))


def plan(m: int, n: int, k: int, fp8_bits: bool = False) -> Fp8LinearPlan:
    """The config and split for an [m, k] x [n, k]^T product, from shapes only.

    m <= DECODE_MAX_M: block_m the smallest of 16 / 32 / 64 that holds m; block_n 64, or 32 when
    64-wide tiles with the largest split allowed would still leave fewer than ~1 program per SM.
    Larger m: the prefill tile. split_k: the fewest splits that bring the programs to
    TARGET_PROGRAMS, each split at least MIN_BLOCKS_PER_SPLIT K tiles, at most MAX_SPLIT_K (so a
    split launch always has fewer than TARGET_PROGRAMS output tiles)."""
    if m < 1:
        raise ValueError(f"fp8_block_linear needs at least one row, got {m}")
    k_blocks = triton.cdiv(k, BLOCK)
    max_split = max(1, min(MAX_SPLIT_K, k_blocks // MIN_BLOCKS_PER_SPLIT))
    if m <= DECODE_MAX_M:
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
        block_n = 64
        if triton.cdiv(n, 64) * max_split < TARGET_PROGRAMS // 2:
            block_n = 32
        cfg = CONFIGS[f"m{block_m}_n{block_n}{'_bits' if fp8_bits else ''}"]
    else:
        cfg = PREFILL
    tiles = triton.cdiv(n, cfg.block_n) * triton.cdiv(m, cfg.block_m)
    split = max(1, min(max_split, triton.cdiv(TARGET_PROGRAMS, tiles)))
    per_split = triton.cdiv(k_blocks, split)
    split = triton.cdiv(k_blocks, per_split)  # no empty split
    return Fp8LinearPlan(cfg, split, per_split)


def new_counters(device) -> torch.Tensor:
    """Arrival counters for one caller's split-K launches: int32 zeros, one per output tile."""
    return torch.zeros(TARGET_PROGRAMS, dtype=torch.int32, device=device)


@triton.jit
def _linear_tile(
    x_ptr, x_stride_m, w_ptr, w_stride_n, s_ptr, s_stride_n, bias_ptr, out_ptr, part_ptr, cnt_ptr,
    M, size_n, size_k, blocks_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALED: tl.constexpr,
    FP8_BITS: tl.constexpr, SPLIT: tl.constexpr, LAST_REDUCES: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
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
        if FP8_BITS:
            # e4m3 -> bf16 by moving bits: the sign to bit 15, exponent and mantissa to bits 4..10,
            # i.e. the same value times 2^-120 (normals and subnormals alike), undone in the scale
            b = w.to(tl.uint8, bitcast=True).to(tl.uint16)
            w = (((b & 0x7F) << 4) | ((b & 0x80) << 8)).to(tl.bfloat16, bitcast=True)
        part = tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), out_dtype=tl.float32)
        if SCALED:
            scale = tl.load(s_row + kb, mask=mask_n, other=0.0)
            if FP8_BITS:
                scale = scale * 1.329227995784916e36  # 2^120
            acc += part * scale[None, :]
        else:
            acc += part
    mask = mask_m[:, None] & mask_n[None, :]
    tile = offs_m[:, None] * size_n + offs_n[None, :]
    if SPLIT:
        total = M * size_n
        tl.store(part_ptr + pid_s * total + tile, acc, mask=mask)
        if LAST_REDUCES:
            # Every thread's partial store is issued before the ticket (the barrier), and the
            # ticket's release makes them visible at GPU scope; the last arrival's acquire orders
            # its loads after every other split's release. Loads go through L2 (.cg): this SM's
            # L1 never held those lines, but nothing here relies on that.
            tl.debug_barrier()
            counter = cnt_ptr + pid_m * tl.num_programs(0) + pid_n
            splits = tl.num_programs(1)
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == splits - 1:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in range(0, splits):  # fixed order: deterministic
                    acc += tl.load(part_ptr + s * total + tile, mask=mask, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                tl.store(out_ptr + tile, acc.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + tile, acc.to(out_ptr.dtype.element_ty), mask=mask)


# Two entry points over one body, so that profiles tell the block-FP8 linears from the bf16 GEMVs
@triton.jit
def _fp8_block_linear_kernel(
    x_ptr, x_stride_m, w_ptr, w_stride_n, s_ptr, s_stride_n, bias_ptr, out_ptr, part_ptr, cnt_ptr,
    M, size_n, size_k, blocks_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8_BITS: tl.constexpr,
    SPLIT: tl.constexpr, LAST_REDUCES: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    _linear_tile(x_ptr, x_stride_m, w_ptr, w_stride_n, s_ptr, s_stride_n, bias_ptr, out_ptr, part_ptr, cnt_ptr,
                 M, size_n, size_k, blocks_per_split, BLOCK_M, BLOCK_N, BLOCK_K, True, FP8_BITS, SPLIT,
                 LAST_REDUCES, HAS_BIAS, DOT_DTYPE)


@triton.jit
def _bf16_gemv_kernel(
    x_ptr, x_stride_m, w_ptr, w_stride_n, s_ptr, s_stride_n, bias_ptr, out_ptr, part_ptr, cnt_ptr,
    M, size_n, size_k, blocks_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, LAST_REDUCES: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    _linear_tile(x_ptr, x_stride_m, w_ptr, w_stride_n, s_ptr, s_stride_n, bias_ptr, out_ptr, part_ptr, cnt_ptr,
                 M, size_n, size_k, blocks_per_split, BLOCK_M, BLOCK_N, BLOCK_K, False, False, SPLIT,
                 LAST_REDUCES, HAS_BIAS, DOT_DTYPE)


@triton.jit
def _fp8_block_split_reduce_kernel(part_ptr, bias_ptr, out_ptr, M, size_n, split_k,
                         HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    total = M * size_n
    mask = offs < total
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, split_k):  # fixed order: the same sums as the last arrival's
        acc += tl.load(part_ptr + s * total + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % size_n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                     bias: torch.Tensor | None = None, counters: torch.Tensor | None = None,
                     config: Fp8LinearPlan | None = None) -> torch.Tensor:
    """y = x @ dequant(weight, weight_scale_inv)^T (+ bias), bf16 [*, N], for x [*, K].

    `counters`: the caller's `new_counters()` (split-K in one launch); None sums the splits in a
    second launch. `config`: a plan to use instead of `plan(M, N, K)` (benchmarks)."""
    n, k = weight.shape
    if weight_scale_inv.stride(-1) != 1:
        raise ValueError("fp8_block_linear needs K-contiguous weight and scales")
    if weight_scale_inv.shape != (triton.cdiv(n, BLOCK), triton.cdiv(k, BLOCK)):
        raise ValueError(f"weight_scale_inv {tuple(weight_scale_inv.shape)} is not the 128x128 block "
                         f"grid of a [{n}, {k}] weight")
    return _launch(x, weight, weight_scale_inv, bias, counters, config, torch.bfloat16)


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, counters: torch.Tensor | None = None,
                out_dtype: torch.dtype = torch.float32, config: Fp8LinearPlan | None = None) -> torch.Tensor:
    """y = x @ weight^T in `out_dtype` [*, N] for a bf16 `weight` [N, K] (the same kernel without
    block scales; the MoE router's fp32 logits): bf16 products, fp32 accumulation, one rounding."""
    if weight.dtype != torch.bfloat16:
        raise ValueError(f"bf16_linear takes a bf16 weight, not {weight.dtype}")
    return _launch(x, weight, None, None, counters, config, out_dtype)


def _launch(x, weight, scale, bias, counters, config, out_dtype) -> torch.Tensor:
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if weight.stride(-1) != 1:
        raise ValueError("fp8_block_linear needs K-contiguous weight and scales")
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0:
        return out.view(*lead, n)
    p = config or plan(m, n, k)
    cfg = p.config
    grid = p.grid(m, n)
    split = p.split_k > 1
    last_reduces = split and counters is not None
    if last_reduces and counters.numel() < grid[0] * grid[2]:
        raise ValueError(f"{counters.numel()} counters for {grid[0] * grid[2]} split-K output tiles")
    part = torch.empty((p.split_k, m, n), dtype=torch.float32, device=x.device) if split else out
    has_bias = bias is not None
    bias_arg = bias if has_bias else out
    scaled = scale is not None
    kernel = _fp8_block_linear_kernel if scaled else _bf16_gemv_kernel
    kernel[grid](
        x2, x2.stride(0), weight, weight.stride(0), scale if scaled else out, scale.stride(0) if scaled else 0,
        bias_arg, out, part, counters if last_reduces else out, m, n, k, p.blocks_per_split,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=BLOCK, SPLIT=split, LAST_REDUCES=last_reduces,
        HAS_BIAS=has_bias, DOT_DTYPE=dot_dtype(), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"FP8_BITS": cfg.fp8_bits} if scaled else {}))
    if split and not last_reduces:
        _fp8_block_split_reduce_kernel[(triton.cdiv(m * n, REDUCE_BLOCK),)](
            part, bias_arg, out, m, n, p.split_k, HAS_BIAS=has_bias, BLOCK=REDUCE_BLOCK,
            num_warps=4)
    return out.view(*lead, n)


def dequantize_ref(weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K]: every weight times its 128x128 block's scale."""
    n, k = weight.shape
    scale = weight_scale_inv.float().repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    return weight.float() * scale


def bf16_linear_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The reference: fp32 matmul of the bf16 operands, fp32 [*, N]."""
    return x.float() @ weight.float().t()


def fp8_block_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: dequantise in fp32, fp32 matmul (+ bias), fp32 [*, N]."""
    y = x.float() @ dequantize_ref(weight, weight_scale_inv).t()
    return y + bias.float() if bias is not None else y


def sm89_configs():
    """(name, jit function, {arg: type}, {constexpr: value}, options) for `sm89_check`."""
    import triton.language as tl

    types = dict(x_ptr="*bf16", x_stride_m="i32", w_ptr="*fp8e4nv", w_stride_n="i32", s_ptr="*fp32",
                 s_stride_n="i32", bias_ptr="*bf16", out_ptr="*bf16", part_ptr="*fp32", cnt_ptr="*i32",
                 M="i32", size_n="i32", size_k="i32", blocks_per_split="i32")
    for cfg in CONFIGS.values():
        variants = ((True, True),) if cfg.fp8_bits else ((False, False), (True, False), (True, True))
        for split, last in variants:
            tag = " split-last" if last else " split" if split else ""
            yield (f"fp8_block_linear[{cfg.name}{tag}]", _fp8_block_linear_kernel,
                   types, dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=BLOCK, FP8_BITS=cfg.fp8_bits,
                               SPLIT=split, LAST_REDUCES=last, HAS_BIAS=False, DOT_DTYPE=tl.bfloat16),
                   dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    # bf16 weights, fp32 out (the router's logits; decode tiles, split-K summed by the last arrival)
    dense = dict(types, w_ptr="*bf16", s_ptr="*fp32", out_ptr="*fp32")
    for cfg in CONFIGS.values():
        if cfg is not PREFILL and not cfg.fp8_bits:
            yield (f"bf16_gemv[{cfg.name} split-last]", _bf16_gemv_kernel, dense,
                   dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=BLOCK, SPLIT=True,
                        LAST_REDUCES=True, HAS_BIAS=False, DOT_DTYPE=tl.bfloat16),
                   dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    yield ("fp8_block_linear_reduce", _fp8_block_split_reduce_kernel,
           dict(part_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16", M="i32", size_n="i32", split_k="i32"),
           dict(HAS_BIAS=False, BLOCK=REDUCE_BLOCK), dict(num_warps=4, num_stages=1))
