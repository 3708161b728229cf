"""The vLLM side of EXL3 experts without CUDA: registration, config parsing, and the weight loader.

The loader is driven the way vLLM 0.30's GLM-5.3-Flash `load_weights` drives it: checkpoint names
through vLLM's own expert mapping, one `param.weight_loader(...)` call per tensor, on every TP rank.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from glmctl.quantize.exl3_format import (
    MUL1_MARKER,
    PROJECTIONS,
    Exl3ExpertsSpec,
    io_features,
    trellis_shape,
)

from glmctl.errors import ConfigError

pytest.importorskip("vllm")


def _spec(**kw) -> dict:
    return Exl3ExpertsSpec(bits=4, modules=["model.layers.1.mlp.experts", "model.layers.45.mlp.experts"],
                           **kw).to_config()


def test_registration_respects_the_switch_and_is_idempotent(monkeypatch):
    from vllm.model_executor.layers.quantization import (
        QUANTIZATION_METHODS,
        get_quantization_config,
    )

    from glmctl.plugin.quantization.exl3_config import Exl3ExpertsConfig, register_exl3_quantization

    for off in ("off", "no", "0", "False"):
        monkeypatch.setenv("GLMCTL_EXL3", off)
        assert register_exl3_quantization() is False
    monkeypatch.delenv("GLMCTL_EXL3")
    assert register_exl3_quantization() and register_exl3_quantization()
    assert QUANTIZATION_METHODS.count("glmctl_exl3") == 1
    assert get_quantization_config("glmctl_exl3") is Exl3ExpertsConfig


def test_config_routes_converted_layers_and_hands_the_rest_to_the_source_format():
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    from glmctl.plugin.quantization.exl3_config import Exl3ExpertsConfig

    bf16 = Exl3ExpertsConfig.from_config(_spec())
    assert bf16.layers == {1, 45} and bf16.inner is None and bf16.get_name() == "glmctl_exl3"
    fp8 = Exl3ExpertsConfig.from_config(_spec(non_experts={"quant_method": "fp8", "weight_block_size": [128, 128],
                                                          "activation_scheme": "dynamic"}))
    assert isinstance(fp8.inner, Fp8Config)
    fp8.packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}
    assert fp8.inner.packed_modules_mapping == {"gate_up_proj": ["gate_proj", "up_proj"]}
    with pytest.raises(ConfigError, match="non_experts quant_method 'awq'"):
        Exl3ExpertsConfig.from_config(_spec(non_experts={"quant_method": "awq"}))


def test_bf16_layers_get_vllms_unquantized_methods_never_none():
    """vLLM's linear layers raise "All linear layers should support quant method" when a
    checkpoint's config answers None for them (the EXL3 engine died so on CUDA): a bf16 source
    hands every linear, and every unconverted MoE layer, to vLLM's unquantized method."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    from glmctl.plugin.quantization.exl3_config import Exl3ExpertsConfig

    config = Exl3ExpertsConfig.from_config(_spec())
    linear = object.__new__(LinearBase)  # the type is what the config dispatches on
    assert isinstance(config.get_quant_method(linear, "model.layers.0.mlp.gate_up_proj"),
                      UnquantizedLinearMethod)
    assert isinstance(config.get_quant_method(linear, "model.layers.1.self_attn.q_a_proj"),
                      UnquantizedLinearMethod)
    experts = object.__new__(RoutedExperts)
    experts.__dict__["moe_config"] = SimpleNamespace()
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as unq

    built = []
    original = unq.UnquantizedFusedMoEMethod.__init__
    try:
        unq.UnquantizedFusedMoEMethod.__init__ = lambda self, moe: built.append(moe)
        method = config.get_quant_method(experts, "model.layers.2.mlp.experts")  # not converted
    finally:
        unq.UnquantizedFusedMoEMethod.__init__ = original
    assert isinstance(method, unq.UnquantizedFusedMoEMethod) and built == [experts.moe_config]
    assert config.get_quant_method(object(), "model.layers.1.self_attn.attn") is None


class _Layer:
    """The parts of vLLM's RoutedExperts the method touches."""

    def __init__(self, torch, local_experts=None):
        self.module = torch.nn.Module()
        self.layer_name = "model.layers.1.mlp.experts"
        self.local = local_experts

    def register_parameter(self, name, param):
        self.module.register_parameter(name, param)

    def __getattr__(self, name):
        return getattr(self.module, name)

    def _map_global_expert_id_to_local_expert_id(self, e: int) -> int:
        return e if self.local is None or e in self.local else -1


def _moe(tp_size: int, tp_rank: int, use_ep: bool = False):
    return SimpleNamespace(moe_parallel_config=SimpleNamespace(use_ep=use_ep, tp_size=tp_size), tp_rank=tp_rank,
                           has_bias=False, activation=SimpleNamespace(value="silu"), is_act_and_mul=True,
                           max_capture_size=0, experts_per_token=2)


def _stored(torch, experts: int, hidden: int, inter: int, bits: int) -> dict[str, object]:
    """Checkpoint tensors of one layer with recognisable values."""
    out, gen = {}, torch.Generator().manual_seed(0)
    for e in range(experts):
        for p in PROJECTIONS:
            in_f, out_f = io_features(p, hidden, inter)
            name = f"model.layers.1.mlp.experts.{e}.{p}"
            out[f"{name}.trellis"] = torch.randint(-2**15, 2**15, trellis_shape(in_f, out_f, bits), dtype=torch.int16,
                                                   generator=gen)
            out[f"{name}.suh"] = torch.randn(in_f, generator=gen).half()
            out[f"{name}.svh"] = torch.randn(out_f, generator=gen).half()
            out[f"{name}.mul1"] = torch.tensor(MUL1_MARKER, dtype=torch.int32)
    return out


