"""The MoE router's logits on glmctl's weight-streaming kernel (CUDA; GLMCTL_ROUTER_GEMM=glmctl).

vLLM 0.30's `GateLinear` computes GLM-5.3-Flash's router logits (bf16 hidden [T, 4096] x bf16
gate [288, 4096] -> fp32 [T, 288]) with `torch.mm(..., out_dtype=float32)` on both sm_89 and
sm_90 (its specialised router kernels are Hopper-only and need CuTe DSL or fixed shapes). For a
decode batch cuBLAS runs a split-K GEMM and a separate reduce kernel. The H200 rank simulation's
profile (8x22k) has 43 calls per step of one split-K cuBLAS GEMM with fp32 output, 549 us in all:
the 42 MoE layers' and the MTP layer's routers by their count, ~12.8 us each for 2.4 MB of
weight (~0.05 of copy bandwidth), plus fp32 split-K reduces. `glmctl.router_logits` runs `bf16_linear` instead for up to
`DECODE_MAX_M` tokens (bf16 products, fp32 accumulation: what cuBLAS computes, summed in another
order) and `torch.mm` above, inside one op so that torch.compile and CUDA graphs see no branch.
Each gate layer owns its split-K arrival counters (a non-persistent buffer).
"""

# No `from __future__ import annotations`: torch infers the op schema from the annotations.
import torch
from torch import Tensor

from glmctl import switches

_lib = None


def router_gemm_kernel(is_cuda: bool, env=None) -> str:
    """"glmctl" or "vllm". auto is vLLM's until glmctl's kernel has passed the GPU lane."""
    return "glmctl" if is_cuda and switches.read("GLMCTL_ROUTER_GEMM", env) == "glmctl" else "vllm"


def router_logits(x: Tensor, weight: Tensor, counters: Tensor) -> Tensor:
    from glmctl.kernels.fp8_block_linear import DECODE_MAX_M, bf16_linear

    if x.shape[0] <= DECODE_MAX_M:
        return bf16_linear(x, weight, counters=counters, out_dtype=torch.float32)
    if x.is_cuda:  # what vLLM's cuBLAS tier calls
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return torch.mm(x.float(), weight.float().t())  # CPU has no mixed-dtype mm; the same products


def router_logits_fake(x: Tensor, weight: Tensor, counters: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


def register_op() -> None:
    global _lib
    if _lib is not None:
        return
    from torch.library import Library
    from vllm.utils.torch_utils import direct_register_custom_op

    lib = Library("glmctl", "FRAGMENT")
    direct_register_custom_op("router_logits", router_logits, mutates_args=[], fake_impl=router_logits_fake,
                              target_lib=lib)
    _lib = lib


def takes(gate, x: Tensor) -> bool:
    """The calls glmctl's op computes exactly as vLLM's cuBLAS tier does (bf16 in, fp32 out)."""
    counters = getattr(gate, "glmctl_router_counters", None)
    return (counters is not None and counters.device == x.device and x.dim() == 2
            and x.dtype == torch.bfloat16 and gate.weight.dtype == torch.bfloat16
            and gate.out_dtype == torch.float32 and gate.bias is None)


def install() -> str:
    """Every `GateLinear` built afterwards owns counters and runs `glmctl.router_logits` where
    `takes()` holds; other calls go to vLLM's tiers unchanged. Idempotent."""
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    from glmctl.kernels.fp8_block_linear import new_counters
    from glmctl.plugin.patching import after_init, wrap_once

    register_op()

    def add_counters(gate, *args, **kwargs):
        gate.register_buffer("glmctl_router_counters", new_counters(gate.weight.device), persistent=False)

    def make(stock):
        def forward(self, x):
            if takes(self, x):
                return torch.ops.glmctl.router_logits(x, self.weight, self.glmctl_router_counters), None
            return stock(self, x)

        return forward

    after_init(GateLinear, "router_gemm", add_counters)
    wrap_once(GateLinear, "forward", make, "router_gemm")
    return "router logits (glmctl GEMV)"
