"""The plugin's FP8-attention rules (`glmctl.plugin.quantization.fp8_selection`): pure Python, no vLLM.
The vllm lane checks what vLLM then builds from them (tests/vllm/test_quantize_vllm.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from glmctl.plugin.quantization import fp8_selection as sel


@pytest.mark.parametrize(("name", "want"), [
    ("model.layers.3.self_attn.q_proj", (3, "q_proj")),
    ("model.language_model.layers.12.self_attn.indexer.wq_b", (12, "indexer.wq_b")),
    ("layers.4.mtp_block.self_attn.kv_b_proj", (4, "kv_b_proj")),  # vLLM's MTP prefix
    ("model.layers.3.mlp.experts.0.up_proj", None),
    ("model.embed_tokens", None),
])
def test_site_reads_checkpoint_and_vllm_names(name, want):
    assert sel.site(name) == want


def test_block_fp8_of_takes_only_serialized_square_dynamic_blocks():
    assert sel.block_fp8_of([128, 128], True, "dynamic", ["lm_head"]) == sel.BlockFp8(128, frozenset({"lm_head"}))
    assert sel.block_fp8_of([128, 128], False, "dynamic", None) is None  # online quantisation
    assert sel.block_fp8_of(None, True, "dynamic", None) is None  # per-tensor FP8
    assert sel.block_fp8_of([128, 128], True, "static", None) is None
    assert sel.block_fp8_of([128, 64], True, "dynamic", None) is None
    assert sel.block_fp8_of([0, 0], True, "dynamic", None) is None


def test_selection_from_tensor_names_needs_every_leaf_of_a_unit():
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight_scale_inv",
             "model.layers.0.self_attn.k_proj.weight_scale_inv",
             "model.layers.0.self_attn.v_proj.weight",  # v stayed bf16 in this checkpoint
             "model.layers.1.self_attn.q_a_proj.weight_scale_inv",
             "model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv",
             "model.layers.1.mlp.experts.0.up_proj.weight_scale_inv"]
    s = sel.select(sel.BlockFp8(128, frozenset()), names)
    assert s.source == "checkpoint" and s.block == 128
    assert s.fp8 == {(0, "q_proj"), (0, "k_proj"), (1, "q_a_proj"), (1, "kv_a_proj_with_mqa")}
    assert not s.all_fp8(0, sel.KDA_QKV)
    assert s.all_fp8(1, sel.MLA_QKV_A)
    assert not s.all_fp8(2, sel.MLA_QKV_A)


def test_selection_without_names_falls_back_to_the_ignored_list():
    cfg = sel.BlockFp8(128, frozenset({"model.layers.0.self_attn.v_proj", "lm_head"}))
    s = sel.select(cfg, None)
    assert s.source == "quantization_config" and s.fp8 is None
    assert s.ignored == {(0, "v_proj")}
    assert not s.all_fp8(0, sel.KDA_QKV)
    assert s.all_fp8(1, sel.KDA_QKV)


@pytest.mark.parametrize(("rows", "cols", "split", "want"), [
    ([512, 512, 512], 6144, True, True),
    ([512, 512, 8], 6144, False, True),  # the unsplit last shard may end in a partial block
    ([512, 512, 8], 6144, True, False),
    ([8, 512], 6144, False, False),  # a partial block in front shifts the scales behind it
    ([512], 6100, True, False),  # K must be whole blocks
])
def test_fits_block_is_vllms_block_shape_rule(rows, cols, split, want):
    assert sel.fits_block(rows, cols, 128, split) is want


def test_method_kind_defaults_by_platform_and_rejects_typos():
    assert sel.method_kind(True, {}) == "dequant"
    assert sel.method_kind(False, {}) == "vllm"
    assert sel.method_kind(True, {"GLMCTL_FP8_ATTENTION_METHOD": " VLLM "}) == "vllm"
    assert sel.method_kind(False, {"GLMCTL_FP8_ATTENTION_METHOD": "dequant"}) == "dequant"
    with pytest.raises(ValueError, match="is not one of auto, vllm, dequant"):
        sel.method_kind(False, {"GLMCTL_FP8_ATTENTION_METHOD": "fp8"})


@pytest.mark.parametrize(("env", "off"), [
    ({}, False), ({"GLMCTL_FP8_ATTENTION": "off"}, True), ({"GLMCTL_FP8_ATTENTION": "on"}, False),
    ({"GLMCTL_PLUGIN": "0"}, True), ({"GLMCTL_FP8_ATTENTION": "False"}, True),
])
def test_switched_off(env, off):
    assert sel.switched_off(env) is off


def test_checkpoint_tensor_names_from_the_index_or_the_shard_headers(tmp_path):
    from safetensors.numpy import save_file

    indexed = tmp_path / "indexed"
    indexed.mkdir()
    weight_map = {"a.weight": "model-1.safetensors", "a.weight_scale_inv": "model-1.safetensors"}
    (indexed / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert sel.checkpoint_tensor_names(str(indexed)) == list(weight_map)

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_file({"x.weight": np.zeros((2, 2), np.float32)}, str(sharded / "model-00001.safetensors"))
    save_file({"y.weight_scale_inv": np.ones(1, np.float32)}, str(sharded / "model-00002.safetensors"))
    assert sel.checkpoint_tensor_names(str(sharded)) == ["x.weight", "y.weight_scale_inv"]

    (indexed / "model.safetensors.index.json").write_text("{not json")
    assert sel.checkpoint_tensor_names(str(indexed)) is None  # vLLM's loader reports the damage
    empty = tmp_path / "empty"
    empty.mkdir()
    assert sel.checkpoint_tensor_names(str(empty)) is None


def test_checkpoint_tensor_names_of_an_uncached_hub_id_is_none(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert sel.checkpoint_tensor_names("nobody/not-a-cached-model") is None


def test_units_are_the_projection_table_split_by_fate():
    """Every attention projection of `glm5next.PROJECTIONS` is in exactly one unit of its layer kind,
    FP8 or BF16 as its `plugin` fate says; a fused unit keeps the table's (vLLM's) shard order."""
    from glmctl.quantize.glm5next import PROJECTIONS

    for kind in ("kda", "mla"):
        rows = [p for p in PROJECTIONS if p.family == kind]
        fp8 = [leaf for leaves in sel.FP8_UNITS[kind].values() for leaf in leaves]
        bf16 = [leaf for leaves in sel.BF16_UNITS[kind].values() for leaf in leaves]
        assert sorted(fp8 + bf16) == sorted(p.leaf.removeprefix("self_attn.") for p in rows)
        assert set(fp8) == {p.leaf.removeprefix("self_attn.") for p in rows if p.plugin == "fp8"}
    assert sel.KDA_INPUT == sel.KDA_QKV + sel.KDA_BFG_A