@pytest.mark.parametrize("tp_size", [1, 2])
def test_weight_loader_places_every_rank_slice_through_vllms_expert_mapping(tp_size):
    import torch
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    from glmctl.plugin.quantization.exl3_method import Exl3MoEMethod

    experts, hidden, inter, bits = 3, 256, 256 * tp_size, 4
    stored = _stored(torch, experts, hidden, inter, bits)
    mapping = RoutedExperts.build_expert_params_mapping("gate_proj", "down_proj", "up_proj", experts)
    spec = Exl3ExpertsSpec.from_config(_spec())
    for rank in range(tp_size):
        layer = _Layer(torch)
        method = Exl3MoEMethod(_moe(tp_size, rank), spec)
        method.create_weights(layer, experts, hidden, inter // tp_size, torch.bfloat16)
        params = dict(layer.module.named_parameters())
        for name, tensor in stored.items():
            # vLLM's loop: "experts.E.gate_proj." in name -> "experts.routed_experts.w13_" + suffix
            hit = [(p, w, e, s) for p, w, e, s in mapping if w in name]
            assert len(hit) == 1, name
            param_name, weight_name, expert_id, shard_id = hit[0]
            mapped = name.replace(weight_name, param_name).split("routed_experts.")[1]
            param = params[mapped]
            assert param.weight_loader(param, tensor, mapped, expert_id=expert_id, shard_id=shard_id,
                                       return_success=True) is True
        per = inter // tp_size
        lo, hi = rank * per, (rank + 1) * per
        for e in range(experts):
            n = f"model.layers.1.mlp.experts.{e}"
            assert torch.equal(params["w13_trellis"][e, 0], stored[f"{n}.gate_proj.trellis"][:, lo // 16:hi // 16])
            assert torch.equal(params["w13_trellis"][e, 1], stored[f"{n}.up_proj.trellis"][:, lo // 16:hi // 16])
            assert torch.equal(params["w13_suh"][e, 1], stored[f"{n}.up_proj.suh"])
            assert torch.equal(params["w13_svh"][e, 0], stored[f"{n}.gate_proj.svh"][lo:hi])
            assert torch.equal(params["w2_trellis"][e], stored[f"{n}.down_proj.trellis"][lo // 16:hi // 16])
            assert torch.equal(params["w2_suh"][e], stored[f"{n}.down_proj.suh"][lo:hi])
            assert torch.equal(params["w2_svh"][e], stored[f"{n}.down_proj.svh"])
        assert (params["w13_mul1"] == MUL1_MARKER).all() and (params["w2_mul1"] == MUL1_MARKER).all()


def test_loader_skips_experts_of_other_ranks_and_refuses_shape_mismatches():
    import torch

    from glmctl.plugin.quantization.exl3_method import Exl3MoEMethod

    spec = Exl3ExpertsSpec.from_config(_spec())
    layer = _Layer(torch, local_experts={0})
    method = Exl3MoEMethod(_moe(1, 0), spec)
    method.create_weights(layer, 2, 256, 256, torch.bfloat16)
    param = layer.module.w2_suh
    assert param.weight_loader(param, torch.zeros(256).half(), "w2_suh", expert_id=1, shard_id="w2",
                               return_success=True) is False
    with pytest.raises(ConfigError, match="bits or shapes"):
        trellis = layer.module.w2_trellis
        trellis.weight_loader(trellis, torch.zeros(16, 16, 48, dtype=torch.int16), "w2_trellis", expert_id=0,
                              shard_id="w2", return_success=True)  # a 3-bit tensor in a 4-bit checkpoint
    with pytest.raises(ConfigError, match="expert parallelism"):
        Exl3MoEMethod(_moe(1, 0, use_ep=True), spec).create_weights(_Layer(torch), 2, 256, 256, torch.bfloat16)


def test_loading_refuses_missing_markers_before_touching_cuda():
    import torch

    from glmctl.plugin.quantization.exl3_method import Exl3MoEMethod

    layer = _Layer(torch)
    method = Exl3MoEMethod(_moe(1, 0), Exl3ExpertsSpec.from_config(_spec()))
    method.create_weights(layer, 2, 256, 256, torch.bfloat16)
    with pytest.raises(ConfigError, match="lack the mul1 codebook marker"):
        method.process_weights_after_loading(layer)  # nothing was loaded: markers are zero


def test_dummy_weights_get_valid_markers():
    """`--load-format dummy` (vLLM's initialize_single_dummy_weight) gives every mul1 marker its
    value, so a random-weight EXL3 model passes the marker check; trellises stay zero."""
    import torch
    from vllm.model_executor.model_loader.weight_utils import initialize_single_dummy_weight

    from glmctl.plugin.quantization.exl3_method import Exl3MoEMethod

    layer = _Layer(torch)
    Exl3MoEMethod(_moe(1, 0), Exl3ExpertsSpec.from_config(_spec())).create_weights(layer, 2, 256, 256, torch.bfloat16)
    params = dict(layer.module.named_parameters())
    for param in params.values():
        initialize_single_dummy_weight(param)
    assert (params["w13_mul1"] == MUL1_MARKER).all() and (params["w2_mul1"] == MUL1_MARKER).all()
    assert not params["w13_trellis"].any() and params["w13_suh"].abs().max() <= 1e-3
