"""Block-FP8 linears on glmctl's Triton W8A16 kernel (`glmctl.kernels.fp8_block_linear`).

On sm_89 vLLM 0.30 runs block-FP8 linears with `MarlinFP8ScaledMMLinearKernel` (DeepGEMM and
CUTLASS block-scaled GEMMs need sm_90+). `GlmctlFp8LinearMethod` keeps the checkpoint's layout
instead (fp8 `weight` [N, K], fp32 `weight_scale_inv` [ceil(N/128), ceil(K/128)], the same
parameters and loaders as vLLM's block `Fp8LinearMethod`, so every checkpoint that loads there
loads here) and runs `torch.ops.glmctl.fp8_block_linear`: weight-only FP8 at every batch size,
each weight byte read once per call, split-K in one launch for decode batches. Each layer owns
its split-K arrival counters (zero at rest), so no two launches in flight share them.

Which layers: every block-FP8 linear vLLM would build with `Fp8LinearMethod` on a GLM-5.3-Flash
checkpoint (the attention units of `fp8_attention`, and through `install_fp8_linear_kernel` the
checkpoint's own block-FP8 linears: shared experts, dense MLPs, MTP), when `linear_kernel()`
says "glmctl" (GLMCTL_FP8_LINEAR=glmctl, on sm_89 and newer, where Triton has fp8e4nv).
"""

# No `from __future__ import annotations`: torch infers the op schema from the annotations.
import logging

import torch
from torch import Tensor
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase
from vllm.model_executor.layers.quantization.utils.fp8_utils import (
    create_fp8_scale_parameter,
    create_fp8_weight_parameter,
    validate_fp8_block_shape,
)
from vllm.model_executor.parameter import BlockQuantScaleParameter

from glmctl import switches
from glmctl.errors import ConfigError
from glmctl.plugin.patching import wrap_once

logger = logging.getLogger("vllm.glmctl")
MIN_CAPABILITY = (8, 9)  # Triton's fp8e4nv conversions
_lib = None
_logged = False


def linear_kernel(capability, env=None) -> str:
    """"glmctl" or "vllm": which kernel runs block-FP8 linears held in FP8 on this GPU.
    `capability`: (major, minor), or None off CUDA (always "vllm" there). auto is vLLM's choice
    until glmctl's kernel has passed the GPU lane inside vLLM (the kernel's own GPU tests and its
    Marlin A/B are in tests/gpu/test_fp8_linear_gpu.py and bench/gpu/fp8_linear_bench.py)."""
    value = switches.read("GLMCTL_FP8_LINEAR", env)
    if capability is None or value != "glmctl":
        return "vllm"
    if tuple(capability) < MIN_CAPABILITY:
        raise ConfigError(f"GLMCTL_FP8_LINEAR=glmctl needs sm_89 or newer (this GPU is sm_{capability[0]}"
                          f"{capability[1]}: Triton has no fp8e4nv below sm_89)",
                          hint="unset GLMCTL_FP8_LINEAR (auto) or set it to vllm (Marlin)")
    return "glmctl"


def current_linear_kernel() -> str:
    from vllm.platforms import current_platform

    cap = current_platform.get_device_capability() if current_platform.is_cuda() else None
    return linear_kernel(None if cap is None else (cap.major, cap.minor))


def fp8_block_linear(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, bias: Tensor | None,
                     counters: Tensor) -> Tensor:
    from glmctl.kernels.fp8_block_linear import fp8_block_linear as kernel

    return kernel(x, weight, weight_scale_inv, bias, counters=counters)


def fp8_block_linear_fake(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, bias: Tensor | None,
                          counters: Tensor) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0], dtype=torch.bfloat16)


