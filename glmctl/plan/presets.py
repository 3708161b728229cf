"""Built-in model presets: architecture numbers only, no weights.

`glm-5.3-flash` is GLM-5.3-Flash as transformers 5.24 defines it: the default values of
`Glm5NextTextConfig` in `transformers/models/glm5_next/configuration_glm5_next.py` (the class docstring
names the checkpoint `zai-org/GLM-5.3-Flash`), with the per-layer schedules its `__post_init__`
derives from them (`layer_types`: every 4th layer, index 3, 7, ..., 43, is "indexed_attention", the
rest "linear_attention"; `mlp_layer_types`: 3 dense layers then MoE; `indexer_types`: all "full").
Only the numbers are copied here, so `glmctl plan` never imports transformers.

Two facts transformers' config does not carry are stated separately, each with its source:
- `num_nextn_predict_layers = 1`: vLLM 0.30's `Glm5NextTextConfig` default
  (`vllm/transformers_utils/configs/glm5_next.py`); the MTP module `vllm/models/glm5next/nvidia/mtp.py`
  builds one predictor layer per count.
- `checkpoint_quant = "fp8"`: the report serves the FP8 checkpoint ("At FP8, 320B parameters take up
  roughly 320 GB"); in it vLLM loads experts, shared experts and dense MLPs as FP8 while MLA and KDA
  projections stay BF16 (`glm5next/nvidia/model.py` passes `quant_config=None` to MLA, `kda.py`
  drops the quant config for KDA: "fp8 checkpoints omit their scales").
"""

from __future__ import annotations

_GLM53_FLASH_LAYERS = 45

GLM53_FLASH: dict = {
    "architectures": ["Glm5NextForCausalLM"],
    "model_type": "glm5_next",
    "dtype": "bfloat16",
    "vocab_size": 154880,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": _GLM53_FLASH_LAYERS,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_shared_experts": 1,
    "n_routed_experts": 288,
    "num_experts_per_tok": 8,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 0,
    "v_head_dim": 256,
    "qk_nope_head_dim": 256,
    "max_position_embeddings": 1048576,
    "tie_word_embeddings": False,
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 32,
    "index_kpool": 16,
    "linear_head_dim": 128,
    "linear_num_heads": 64,
    "linear_conv_kernel_dim": 4,
    "hc_mult": 4,
    "mhc": True,
    "layer_types": [
        "indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(_GLM53_FLASH_LAYERS)
    ],
    "mlp_layer_types": ["dense"] * 3 + ["sparse"] * (_GLM53_FLASH_LAYERS - 3),
    "indexer_types": ["full"] * _GLM53_FLASH_LAYERS,
    # not in transformers' config: see the module docstring
    "num_nextn_predict_layers": 1,
}

PRESETS: dict[str, dict] = {"glm-5.3-flash": GLM53_FLASH}
# The quantization the preset's checkpoint ships with (see the module docstring).
PRESET_CHECKPOINT_QUANT: dict[str, str] = {"glm-5.3-flash": "fp8"}
