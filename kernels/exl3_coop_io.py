"""The inputs exllamav3's `exl3_moe_coop` takes, from vLLM's, in one launch instead of seven.

Per token row t (grid T): x[t] (bf16) -> fp16, values outside +-65280 (and NaN) clamped and
counted into an int64 device counter; topk_ids[t] (int32 or int64) -> int64; topk_weights[t]
-> fp16. `coop_inputs_ref` is the torch sequence it replaces (glmctl.plugin.quantization.exl3_experts'
to_fp16_checked plus two dtype conversions).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_env import interpreting

FP16_SAFE = 65280.0
_SAFE: tl.constexpr = tl.constexpr(FP16_SAFE)


@triton.jit
def _coop_inputs_kernel(x_ptr, x_stride, ids_ptr, w_ptr, x16_ptr, ids64_ptr, w16_ptr, clamp_ptr,
                        H: tl.constexpr, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, BLOCK: tl.constexpr,
                        CHECK: tl.constexpr):
    t = tl.program_id(0)
    bad = 0
    for c in tl.static_range(0, H, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        inside = cols < H
        x = tl.load(x_ptr + t * x_stride + cols, mask=inside, other=0.0).to(tl.float32)
        if CHECK:
            bad += tl.sum(tl.where(tl.abs(x) <= _SAFE, 0, 1), 0)
            x = tl.where(x == x, tl.minimum(tl.maximum(x, -_SAFE), _SAFE), x)  # NaN stays NaN, as in torch
        tl.store(x16_ptr + t * H + cols, x.to(tl.float16), mask=inside)
    if CHECK:
        tl.atomic_add(clamp_ptr, bad.to(tl.int64))
    k = tl.arange(0, TOPK_PAD)
    tl.store(ids64_ptr + t * TOPK + k, tl.load(ids_ptr + t * TOPK + k, mask=k < TOPK).to(tl.int64), mask=k < TOPK)
    tl.store(w16_ptr + t * TOPK + k, tl.load(w_ptr + t * TOPK + k, mask=k < TOPK).to(tl.float16), mask=k < TOPK)


def coop_inputs(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, clamped: torch.Tensor):
    """(x fp16 [T, H], ids int64 [T, k], weights fp16 [T, k]); `clamped` counts out-of-range inputs."""
    if x.device.type != "cuda" and not interpreting():
        return coop_inputs_ref(x, topk_ids, topk_weights, clamped)
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    x16 = torch.empty((tokens, hidden), dtype=torch.float16, device=x.device)
    ids64 = torch.empty((tokens, top_k), dtype=torch.int64, device=x.device)
    w16 = torch.empty((tokens, top_k), dtype=torch.float16, device=x.device)
    if tokens:
        _coop_inputs_kernel[(tokens,)](
            x, x.stride(0), topk_ids.contiguous(), topk_weights.contiguous(), x16, ids64, w16, clamped,
            H=hidden, TOPK=top_k, TOPK_PAD=triton.next_power_of_2(top_k), BLOCK=min(1024, triton.next_power_of_2(hidden)),
            CHECK=x.dtype != torch.float16, num_warps=4)
    return x16, ids64, w16


def coop_inputs_ref(x, topk_ids, topk_weights, clamped):
    if x.dtype != torch.float16:
        clamped += (~(x.abs() <= FP16_SAFE)).sum()
        x = x.clamp(-FP16_SAFE, FP16_SAFE)
    return x.to(torch.float16).contiguous(), topk_ids.to(torch.int64).contiguous(), \
        topk_weights.to(torch.float16).contiguous()
