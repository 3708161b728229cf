"""vLLM 0.30's Marlin FP8 (W8A16) linear on given block-FP8 weights, as vLLM's
`MarlinFP8ScaledMMLinearKernel` prepares and calls it on sm_89: the peer that glmctl's
`fp8_block_linear` replaces. Benchmarks and the GPU lane's agreement test use it; needs vLLM's
CUDA build."""

from __future__ import annotations

import torch


class MarlinFp8Linear:
    """One linear: `weight` [N, K] float8_e4m3fn and `scale` [ceil(N/128), ceil(K/128)] fp32 are
    repacked once (Marlin's layout, bf16 group scales); call with x [M, K] bf16."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        from vllm.model_executor.layers.quantization.utils.marlin_utils_fp8 import (
            prepare_fp8_layer_for_marlin,
        )

        n, k = weight.shape
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
        layer.weight_scale_inv = torch.nn.Parameter(scale.clone(), requires_grad=False)
        layer.output_size_per_partition, layer.input_size_per_partition = n, k
        layer.weight_block_size = [128, 128]
        layer.orig_dtype = torch.bfloat16
        prepare_fp8_layer_for_marlin(layer, size_k_first=False)
        self.layer, self.n, self.k = layer, n, k

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from vllm.model_executor.layers.quantization.utils.marlin_utils_fp8 import (
            apply_fp8_marlin_linear,
        )

        layer = self.layer
        return apply_fp8_marlin_linear(x, layer.weight, layer.weight_scale_inv, layer.workspace,
                                       self.n, self.k, None)
