"""The `glmctl_exl3` quantization config for vLLM 0.30: EXL3 routed experts, the rest unchanged.

vLLM picks this from the checkpoint's `quantization_config` (glmctl.quantize.exl3_format); no
`--quantization` flag is needed. `register_exl3_quantization()` runs in the plugin's `register()`
in every vLLM process, before vLLM parses the model config. `get_quant_method` answers per layer:
  - the routed experts (vLLM's `RoutedExperts`) of a converted MoE layer -> `Exl3MoEMethod`
    (glmctl.plugin.quantization.exl3_method, imported only then: it pulls in vLLM's fused-MoE modules);
  - everything else -> what the source format needs: vLLM's own `Fp8Config` for a block-FP8
    source (`non_experts`); for bf16, vLLM's unquantized methods (`UnquantizedLinearMethod`,
    `UnquantizedFusedMoEMethod` for an unconverted MoE layer; vLLM's linear layers refuse a
    config that answers None). The shared expert is an ordinary MLP, so it stays exactly as it
    was.

Switches: GLMCTL_EXL3=off (or GLMCTL_PLUGIN=off) registers nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from vllm.model_executor.layers.quantization import (
    QUANTIZATION_METHODS,
    get_quantization_config,
    register_quantization_config,
)
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from glmctl import switches
from glmctl.errors import ConfigError
from glmctl.quantize.exl3_format import QUANT_METHOD, Exl3ExpertsSpec, layer_index


def register_exl3_quantization(env: Mapping[str, str] | None = None) -> bool:
    """Register `glmctl_exl3` with vLLM (idempotent; respects the switches, read from `env` or
    this process's environment). True if registered."""
    if not switches.read("GLMCTL_EXL3", env) or switches.plugin_off(env):
        return False
    if QUANT_METHOD not in QUANTIZATION_METHODS or get_quantization_config(QUANT_METHOD) is not Exl3ExpertsConfig:
        register_quantization_config(QUANT_METHOD)(Exl3ExpertsConfig)
    return True

class Exl3ExpertsConfig(QuantizationConfig):
    """GLM-5.3-Flash with EXL3 routed experts (glmctl-exl3/1)."""

    def __init__(self, spec: Exl3ExpertsSpec) -> None:
        self.spec = spec
        self.layers = spec.layers()
        self.inner = _non_experts_config(spec.non_experts)
        super().__init__()

    # The model assigns packed_modules_mapping after construction; the FP8 config of the
    # non-expert layers needs it too (fused q/k/v and gate/up shards), so it is shared.
    @property
    def packed_modules_mapping(self):
        return self._packed

    @packed_modules_mapping.setter
    def packed_modules_mapping(self, value) -> None:
        self._packed = value
        if self.inner is not None:
            self.inner.packed_modules_mapping = value

    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80  # exllamav3's kernels: mma.sync + cp.async (Ampere); sm_89 is the target

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # the block lives in config.json

    @classmethod
    def from_config(cls, config: dict) -> Exl3ExpertsConfig:
        return cls(Exl3ExpertsSpec.from_config(config))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

        if isinstance(layer, RoutedExperts) and layer_index(prefix) in self.layers:
            from glmctl.plugin.quantization.exl3_method import Exl3MoEMethod

            return Exl3MoEMethod(layer.moe_config, self.spec)
        if self.inner is not None:
            return self.inner.get_quant_method(layer, prefix)
        return _unquantized_method(layer)

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        if self.inner is not None:
            self.inner.apply_vllm_mapper(hf_to_vllm_mapper)


def _unquantized_method(layer: torch.nn.Module):
    """vLLM's own method for a bf16 layer of a checkpoint whose config is ours (None for layers
    that take no method, e.g. attention, which vLLM then builds unquantized)."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    if isinstance(layer, LinearBase):
        return UnquantizedLinearMethod()
    if isinstance(layer, RoutedExperts):
        return UnquantizedFusedMoEMethod(layer.moe_config)
    return None


def _non_experts_config(qc: dict | None) -> QuantizationConfig | None:
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"EXL3-experts checkpoint: non_experts quant_method {method!r} is not supported",
                          hint="convert a bf16 or block-FP8 GLM-5.3-Flash checkpoint")
    return get_quantization_config(method).from_config(qc)
