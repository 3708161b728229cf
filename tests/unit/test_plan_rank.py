"""One TP8 rank of GLM-5.3-Flash as a TP1 model: its spec, its KV layout (the H200 run's figures),
its weights beside the node GPU's, and the checkpoint directory `glmctl testing rank-config` writes."""

from __future__ import annotations

import json

import pytest

from glmctl.errors import UsageError
from glmctl.plan import kv_cache_layout, kv_capacity, load_model_spec
from glmctl.plan.prediction.rank import rank_model_spec, rank_weights, truncated_model_spec
from glmctl.plan.presets import GLM53_FLASH

GIB = 1 << 30


@pytest.fixture(scope="module")
def glm():
    return load_model_spec("glm-5.3-flash")


@pytest.fixture(scope="module")
def rank(glm):
    return rank_model_spec(glm, 8)


def test_rank_spec_splits_what_vllm_splits(rank):
    assert (rank.num_attention_heads, rank.linear_num_heads, rank.moe_intermediate_size) == (8, 8, 256)
    assert (rank.intermediate_size, rank.vocab_size, rank.n_routed_experts) == (1536, 19_360, 288)
    # replicated in vLLM 0.30: the indexer, the latent, the schedule, the MTP module
    assert (rank.index_n_heads, rank.index_topk, rank.index_kpool, rank.kv_lora_rank) == (32, 2048, 16, 512)
    assert (rank.num_hidden_layers, rank.hidden_size, rank.num_nextn_predict_layers) == (45, 4096, 1)


@pytest.mark.parametrize("tp", [3, 32])
def test_rank_spec_refuses_splits_vllm_or_fp8_blocks_refuse(glm, tp):
    with pytest.raises(UsageError):
        rank_model_spec(glm, tp)


def test_truncation_keeps_an_mla_layer(rank):
    cut = truncated_model_spec(rank, num_layers=4, mtp_layers=0, dense_mlps=True)
    assert cut.layer_types == ["linear_attention"] * 3 + ["indexed_attention"]
    assert cut.mlp_layer_types == ["dense"] * 4 and cut.num_nextn_predict_layers == 0
    with pytest.raises(UsageError, match="no MLA layer"):
        truncated_model_spec(rank, num_layers=3)


def test_h200_run_kv_tokens_and_block(rank, glm):
    """vLLM on the H200 (TP8 rank model, glmctl's plugin, fp8 KV, 8,192 tokens, prefix caching off)
    logged block 2,048 (mamba page padded by 93.21 %) and 3,988,593 tokens for 47.84 GiB."""
    for model, tp in ((rank, 1), (glm, 8)):  # the rank model, and one GPU of the TP8 node
        layout = kv_cache_layout(model, tp=tp, kv_cache_dtype="fp8", num_spec=0, mtp_layers=0, prefix_caching=False,
                                 kernel_block_size=16)
        assert layout.block_size == 2048
        assert round(100 * (layout.mla_page_bytes / layout.kda_state_bytes - 1), 2) == 93.21
        assert layout.blocks_per_request(8192) == 4 + 1 + 4 * 1  # attention, tail, 4 KDA groups ("none")
        assert kv_capacity(layout, int(47.84 * GIB), 8192).kv_tokens == 3_988_593
    stock = kv_cache_layout(rank, tp=1, kv_cache_dtype="fp8", num_spec=0, mtp_layers=0, prefix_caching=False,
                            glmctl_plugin=False)
    assert stock.block_size == 1536  # stock vLLM's 32 x kpool multiple: 1,152 -> 1,536


def test_vllm_cpu_starts_from_16_whatever_block_size_is_asked(rank):
    def block(**kw) -> int:
        return kv_cache_layout(rank, tp=1, kv_cache_dtype="fp8", num_spec=0, mtp_layers=0, prefix_caching=False,
                               platform="cpu", **kw).block_size

    assert block() == block(user_block_size=4096) == 2048
    assert block(user_block_size=4096, cpu_amx=True) == 4096  # AMX: vLLM CPU keeps --block-size
    mtp = kv_cache_layout(rank, tp=1, kv_cache_dtype="fp8", num_spec=3, mtp_layers=1, prefix_caching=False,
                          platform="cpu")
    assert mtp.block_size == 1536 and mtp.tail_page_bytes == 2 * 18 * 128 * 2