def register_op() -> None:
    """torch.ops.glmctl.fp8_block_linear, once per process (an opaque call for torch.compile; the
    counters are left as they were found, so the op declares no mutation)."""
    global _lib
    if _lib is not None:
        return
    from torch.library import Library
    from vllm.utils.torch_utils import direct_register_custom_op

    lib = Library("glmctl", "FRAGMENT")
    direct_register_custom_op("fp8_block_linear", fp8_block_linear, mutates_args=[],
                              fake_impl=fp8_block_linear_fake, target_lib=lib)
    _lib = lib


class BlockFp8Weights:
    """The parameters vLLM's block `Fp8LinearMethod` registers (fp8 `weight` [N, K], fp32
    `weight_scale_inv` [ceil(N/B), ceil(K/B)]) with the same loaders and shard checks: a mixin for
    the linear methods that hold them."""

    def __init__(self, weight_block_size) -> None:
        super().__init__()
        self.weight_block_size = list(weight_block_size)

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                       output_size, params_dtype, **extra_weight_attrs):
        layer.logical_widths = output_partition_sizes
        layer.input_size_per_partition = input_size_per_partition
        layer.output_size_per_partition = sum(output_partition_sizes)
        layer.orig_dtype = params_dtype
        layer.weight_block_size = self.weight_block_size
        validate_fp8_block_shape(layer, input_size, output_size, input_size_per_partition,
                                 output_partition_sizes, self.weight_block_size)
        weight_loader = extra_weight_attrs.get("weight_loader")
        layer.register_parameter("weight", create_fp8_weight_parameter(
            layer.output_size_per_partition, input_size_per_partition, weight_loader))
        layer.register_parameter("weight_scale_inv", create_fp8_scale_parameter(
            BlockQuantScaleParameter, output_partition_sizes, input_size_per_partition,
            self.weight_block_size, weight_loader))


class GlmctlFp8LinearMethod(BlockFp8Weights, LinearMethodBase):
    """vLLM's block `Fp8LinearMethod` parameters, run by glmctl's W8A16 Triton kernel."""

    def __init__(self, weight_block_size) -> None:
        super().__init__(weight_block_size)
        if self.weight_block_size != [128, 128]:
            raise ValueError(f"glmctl's FP8 linear takes 128x128 blocks, not {self.weight_block_size}")

    def process_weights_after_loading(self, layer) -> None:
        from vllm.model_executor.utils import replace_parameter

        from glmctl.kernels.fp8_block_linear import new_counters

        replace_parameter(layer, "weight", layer.weight.data.contiguous())
        replace_parameter(layer, "weight_scale_inv", layer.weight_scale_inv.data.float().contiguous())
        # a buffer, so torch.compile and module moves treat it as the layer's state
        layer.register_buffer("glmctl_fp8_counters", new_counters(layer.weight.device), persistent=False)
        register_op()
        _log_once()

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.ops.glmctl.fp8_block_linear(x, layer.weight, layer.weight_scale_inv, bias,
                                                layer.glmctl_fp8_counters)
        return out if out.dtype == x.dtype else out.to(x.dtype)


def _log_once() -> None:
    global _logged
    if not _logged:
        _logged = True
        logger.info("glmctl fp8 linear: block-FP8 linears on glmctl's Triton W8A16 kernel "
                    "(GLMCTL_FP8_LINEAR=vllm: vLLM's choice)")


def install_fp8_linear_kernel() -> None:
    """Where glmctl's kernel is chosen for this GPU, vLLM's `Fp8Config` answers block-FP8 linears
    with `GlmctlFp8LinearMethod` (its other answers are unchanged). Idempotent."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod

    def make(stock):
        def get_quant_method(self, layer, prefix):
            method = stock(self, layer, prefix)
            if (type(method) is Fp8LinearMethod and isinstance(layer, LinearBase) and method.block_quant
                    and not method.is_scale_e8m0 and list(method.weight_block_size) == [128, 128]
                    and current_linear_kernel() == "glmctl"):
                return GlmctlFp8LinearMethod(method.weight_block_size)
            return method

        return get_quant_method

    wrap_once(Fp8Config, "get_quant_method", make, "fp8_linear")
