"""vLLM 0.30's Triton fused-MoE kernel for block-FP8 experts at one TP8 rank's GLM-5.3-Flash shape,
launched with explicit config dicts: the FP8 routed-expert path vLLM takes on Ada (w8a8, 128x128
weight blocks, 1x128 activation groups; SWAP_AB is what vLLM turns on for sm_90 only).

The GPU test machine has no vLLM, so `load_kernel` takes the `@triton.jit` functions
`fused_moe_kernel` and `write_zeros_to_output` out of a vLLM 0.30 `fused_moe.py` at run time and
loads them as a temporary module (glmctl stores none of vLLM's code). What vLLM's CUDA ops do
around the kernel is done here in torch: expert alignment (`align`, outside the timed region, as
it is routing), per-token-group FP8 quantization, clamped SiLU-and-mul and the top-k sum.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

FP8_MAX = 448.0
GROUP = 128


@dataclass(frozen=True)
class FusedMoeConfig:
    """One config dict of vLLM's fused_moe (`as_dict`), plus SWAP_AB and the small-batch naive
    assignment (one program per (token, expert) slot, vLLM's choice when T * k * 4 <= E)."""

    name: str
    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    group_m: int = 1
    warps: int = 4
    stages: int = 3
    swap_ab: bool = False
    naive: bool | None = None  # None: vLLM's rule

    def as_dict(self) -> dict:
        return {"BLOCK_SIZE_M": self.block_m, "BLOCK_SIZE_N": self.block_n, "BLOCK_SIZE_K": self.block_k,
                "GROUP_SIZE_M": self.group_m, "num_warps": self.warps, "num_stages": self.stages}

    def smem_bytes(self) -> int:
        """Shared memory of the pipelined fp8 A and B tiles (what bounds stages on Ada: 99 KB)."""
        return self.stages * (self.block_m * self.block_k + self.block_k * self.block_n)


def vllm_default(tokens: int) -> FusedMoeConfig:
    """vLLM 0.30's `get_default_config` for block FP8 on CUDA (no tuned file for E=288, N=256)."""
    if tokens <= 8:
        return FusedMoeConfig("vllm_default", block_n=64, stages=4 if tokens <= 4 else 3)
    return FusedMoeConfig("vllm_default", block_m=16 if tokens <= 64 else 64, block_n=128, stages=3,
                          group_m=1 if tokens <= 16 else 32)


SWEEP = (
    FusedMoeConfig("n64_w4_s4", block_n=64, stages=4),
    FusedMoeConfig("n128_w4_s3", block_n=128, stages=3),
    FusedMoeConfig("n128_w8_s3", block_n=128, warps=8, stages=3),
    FusedMoeConfig("n32_w4_s5", block_n=32, stages=5),
    FusedMoeConfig("n64_w4_s4_aligned", block_n=64, stages=4, naive=False),
    FusedMoeConfig("n64_w4_s4_swap", block_n=64, stages=4, swap_ab=True),
    FusedMoeConfig("n128_w4_s3_swap", block_n=128, stages=3, swap_ab=True),
)


def load_kernel(fused_moe_py: str | Path):
    """vLLM's `fused_moe_kernel` (and the helper it calls) from a fused_moe.py, as a JIT function."""
    src = Path(fused_moe_py).read_text()
    lines = src.splitlines()
    parts = []
    for node in ast.parse(src).body:
        if isinstance(node, ast.FunctionDef) and node.name in ("write_zeros_to_output", "fused_moe_kernel"):
            first = min([d.lineno for d in node.decorator_list] + [node.lineno])
            parts.append("\n".join(lines[first - 1:node.end_lineno]))
    if len(parts) != 2:
        raise RuntimeError(f"{fused_moe_py}: fused_moe_kernel / write_zeros_to_output not found")
    folder = Path(tempfile.mkdtemp(prefix="vllm-fused-moe-"))
    mod_path = folder / "vllm_fused_moe_kernel.py"
    mod_path.write_text("import triton\nimport triton.language as tl\n\n\n" + "\n\n\n".join(parts) + "\n")
    spec = importlib.util.spec_from_file_location("vllm_fused_moe_kernel", mod_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.fused_moe_kernel


class BlockFp8Experts:
    """E experts in vLLM's block-FP8 layout: w13 [E, 2I, H] and w2 [E, H, I] e4m3 with fp32 scales
    per 128x128 block ([E, 2I/128, H/128], [E, H/128, I/128])."""

    def __init__(self, torch, device, kernel, experts: int, hidden: int, inter: int, top_k: int,
                 act_limit: float) -> None:
        self.torch, self.kernel = torch, kernel
        self.experts, self.hidden, self.inter, self.top_k, self.act_limit = experts, hidden, inter, top_k, act_limit
        g = torch.Generator(device=device).manual_seed(3)

        def weights(n, k):
            w = torch.empty((experts, n, k), dtype=torch.float8_e4m3fn, device=device)
            for e in range(0, experts, 32):  # in slices: the bf16 draw of all experts at once is 2 GB
                w[e:e + 32] = (torch.randn((min(32, experts - e), n, k), device=device, generator=g,
                                           dtype=torch.bfloat16) * 64).clamp(-FP8_MAX, FP8_MAX).to(w.dtype)
            scale = torch.full((experts, n // GROUP, k // GROUP), 1 / (64 * math.sqrt(k)), device=device)
            return w, scale

        self.w13, self.s13 = weights(2 * inter, hidden)
        self.w2, self.s2 = weights(hidden, inter)

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w13, self.s13, self.w2, self.s2))

    def quant(self, x):
        """Per-token-group (1 x 128) dynamic e4m3 with fp32 scales [M, K/128], as vLLM's kernel does."""
        torch = self.torch
        m, k = x.shape
        g = x.float().view(m, k // GROUP, GROUP)
        scale = g.abs().amax(-1).clamp(min=1e-10) / FP8_MAX
        return (g / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(m, k), scale

    def align(self, ids, cfg: FusedMoeConfig):
        """(sorted_token_ids or None, expert_ids, num_tokens_post_padded): moe_align_block_size's
        result (or the naive per-slot assignment), computed on the device outside the timed region."""
        torch = self.torch
        flat = ids.reshape(-1).long()
        slots, bm, e = flat.numel(), cfg.block_m, self.experts
        naive = cfg.naive if cfg.naive is not None else slots * 4 <= e
        if naive:
            return None, flat.int(), torch.tensor([slots * bm], dtype=torch.int32, device=ids.device)
        counts = torch.bincount(flat, minlength=e)
        padded = (counts + bm - 1) // bm * bm
        ends = padded.cumsum(0)
        size = slots + e * (bm - 1) if slots >= e else min(slots * bm, slots + e * (bm - 1))
        order = torch.argsort(flat, stable=True)
        e_sorted = flat[order]
        rank = torch.arange(slots, device=ids.device) - (counts.cumsum(0) - counts)[e_sorted]
        sorted_ids = torch.full((size,), slots, dtype=torch.int32, device=ids.device)
        sorted_ids[(ends - padded)[e_sorted] + rank] = order.int()
        starts = torch.arange(0, size, bm, device=ids.device)
        expert_ids = torch.searchsorted(ends, starts, right=True).clamp(max=e - 1).int()
        return sorted_ids, expert_ids, ends[-1:].int()

    def launch(self, a, a_scale, b, b_scale, c, weights, route, mul_routed: bool, top_k: int, cfg: FusedMoeConfig):
        import triton
        import triton.language as tl

        sorted_ids, expert_ids, ntpp = route
        m, bm = a.shape[0], cfg.block_m
        num_tokens = m * top_k
        if sorted_ids is not None:
            em = sorted_ids.shape[0] if m >= bm else min(sorted_ids.shape[0], m * top_k * bm)
        else:
            em = num_tokens * bm
        grid = (triton.cdiv(em, bm) * triton.cdiv(b.shape[1], cfg.block_n),)
        self.kernel[grid](
            a, b, c, None, a_scale, b_scale, weights, sorted_ids, expert_ids, ntpp,
            b.shape[1], b.shape[2], em, num_tokens,
            a.stride(0), a.stride(1), b.stride(0), b.stride(2), b.stride(1), c.stride(1), c.stride(2),
            a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(2), b_scale.stride(1), 0, 0,
            GROUP, GROUP,
            MUL_ROUTED_WEIGHT=mul_routed, top_k=top_k, compute_type=tl.bfloat16, use_fp8_w8a8=True,
            use_int8_w8a8=False, use_int8_w8a16=False, per_channel_quant=False,
            naive_block_assignment=sorted_ids is None, HAS_BIAS=False, SWAP_AB=cfg.swap_ab, USE_TD=False,
            BLOCK_SIZE_M=bm, BLOCK_SIZE_N=cfg.block_n, BLOCK_SIZE_K=min(cfg.block_k, GROUP),
            GROUP_SIZE_M=cfg.group_m, SPLIT_K=1, num_warps=cfg.warps, num_stages=cfg.stages)

    def forward(self, x, ids, weights, route, cfg: FusedMoeConfig, kernels_only=None):
        """The routed-expert output [T, H] (bf16). kernels_only = (x8, xs, a8, as_): launch just the
        two GEMMs on those pre-quantized inputs (the kernels' own time)."""
        torch = self.torch
        t, k, i = x.shape[0], self.top_k, self.inter
        x8, xs = kernels_only[:2] if kernels_only else self.quant(x)
        gu = torch.empty((t, k, 2 * i), dtype=torch.bfloat16, device=x.device)
        self.launch(x8, xs, self.w13, self.s13, gu, weights, route, False, k, cfg)
        if kernels_only:
            a8, as_ = kernels_only[2:]
        else:
            g, u = gu.view(t * k, 2 * i).float().split(i, dim=1)
            if self.act_limit:
                g, u = g.clamp(max=self.act_limit), u.clamp(-self.act_limit, self.act_limit)
            a8, as_ = self.quant((torch.nn.functional.silu(g) * u).to(torch.bfloat16))
        y = torch.empty((t * k, 1, self.hidden), dtype=torch.bfloat16, device=x.device)
        self.launch(a8, as_, self.w2, self.s2, y, weights.reshape(-1), route, True, 1, cfg)
        return y.view(t, k, self.hidden).sum(1)