@pytest.mark.parametrize(("variant", "node_gib"), [("bf16", 73.50), ("fp8", 37.10), ("exl3", 19.66)])
def test_rank_weights_equal_the_node_gpu_but_the_padded_vocabulary(variant, node_gib):
    w = rank_weights(variant)
    assert w.node_gpu_bytes / GIB == pytest.approx(node_gib, abs=0.005)
    diff = {g.group: g.difference_bytes for g in w.groups if g.difference_bytes}
    assert diff == {"embeddings": 2 * 32 * 4096 * 2}  # 19,392 - 19,360 rows, embedding + LM head, bf16
    with_mtp = rank_weights(variant, mtp=True)
    assert with_mtp.mtp_layers == 1 and with_mtp.node_gpu_bytes > w.node_gpu_bytes


# The H200 run of the EXL3 rank model (bench/results/rank-sim-h200.json): glmctl's plugin, fp8 KV,
# MTP-3, 262,144 tokens, 8 slots, prefix caching off, FULL decode graphs 1..48, 2,048 batched tokens,
# gpu_memory_utilization 0.3176 of the H200 (one L40's 44.4 GiB).
H200_MTP3 = dict(kv_tokens=3_587_383, kv_gib="22.49", weights_gib=20.34, lcm=2_359_296, padding_pct=40.15)


def test_h200_mtp3_run_layout_is_exact(rank):
    """vLLM logged block 1,536 (mamba page padded by 40.15 %), kv lcm block 2,359,296 and 3,587,383
    tokens for "22.49 GiB": 2,518 blocks of 184 per request, the only count that prints as 22.49."""
    import math

    from glmctl.kernels.layouts import kpool_tail_ring

    layout = kv_cache_layout(rank, tp=1, kv_cache_dtype="fp8", num_spec=3, mtp_layers=1, prefix_caching=False,
                             kernel_block_size=16)
    assert layout.block_size == 1536
    assert round(100 * (layout.mla_page_bytes / layout.kda_state_bytes - 1), 2) == H200_MTP3["padding_pct"]
    # group block sizes: attention 1,536, the 18-token tail ring (kpool + 3 drafts - 1), and the KDA
    # groups at max_model_len (mamba "none" mode)
    assert math.lcm(layout.block_size, kpool_tail_ring(16, 3), 262_144) == H200_MTP3["lcm"]
    assert layout.blocks_per_request(262_144) == 171 + 1 + 3 * 4  # attention, tail, 3 KDA groups x (1 + 3)
    printed = {n: f"{n * layout.bytes_per_block / GIB:.2f}" for n in (2517, 2518, 2519)}
    assert [n for n, text in printed.items() if text == H200_MTP3["kv_gib"]] == [2518]
    assert kv_capacity(layout, 2518 * layout.bytes_per_block, 262_144).kv_tokens == H200_MTP3["kv_tokens"]


