"""`Exl3MoEMethod`: vLLM 0.30's MoE method for EXL3 routed experts (glmctl-exl3/1 checkpoints).

Chosen by glmctl.plugin.quantization.exl3_config for the routed experts of each converted MoE layer. It
registers the EXL3 tensors as parameters named so that vLLM's GLM-5.3-Flash loader finds them
with its usual expert mapping (`experts.E.gate_proj.trellis` -> `experts.routed_experts.
w13_trellis`, shard w1, expert E), slices them for this TP rank in its own weight loader
(128-element slices, `exl3_format.tp_slice`), and runs the rank's experts with
glmctl.plugin.quantization.exl3_experts; vLLM all-reduces the partial outputs as for any MoE method, and runs
the shared expert itself (unchanged). Expert parallelism is refused: each rank holds every
expert's slice.
"""

from __future__ import annotations

import logging
import time

import torch
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.utils import set_weight_attrs

from glmctl.errors import ConfigError
from glmctl.quantize.exl3_format import MUL1_MARKER, Exl3ExpertsSpec, tp_slice, trellis_shape

logger = logging.getLogger("vllm.glmctl")
_SHARDS = {"w1": ("gate_proj", 0), "w3": ("up_proj", 1), "w2": ("down_proj", None)}
_warmed_devices: set = set()


class Exl3MoEMethod(FusedMoEMethodBase):
    """Routed experts of one MoE layer in EXL3, on this TP rank, via exllamav3's fused kernel."""

    def __init__(self, moe, spec: Exl3ExpertsSpec) -> None:
        super().__init__(moe)
        self.spec = spec
        self.runtime = None

    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        moe = self.moe
        if moe.moe_parallel_config.use_ep:
            raise ConfigError("EXL3 experts are served with tensor parallelism only (expert parallelism "
                              "is enabled)", hint="drop --enable-expert-parallel")
        if moe.has_bias or moe.activation.value != "silu" or not moe.is_act_and_mul:
            raise ConfigError(f"EXL3 experts run SiLU-gated experts without bias; {layer.layer_name} "
                              f"has activation {moe.activation.value}, bias {moe.has_bias}")
        tp_size, tp_rank = moe.moe_parallel_config.tp_size, moe.tp_rank
        full = intermediate_size_per_partition * tp_size
        if tp_size not in self.spec.tp_degrees:
            logger.warning("glmctl exl3: TP %d was not among the degrees checked at conversion (%s)",
                           tp_size, self.spec.tp_degrees)
        for name, (shape, dtype) in param_shapes(num_experts, hidden_size, intermediate_size_per_partition,
                                                 self.spec.bits).items():
            param = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
            layer.register_parameter(name, param)
            attrs = {"weight_loader": self._loader(layer, name.split("_", 1)[1], full, tp_size, tp_rank)}
            if name.endswith("_mul1"):
                # load_format=dummy fills parameters with this value (vLLM's dummy_weight_value);
                # the other tensors get its random floats or stay zero, which the kernels run on
                # at the same cost, so a random-weight model (the per-rank simulation) loads.
                attrs["dummy_weight_value"] = MUL1_MARKER
            set_weight_attrs(param, attrs)

    def _loader(self, layer, suffix: str, full_intermediate: int, tp_size: int, tp_rank: int):
        def load(param, loaded_weight: torch.Tensor, weight_name: str = "", shard_id: str = "",
                 expert_id: int = 0, return_success: bool = False):
            local = layer._map_global_expert_id_to_local_expert_id(expert_id)
            if local == -1:
                return False if return_success else None
            proj, half = _SHARDS[shard_id]
            part = tp_slice(proj, suffix, loaded_weight, full_intermediate, tp_size, tp_rank)
            dest = param.data[local] if half is None else param.data[local, half]
            if tuple(part.shape) != tuple(dest.shape):
                raise ConfigError(f"{weight_name} (expert {expert_id}, {proj}.{suffix}): stored "
                                  f"{list(loaded_weight.shape)} gives {list(part.shape)} on TP rank {tp_rank}, "
                                  f"the layer expects {list(dest.shape)}",
                                  hint="the checkpoint's bits or shapes do not match config.json")
            dest.copy_(part)
            return True if return_success else None

        load.supports_moe_loading = True  # type: ignore[attr-defined]
        return load

    def process_weights_after_loading(self, layer) -> None:
        from glmctl.plugin.quantization.exl3_experts import Exl3MoE, Exl3Projection

        bad = int((layer.w13_mul1 != MUL1_MARKER).sum()) + int((layer.w2_mul1 != MUL1_MARKER).sum())
        if bad:
            raise ConfigError(f"{layer.layer_name}: {bad} expert tensors lack the mul1 codebook marker "
                              "(not loaded, or another codebook)", hint="rebuild with `glmctl quantize exl3`")
        gate = Exl3Projection(layer.w13_trellis[:, 0], layer.w13_suh[:, 0], layer.w13_svh[:, 0])
        up = Exl3Projection(layer.w13_trellis[:, 1], layer.w13_suh[:, 1], layer.w13_svh[:, 1])
        down = Exl3Projection(layer.w2_trellis, layer.w2_suh, layer.w2_svh)
        self.runtime = Exl3MoE(gate, up, down, self.spec.bits, getattr(layer, "swiglu_limit", None))
        device = self.runtime.device
        if device not in _warmed_devices:
            # Every batch size vLLM will capture, once per device, before any capture
            sizes = capture_sizes(self.moe.max_capture_size)
            started = time.monotonic()
            self.runtime.warm_up(sizes, self.moe.experts_per_token)
            _warmed_devices.add(device)
            logger.info("glmctl exl3: warmed up %d batch sizes (%s..%s tokens) in %.1f s", len(sizes), sizes[0],
                        sizes[-1], time.monotonic() - started)

    def get_fused_moe_quant_config(self, layer):
        return None

    def apply(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts=None, shared_experts_input=None) -> torch.Tensor:
        return self.runtime(x, topk_ids, topk_weights)


def capture_sizes(max_capture_size: int) -> list[int]:
    """The token counts vLLM captures graphs for (its compilation config, whose list the batches
    are padded to), else every count up to `max_capture_size`."""
    try:
        from vllm.config import get_current_vllm_config

        sizes = get_current_vllm_config().compilation_config.cudagraph_capture_sizes
    except Exception:  # noqa: BLE001 - no config in scope (a test building the method alone)
        sizes = None
    limit = max(max_capture_size, 1)
    chosen = sorted({int(s) for s in sizes or () if 0 < int(s) <= limit})
    return chosen or list(range(1, limit + 1))


def param_shapes(experts: int, hidden: int, intermediate: int, bits: int) -> dict[str, tuple[tuple, torch.dtype]]:
    """The layer parameters of one rank: w13 = gate (index 0) and up (1), w2 = down."""
    h, i, k, e = hidden, intermediate, bits, experts
    return {
        "w13_trellis": ((e, 2, *trellis_shape(h, i, k)), torch.int16),
        "w13_suh": ((e, 2, h), torch.float16),
        "w13_svh": ((e, 2, i), torch.float16),
        "w13_mul1": ((e, 2), torch.int32),
        "w2_trellis": ((e, *trellis_shape(i, h, k)), torch.int16),
        "w2_suh": ((e, i), torch.float16),
        "w2_svh": ((e, h), torch.float16),
        "w2_mul1": ((e,), torch.int32),
    }
