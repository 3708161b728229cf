"""Selection globs, the never-touched tensors, fused-GEMM and shape refusals, quantization_config."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from glmctl.quantize.checkpoint import open_checkpoint  # noqa: E402
from glmctl.quantize.fp8_plan import DEFAULT_MODULES, Fp8Settings, plan_fp8  # noqa: E402
from glmctl.quantize.glm5next import LayerKinds, vllm_fate  # noqa: E402

from glmctl.errors import UsageError  # noqa: E402
from tests.synthetic_checkpoint import SyntheticSpec, write_synthetic_checkpoint  # noqa: E402
from tests.unit._quantize_util import SMALL, copy_checkpoint, make_synthetic  # noqa: E402


@pytest.fixture(scope="module")
def synthetic_src(tmp_path_factory):
    return make_synthetic(tmp_path_factory)


def _quantized(src, **settings) -> set[str]:
    plan = plan_fp8(open_checkpoint(src), Fp8Settings(**settings))
    return {t.name for t in plan.quantized}


def test_default_selection_is_the_attention_projections_of_both_layer_kinds(synthetic_src):
    got = _quantized(synthetic_src)
    kda = {f"model.layers.{i}.self_attn.{x}_proj.weight" for i in (0, 2) for x in "qkvo"}
    mla = {f"model.layers.{i}.self_attn.{x}.weight" for i in (1, 3)
           for x in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "indexer.wq_b", "indexer.wk")}
    assert got == kda | mla


def test_star_selects_every_linear_but_never_the_non_linear_tensors(synthetic_src):
    got = _quantized(synthetic_src, modules=("*",))
    ck = open_checkpoint(synthetic_src)
    everything = {e.name for _, e in ck.tensors()}
    never = {n for n in everything if any(k in n for k in (
        "norm", "conv1d", "A_log", "dt_bias", "hc_attn", "embed_tokens", "lm_head", "mlp.gate.", "bias"))}
    assert never and not (got & never)
    assert "model.layers.1.mlp.experts.0.down_proj.weight" in got
    assert "model.layers.0.self_attn.b_proj.weight" in got  # asked for explicitly by '*'
    assert got == {n for n in everything - never if n.endswith(".weight")}


def test_embeddings_only_when_asked(synthetic_src):
    got = _quantized(synthetic_src, modules=("*.self_attn.q_proj",), embeddings=True)
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= got
    q = plan_fp8(open_checkpoint(synthetic_src), Fp8Settings(embeddings=True)).quantization_config
    assert q["modules_to_convert"] == ["embed_tokens"]  # transformers' FP8Embedding swap
    assert "modules_to_convert" not in plan_fp8(open_checkpoint(synthetic_src), Fp8Settings()).quantization_config


def test_exclude_and_comma_free_globs(synthetic_src):
    got = _quantized(synthetic_src, modules=("*.self_attn.*",), exclude=("*.indexer.*", "*layers.0.*"))
    assert "model.layers.2.self_attn.f_a_proj.weight" in got
    assert not any(".indexer." in n or "layers.0." in n for n in got)
    assert "model.layers.1.self_attn.q_a_layernorm.weight" not in got  # a norm, matched but never converted


def test_glob_matching_nothing_is_noted_and_empty_selection_refused(synthetic_src):
    plan = plan_fp8(open_checkpoint(synthetic_src), Fp8Settings(modules=("*.q_proj", "*.nope")))
    assert any("'*.nope' matched no tensor" in n for n in plan.notes)
    with pytest.raises(UsageError, match="nothing to convert"):
        plan_fp8(open_checkpoint(synthetic_src), Fp8Settings(modules=("*.nope",)))


def test_half_a_fused_gemm_that_vllm_loads_in_fp8_is_refused(synthetic_src):
    ck = open_checkpoint(synthetic_src)
    with pytest.raises(UsageError, match=r"mlp\.gate_up_proj"):
        plan_fp8(ck, Fp8Settings(modules=("model.layers.0.mlp.gate_proj",)))
    with pytest.raises(UsageError, match="routed experts"):
        plan_fp8(ck, Fp8Settings(modules=("*.experts.0.*",)))
    with pytest.raises(UsageError, match="experts.0.gate_up"):
        plan_fp8(ck, Fp8Settings(modules=("*.experts.*.gate_proj", "*.experts.*.down_proj")))


def test_partial_input_block_is_refused_with_the_reason(tmp_path):
    src = write_synthetic_checkpoint(tmp_path / "s", SyntheticSpec(**{**SMALL, "kv_lora": 200}))
    with pytest.raises(UsageError, match=r"kv_b_proj.*K // scale columns"):
        plan_fp8(open_checkpoint(src), Fp8Settings())
    plan = plan_fp8(open_checkpoint(src), Fp8Settings(exclude=("*.kv_b_proj",)))
    # kv_a_proj_with_mqa has N = 200 rows: a partial bottom block, allowed (ceil grid, as vLLM)
    kv_a = plan.tensors["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"]
    assert kv_a.action == "quantize" and kv_a.bytes_out == 200 * 256 + 2 * 2 * 4
    assert any("partial block of rows" in n and "transformers" in n for n in plan.notes)


def test_partial_block_midway_through_a_fused_attention_gemm_is_noted(synthetic_src):
    plan = plan_fp8(open_checkpoint(synthetic_src), Fp8Settings(modules=("*.self_attn.b_proj", "*.f_a_proj")))
    assert any("b_proj ends in a partial block" in n and "in_proj_qkvbfg_a" in n for n in plan.notes)


def test_quantization_config_is_what_vllm_fp8config_reads(synthetic_src):
    plan = plan_fp8(open_checkpoint(synthetic_src), Fp8Settings())
    q = plan.quantization_config
    assert {k: q[k] for k in ("quant_method", "activation_scheme", "weight_block_size")} == {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    skip = set(q["modules_to_not_convert"])
    # vLLM looks fused layers up by their own names, experts by the FusedMoE prefix:
    assert {"model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj",
            "model.layers.1.mlp.shared_experts.gate_up_proj", "model.layers.1.mlp.experts",
            "lm_head", "model.embed_tokens", "model.layers.0.self_attn.f_b_proj",
            "model.layers.1.self_attn.indexer.weights_proj"} <= skip
    assert not any(".experts.0." in s for s in skip)
    assert not skip & {t.name.removesuffix(".weight") for t in plan.quantized}
    # a fused attention GEMM that is partly FP8 is listed by member, not by its fused name
    assert "model.layers.0.self_attn.in_proj_qkvbfg_a" not in skip
    assert "model.layers.1.self_attn.fused_qkv_a_proj" not in skip


def test_fp8_source_tensors_pass_through_and_block_must_match(tmp_path, synthetic_src):
    from glmctl.quantize.fp8 import quantize_block_fp8
    from safetensors.torch import load_file, save_file

    src = copy_checkpoint(synthetic_src, tmp_path / "fp8src")
    shard = src / "model-00001-of-00002.safetensors"
    tensors = load_file(str(shard))
    name = "model.layers.0.mlp.down_proj"
    tensors[name + ".weight"], tensors[name + ".weight_scale_inv"] = quantize_block_fp8(tensors[name + ".weight"], 128)
    for part in ("gate_proj", "up_proj"):
        n = f"model.layers.0.mlp.{part}"
        tensors[n + ".weight"], tensors[n + ".weight_scale_inv"] = quantize_block_fp8(tensors[n + ".weight"], 128)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    for n in tensors:
        idx["weight_map"][n] = shard.name
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128], "ignored_layers": ["stale"], "extra": 1}
    (src / "config.json").write_text(json.dumps(cfg))

    plan = plan_fp8(open_checkpoint(src), Fp8Settings())
    assert plan.tensors[name + ".weight"].action == "keep_fp8"
    assert plan.tensors[name + ".weight_scale_inv"].action == "copy"
    q = plan.quantization_config
    assert "ignored_layers" not in q and q["extra"] == 1
    assert "model.layers.0.mlp.gate_up_proj" not in q["modules_to_not_convert"]
    assert name not in q["modules_to_not_convert"]
    with pytest.raises(UsageError, match="--block 128"):
        plan_fp8(open_checkpoint(src), Fp8Settings(block=64))
    cfg["quantization_config"] = {"quant_method": "awq"}
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UsageError, match="'awq'"):
        plan_fp8(open_checkpoint(src), Fp8Settings())


def test_bad_block_is_a_usage_error(synthetic_src):
    with pytest.raises(UsageError, match="power of two"):
        plan_fp8(open_checkpoint(synthetic_src), Fp8Settings(block=100))


@pytest.mark.parametrize(("module", "fate"), [
    ("model.layers.0.self_attn.q_proj", "rejected"),        # KDA: built with quant_config=None
    ("model.layers.0.self_attn.f_b_proj", "rejected"),
    ("model.layers.0.self_attn.o_proj", "bf16_at_load"),    # matched by _try_load_fp8_attn_proj
    ("model.layers.1.self_attn.q_a_proj", "bf16_at_load"),
    ("model.layers.1.self_attn.kv_b_proj", "rejected"),
    ("model.layers.1.self_attn.indexer.wk", "bf16_at_load"),
    ("model.layers.1.self_attn.indexer.wq_b", "rejected"),
    ("model.layers.0.mlp.gate_proj", "fp8"),
    ("model.layers.1.mlp.experts.3.down_proj", "fp8"),
    ("model.layers.1.mlp.shared_experts.up_proj", "fp8"),
    ("model.layers.4.self_attn.q_b_proj", "bf16_at_load"),  # the MTP layer is MLA
    ("lm_head", "rejected"),
    ("model.language_model.layers.2.self_attn.v_proj", "rejected"),  # multimodal checkpoint names
])
def test_vllm_fate_of_each_module(module, fate):
    kinds = LayerKinds({"model_type": "glm5_next", "num_hidden_layers": 4,
                        "layer_types": ["linear_attention", "indexed_attention"] * 2})
    assert vllm_fate(module, kinds) == fate


def test_default_modules_cover_no_gate_or_head_count_projection():
    import fnmatch

    left_out = [f"model.layers.0.self_attn.{x}" for x in ("f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj",
                                                          "b_proj", "indexer.weights_proj")]
    assert not [m for m in left_out for g in DEFAULT_MODULES if fnmatch.fnmatchcase(m, g)]