def test_h200_mtp3_run_plan(tmp_path, rank):
    """`glmctl plan` for the run's exact setup. Exact by vLLM's rules: the weightless rank config is
    planned with FP8 KDA and MLA projections (what the plugin builds from its quantization config)
    and with no indexer profiling reserves (the plugin's indexer op makes none). Estimated: the
    profile's activation peak, non-torch memory and graph pool (node constants), which is why the
    KV tokens are compared within 4 % (measured: +2.9 %; vLLM's split of those 1.57 GiB was not in
    the saved log) and the weights within 1 % (vLLM's figure also holds kernel workspaces)."""
    from glmctl.plan import gpu_node, plan_capacity
    from glmctl.plan.serving_setup import ServingSetup, Speculative, WeightFormats
    from glmctl.testing.rank_config import rank_hf_config

    config = rank_hf_config(rank, {"stop_token_ids": [0], "pad_token_id": 0}, GLM53_FLASH["indexer_types"], "exl3")
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_model_spec(tmp_path)
    assert model.fp8_attention == ["kda", "mla"] and model.checkpoint_quant == "exl3:4"
    setup = ServingSetup(tensor_parallel_size=1, kv_cache_dtype="fp8",
                         weights=WeightFormats.for_checkpoint(model.checkpoint_quant, model.fp8_attention),
                         speculative=Speculative(method="mtp", num_tokens=3), max_model_len=262_144, max_num_seqs=8,
                         max_num_batched_tokens=2048, gpu_memory_utilization=0.3176, enable_prefix_caching=False,
                         cudagraph_capture_sizes=[1, 2, 4, 8, 12, 16, 24, 32, 40, 48], kernel_block_size=16)
    plan = plan_capacity(model, gpu_node(num_gpus=1, gpu_memory_gib=139.8), setup)
    keys = {m.key for m in plan.memory}
    assert not keys & {"indexer_workspace", "indexer_logits"} and "topk_buffers" in keys
    weights = sum(m.bytes for m in plan.memory if m.section in ("weights", "drafter") or m.key == "topk_buffers")
    assert weights / GIB == pytest.approx(H200_MTP3["weights_gib"], rel=0.01)
    assert plan.kv_tokens == pytest.approx(H200_MTP3["kv_tokens"], rel=0.04)
    stock = plan_capacity(model, gpu_node(num_gpus=1, gpu_memory_gib=139.8), setup.model_copy(update={
        "glmctl_plugin": False}))
    assert {"indexer_workspace", "indexer_logits"} <= {m.key for m in stock.memory}


def test_weightless_checkpoint_fp8_attention_follows_the_quantization_config(tmp_path, rank):
    """No tensor names to read: the plugin (and so the planner) takes every attention family FP8
    unless `modules_to_not_convert` names its projections; a bf16 rank config has none."""
    from glmctl.testing.rank_config import rank_hf_config

    ids = {"stop_token_ids": [0], "pad_token_id": 0}
    for experts, want in (("fp8", ["kda", "mla"]), ("exl3", ["kda", "mla"]), ("bf16", [])):
        (tmp_path / "config.json").write_text(json.dumps(rank_hf_config(rank, ids, GLM53_FLASH["indexer_types"],
                                                                        experts)))
        assert load_model_spec(tmp_path).fp8_attention == want, experts
    config = rank_hf_config(rank, ids, GLM53_FLASH["indexer_types"], "fp8")
    config["quantization_config"]["modules_to_not_convert"] = [
        f"model.layers.{i}.self_attn.q_proj" for i in rank.kda_layers]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_model_spec(tmp_path).fp8_attention == ["mla"]


def test_rank_config_directory(tmp_path):
    from glmctl.testing.rank_config import build_rank_config

    info = build_rank_config(tmp_path / "rank", tp=8, experts="fp8")
    config = json.loads((info.path / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    assert config["layer_types"] == GLM53_FLASH["layer_types"] and config["first_k_dense_replace"] == 3
    tok = json.loads((info.path / "tokenizer.json").read_text())
    ids = set(tok["model"]["vocab"].values()) | {t["id"] for t in tok["added_tokens"]}
    assert ids == set(range(19_360))  # every id the random model can sample decodes
    assert config["pad_token_id"] < 19_360 and (info.path / "generation_config.json").is_file()
    assert not list(info.path.glob("*.safetensors"))
    spec = load_model_spec(info.path)
    assert spec.checkpoint_quant == "fp8" and spec.num_attention_heads == 8 and spec.defaulted == []
    with pytest.raises(UsageError, match="not empty"):
        build_rank_config(tmp_path / "rank", tp=8)


def test_exl3_variant_names_every_moe_layer_and_mtp(rank):
    from glmctl.quantize.exl3_format import Exl3ExpertsSpec

    from glmctl.testing.rank_config import rank_hf_config

    config = rank_hf_config(rank, {"stop_token_ids": [0], "pad_token_id": 0}, GLM53_FLASH["indexer_types"], "exl3")
    spec = Exl3ExpertsSpec.from_config(config["quantization_config"])
    assert spec.bits == 4 and spec.layers() == set(range(3, 46)) and spec.tp_degrees == [1]
    assert spec.non_experts["quant_method"] == "fp8"
