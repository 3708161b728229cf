"""The EXL3-experts format: names, shapes, quantization_config, and tensor-parallel slicing."""

from __future__ import annotations

import pytest
from glmctl.quantize.exl3_format import (
    MUL1_MARKER,
    MUL1_MULTIPLIER,
    Exl3ExpertsSpec,
    check_marker,
    layer_index,
    parse_expert_linear,
    planned_tensors,
    rank_span,
    tp_problems,
    tp_slice,
)

from glmctl.errors import ConfigError, UsageError


def test_marker_is_the_mul1_multiplier_as_int32():
    import torch

    marker = torch.tensor(MUL1_MARKER, dtype=torch.int32)
    assert marker.view(torch.uint32).item() == MUL1_MULTIPLIER  # the same 32 bits exllamav3 stores
    check_marker("x.mul1", marker)
    with pytest.raises(UsageError, match="mul1 codebook marker"):
        check_marker("x.mcg", torch.tensor(0xCBAC1FED - 2**32, dtype=torch.int32))


def test_expert_names_parse_and_everything_else_does_not():
    lin = parse_expert_linear("model.layers.7.mlp.experts.287.down_proj")
    assert (lin.module, lin.layer, lin.expert, lin.proj) == ("model.layers.7.mlp.experts", 7, 287, "down_proj")
    assert parse_expert_linear("model.language_model.layers.3.mlp.experts.0.gate_proj").layer == 3
    for other in ("model.layers.7.mlp.shared_experts.down_proj", "model.layers.7.mlp.gate_proj",
                  "model.visual.layers.1.mlp.experts.0.up_proj", "model.layers.7.mlp.experts.gate_up_proj"):
        assert parse_expert_linear(other) is None
    # vLLM's module prefixes (the MTP layer lives under mtp_block) resolve to the checkpoint layer
    assert layer_index("model.layers.45.mtp_block.mlp.experts") == 45
    assert layer_index("model.layers.3.mlp.experts") == 3
    assert layer_index("lm_head") is None


def test_planned_tensors_have_the_documented_shapes_and_sizes():
    gate = {t.name.rsplit(".", 1)[1]: t for t in planned_tensors("g", 4096, 2048, 4)}
    assert gate["trellis"].shape == (256, 128, 64) and gate["trellis"].dtype == "I16"
    assert gate["suh"].shape == (4096,) and gate["svh"].shape == (2048,)
    assert gate["mul1"].shape == () and gate["mul1"].dtype == "I32"
    # 4 bits per weight plus the two fp16 scale vectors: 0.5 B/weight + 12 KiB
    assert sum(t.nbytes for t in gate.values()) == 4096 * 2048 // 2 + 2 * (4096 + 2048) + 4


@pytest.mark.parametrize("tp, ok", [(1, True), (2, True), (8, True), (16, True), (32, False), (3, False)])
def test_tp_degrees_are_checked_against_128_element_slices(tp, ok):
    problems = tp_problems(4096, 2048, [tp])
    assert (problems == []) is ok
    if not ok:
        assert f"TP {tp}" in problems[0]


def test_tp_problems_reject_dims_that_are_not_128_multiples():
    assert any("hidden_size 4000" in p for p in tp_problems(4000, 2048, [1]))


def test_tp_slices_reassemble_the_full_tensors_and_refuse_bad_degrees():
    import torch

    hidden, inter, k = 256, 512, 4
    gate = torch.arange(hidden // 16 * inter // 16 * 16 * k, dtype=torch.int16).view(hidden // 16, inter // 16, 16 * k)
    down = gate.reshape(inter // 16, hidden // 16, 16 * k)
    vec_i, vec_h = torch.arange(inter, dtype=torch.float16), torch.arange(hidden, dtype=torch.float16)
    tp = 4
    parts = [tp_slice("gate_proj", "trellis", gate, inter, tp, r) for r in range(tp)]
    assert torch.equal(torch.cat(parts, dim=1), gate) and parts[0].shape == (16, 8, 64)
    assert torch.equal(torch.cat([tp_slice("up_proj", "svh", vec_i, inter, tp, r) for r in range(tp)]), vec_i)
    assert tp_slice("up_proj", "suh", vec_h, inter, tp, 3) is vec_h  # input side replicated
    assert torch.equal(torch.cat([tp_slice("down_proj", "trellis", down, inter, tp, r) for r in range(tp)]), down)
    assert torch.equal(torch.cat([tp_slice("down_proj", "suh", vec_i, inter, tp, r) for r in range(tp)]), vec_i)
    assert tp_slice("down_proj", "svh", vec_h, inter, tp, 1) is vec_h
    assert rank_span(2048, 8, 7) == (1792, 2048)
    with pytest.raises(ConfigError, match="cannot be split over 8"):
        tp_slice("gate_proj", "trellis", gate, inter, 8, 0)  # 64 channels per rank


def test_quantization_config_round_trips_and_rejects_what_the_runtime_cannot_serve():
    spec = Exl3ExpertsSpec(bits=4, modules=["model.layers.3.mlp.experts", "model.layers.45.mlp.experts"],
                           non_experts={"quant_method": "fp8", "weight_block_size": [128, 128]})
    config = spec.to_config()
    assert config["quant_method"] == "glmctl_exl3" and config["experts"]["codebook"] == "mul1"
    back = Exl3ExpertsSpec.from_config(config)
    assert back.layers() == {3, 45} and back.non_experts["quant_method"] == "fp8" and back.bits == 4
    for broken, match in [
        ({**config, "format": "glmctl-exl3/0"}, "format"),
        ({**config, "experts": {**config["experts"], "bits": 9}}, "bits"),
        ({**config, "experts": {**config["experts"], "codebook": "mcg"}}, "codebook"),
        ({**config, "experts": {**config["experts"], "modules": ["lm_head"]}}, "modules"),
        ({**config, "quant_method": "exl3"}, "quant_method"),
    ]:
        with pytest.raises(ConfigError, match=match):
            Exl3ExpertsSpec.from_config(broken)
