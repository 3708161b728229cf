"""vLLM 0.30 itself reads the tiny checkpoint: config schema, MTP rewrite, and every weight name."""

from __future__ import annotations

import pytest

from glmctl.serving.server import free_port
from tests.conftest import REPO
from tests.vllm.subprocess_report import run_report

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_view(tiny_checkpoint):
    return run_report([str(REPO / "tests" / "vllm" / "tiny_vllm_load.py"), str(tiny_checkpoint.path),
                       str(free_port())], timeout=420, no_torchvision=True)


def test_vllm_parses_the_flat_glm5_next_config(vllm_view, tiny_checkpoint):
    spec = tiny_checkpoint.spec
    assert vllm_view["config_class"] == "Glm5NextConfig"
    assert vllm_view["architectures"] == ["Glm5NextForCausalLM"]
    a = vllm_view["attrs"]
    assert (a["index_topk"], a["index_kpool"], a["index_head_dim"]) == (spec.index_topk, spec.index_kpool, 128)
    assert (a["kv_lora_rank"], a["qk_rope_head_dim"], a["mla_nope"]) == (512, 0, True)
    # Fields whose vLLM default differs from transformers' must come from the checkpoint.
    assert a["swiglu_limit"] == 10.0 and a["topk_method"] == "noaux_tc"
    assert a["num_experts_per_token"] == spec.num_experts_per_tok and a["moe_renormalize"] is True
    assert (a["mhc"], a["mhc_num_residual_streams"], a["mhc_sinkhorn_iterations"]) == (True, spec.hc_mult, 20)
    assert (a["linear_num_heads"], a["linear_head_dim"]) == (spec.linear_num_heads, spec.linear_head_dim)
    assert a["mlp_layer_types"] == spec.mlp_layer_types()
    assert a["layers_block_type"] == ["linear_attention", "attention", "attention", "linear_attention"]


def test_mtp_speculation_resolves_to_vllms_glm5_next_mtp(vllm_view):
    assert vllm_view["draft"] == {"model_type": "glm5_next_mtp", "architectures": ["Glm5NextMTPModel"],
                                  "n_predict": 1}
    # Why the checkpoint says model_type "glm5_next": vLLM only rewrites that spelling for MTP.
    assert vllm_view["mtp_rewrite_of_text_type"] == "glm5_next_text"


def test_vllm_loads_every_weight_of_main_model_and_mtp(vllm_view):
    for part in ("main", "mtp"):
        assert vllm_view[part]["params"] > 0
        assert vllm_view[part]["not_loaded"] == [], part
        assert vllm_view[part]["unknown"] == [], part
    assert vllm_view["values_match"]


def test_vllms_tokenizer_loader_reads_the_tokenizer_and_chat_template(vllm_view, tiny_checkpoint):
    assert vllm_view["tokenizer"] == {
        "eos_token_id": tiny_checkpoint.special_token_ids["<|endoftext|>"],
        "size": tiny_checkpoint.tokenizer_vocab,
        "chat": "[gMASK]<sop><|user|>\nhi<|assistant|>\n",
    }
