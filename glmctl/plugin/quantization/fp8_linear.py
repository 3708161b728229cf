"""Block-FP8 linear layers for GLM-5.3-Flash's attention projections (see `fp8_selection` for which).

- `AttentionFp8Config`: the quantization config the plugin hands to the attention projections that
  vLLM 0.30 builds without one. It answers per layer prefix: the FP8 method for the units chosen
  FP8, vLLM's unquantised method for other linears, nothing for non-linear layers (so the MLA
  attention layer and its KV cache are set up exactly as without it).
- The FP8 method: on GPUs vLLM's own `Fp8LinearMethod` with the checkpoint's `Fp8Config`, so
  vLLM's block-FP8 kernel selection applies (vLLM 0.30, `_POSSIBLE_FP8_BLOCK_KERNELS[CUDA]`, first
  supported wins: FlashInfer-DeepGEMM, DeepGEMM and CUTLASS need sm_90+, B12x sm_12x; on sm_8x the
  first that runs is `MarlinFP8ScaledMMLinearKernel`, weight-only FP8 (`is_fp8_marlin_supported`:
  sm_75+), then `TritonFp8BlockScaledMMKernel`, the w8a8 Triton block GEMM, which runs on any
  CUDA device and is what `VLLM_DISABLED_KERNELS=MarlinFP8ScaledMMLinearKernel` selects).
  On vLLM's CPU platform `Fp8DequantLinearMethod`: the same parameters while loading, then the
  exact dequantisation (`glmctl.quantize.fp8.dequantize_block_fp8`) in the model dtype, because
  vLLM-CPU's only block-FP8 GEMM (`CPUFp8BlockScaledMMKernel`) needs AMX.
- `KdaInputProjections`: vLLM's fused KDA `in_proj_qkvbfg_a` as an FP8 [q,k,v] GEMM and a BF16
  [b,f_a,g_a] GEMM whose outputs are concatenated in vLLM's order, so the layer's forward is
  unchanged.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.utils import replace_parameter

from glmctl.plugin.quantization.fp8_glmctl import BlockFp8Weights
from glmctl.quantize.fp8 import dequantize_block_fp8


def inner_fp8_config(quant_config):
    """The vLLM `Fp8Config` behind a model's quant config (itself, or glmctl_exl3's non-experts)."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    for candidate in (quant_config, getattr(quant_config, "inner", None)):
        if isinstance(candidate, Fp8Config):
            return candidate
    return None


def fp8_linear_method(inner, kind: str, prefix: str):
    if kind == "dequant":
        return Fp8DequantLinearMethod(inner.weight_block_size)
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod
    from vllm.model_executor.layers.quantization.utils.marlin_utils import get_marlin_input_dtype

    from glmctl.plugin.quantization.fp8_glmctl import GlmctlFp8LinearMethod, current_linear_kernel

    if (current_linear_kernel() == "glmctl" and list(inner.weight_block_size) == [128, 128]
            and not getattr(inner, "is_scale_e8m0", False)):
        return GlmctlFp8LinearMethod(inner.weight_block_size)
    method = Fp8LinearMethod(inner)
    method.marlin_input_dtype = get_marlin_input_dtype(prefix)  # as Fp8Config.get_quant_method
    return method


class AttentionFp8Config(QuantizationConfig):
    """Block FP8 for the linears whose prefix is in `fp8_prefixes` (None: every linear)."""

    def __init__(self, inner, kind: str, fp8_prefixes: set[str] | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.kind = kind
        self.fp8_prefixes = fp8_prefixes

    def get_name(self):
        return "glmctl_fp8_attention"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 75

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict):
        raise NotImplementedError("built by the glmctl plugin, never from a checkpoint config")

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if not isinstance(layer, LinearBase):
            return None
        if self.fp8_prefixes is None or prefix in self.fp8_prefixes:
            return fp8_linear_method(self.inner, self.kind, prefix)
        return UnquantizedLinearMethod()


@register_weight_loader_v2_supported_method
class Fp8DequantLinearMethod(BlockFp8Weights, UnquantizedLinearMethod):
    """Loads exactly the parameters vLLM's block `Fp8LinearMethod` creates (fp8 `weight` [N, K],
    fp32 `weight_scale_inv` [ceil(N/B), ceil(K/B)], same loaders and shard offsets), then replaces
    them by `dequantize_block_fp8(weight, weight_scale_inv)` in the model dtype and runs as an
    unquantised linear. Shards of a fused GEMM are dequantised on their own block grids, exactly
    as vLLM's loader placed their scales."""

    def __init__(self, weight_block_size) -> None:
        super().__init__(weight_block_size)
        self.block = self.weight_block_size[0]

    def process_weights_after_loading(self, layer) -> None:
        replace_parameter(layer, "weight", dequantized_weight(layer, self.block))
        del layer.weight_scale_inv
        super().process_weights_after_loading(layer)


def dequantized_weight(layer, block: int) -> torch.Tensor:
    """The layer's fp8 weight times its block scales, shard by shard, in `layer.orig_dtype`.

    vLLM's merged loaders put shard i's rows at R = the previous shards' rows and its ceil(rows / B)
    scale rows at ceil(R / B) (`adjust_block_scale_shard`); `validate_fp8_block_shape` has made
    every shard but the last whole blocks, so each shard starts on its own block grid."""
    weight, scale = layer.weight.data, layer.weight_scale_inv.data
    parts, row = [], 0
    for rows in layer.logical_widths:
        first = -(-row // block)
        parts.append(dequantize_block_fp8(weight[row:row + rows], scale[first:first - (-rows // block)],
                                          block, layer.orig_dtype))
        row += rows
    return torch.cat(parts) if len(parts) > 1 else parts[0]


class KdaInputProjections(nn.Module):
    """KDA's q,k,v,b,f_a,g_a projections as two GEMMs: `qkv` (block FP8) and `bfg_a` (model dtype).

    forward(x) returns ([q | k | v | b | f_a | g_a], None) per rank: the layout of vLLM's fused
    `in_proj_qkvbfg_a` (q,k,v,b split over ranks; f_a, g_a replicated), which the layer then splits.
    """

    def __init__(self, hidden_size: int, projection_size: int, num_heads: int, head_dim: int,
                 tp_size: int, quant_config: QuantizationConfig, prefix: str) -> None:
        super().__init__()
        from vllm.models.glm5next.nvidia.kda import _Glm5NextMergedColumnParallelLinear

        self.qkv = MergedColumnParallelLinear(hidden_size, [projection_size] * 3, bias=False,
                                              quant_config=quant_config, prefix=f"{prefix}.qkv")
        self.bfg_a = _Glm5NextMergedColumnParallelLinear(
            hidden_size, [num_heads, head_dim, head_dim], replicated_shard_ids=(1, 2), tp_size=tp_size,
            bias=False, quant_config=None, prefix=f"{prefix}.bfg_a")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.cat([self.qkv(x)[0], self.bfg_a(x)[0]], dim=-1), None
