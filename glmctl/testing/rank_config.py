"""One tensor-parallel rank of GLM-5.3-Flash as a TP1 checkpoint directory (config + tokenizer, no weights).

A rank of TP `tp` computes, apart from its collectives, exactly what a TP1 model with the per-rank
dimensions computes. This module writes that TP1 model's `config.json`, `generation_config.json`
and a tokenizer, for vLLM to serve with `--load-format dummy` (random weights, nothing to carry).
How vLLM 0.30 shards each module (`vllm/models/glm5next/nvidia/`), and so what the rank keeps:

| module | TP sharding in vLLM 0.30 | rank config |
|---|---|---|
| MLA q_b / kv_b / o_proj | column / column / row parallel over heads (`Glm5NextAttention`) | `num_attention_heads` / tp |
| MLA fused q_a + kv_a | replicated (`kv_a_proj_with_mqa` / fused_qkv_a: ReplicatedLinear) | unchanged (latent 512, q_lora 1536) |
| DSA indexer | replicated: `wq_b` ReplicatedLinear, `wk_weights_proj` disable_tp (attention.py `Indexer`) | unchanged: 32 heads x 128, top-k, kpool |
| KDA q,k,v, b, o, conv, f_b/g_b | heads split (`Glm5NextLinearAttention`, asserts heads % tp) | `linear_num_heads` / tp |
| KDA f_a / g_a | replicated low-rank projections | unchanged (head_dim) |
| routed experts | TP MoE: every rank holds all experts, intermediate / tp | `moe_intermediate_size` / tp, all 288 experts |
| shared expert | `Glm5NextMLP(moe_intermediate x n_shared)`, intermediate split | follows `moe_intermediate_size` |
| dense MLP (first 3 layers) | merged column / row parallel | `intermediate_size` / tp |
| embedding, LM head | vocab-parallel: vocab padded to 64, split over tp | `vocab_size` / tp (vLLM pads it to 64 again) |
| router, mHC mixers, norms, MTP eh_proj | replicated | unchanged |

Left unchanged: hidden size, layer count and schedule, top-k, kpool, the MTP module. The TP1 model
differs from a real rank in two stated ways: vLLM pads the rank vocabulary (19,360 at TP8) to a
multiple of 64 (19,392: 32 rows of embedding and head more), and the sampler sees the rank's
vocabulary, not the full 154,880 (a real rank gathers the logits first), so the sampler's share of
a step is smaller than on the node.

`experts`: how vLLM builds the quantizable groups with dummy weights. `bf16`: no quantization.
`fp8`: the block-FP8 `quantization_config` of the FP8 checkpoint (experts, shared experts, dense
MLPs in FP8; vLLM keeps MLA and KDA in bf16 for this model whatever the config says). `exl3`: the
plugin's `glmctl_exl3` block (EXL3 routed experts, FP8 for the rest, as in the report's step 9).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from glmctl.errors import UsageError
from glmctl.plan.model import ModelSpec

ExpertsVariant = Literal["bf16", "fp8", "exl3"]
EXPERT_VARIANTS: tuple[str, ...] = ("bf16", "fp8", "exl3")
FP8_BLOCK = 128
RECIPE_FILE = "glmctl-rank-config.json"


def fp8_quantization_config() -> dict:
    """Block FP8 as the FP8 checkpoint declares it (vLLM 0.30's `Fp8Config` reads this)."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}


def exl3_quantization_config(rank: ModelSpec, bits: int) -> dict:
    """The plugin's `glmctl_exl3` block: EXL3 routed experts of every MoE layer (the MTP layers'
    included), block FP8 for the rest; checked at TP1, the degree the rank model is served at."""
    from glmctl.quantize.exl3_format import Exl3ExpertsSpec

    moe = rank.moe_layers
    mtp = range(rank.num_hidden_layers, rank.num_hidden_layers + rank.num_nextn_predict_layers)
    modules = [f"model.layers.{i}.mlp.experts" for i in [*moe, *mtp]]
    return Exl3ExpertsSpec(bits=bits, modules=modules, calibration="none (random weights)", tp_degrees=[1],
                           non_experts=fp8_quantization_config()).to_config()


def rank_hf_config(rank: ModelSpec, tokenizer_ids: dict, indexer_types: list[str],
                   experts: ExpertsVariant = "bf16", exl3_bits: int = 4) -> dict:
    """config.json of the rank model (`glmctl.plan.prediction.rank.rank_model_spec`): the schema the tiny
    checkpoint uses (what vLLM 0.30 and transformers 5.24 both load), with the rank's numbers."""
    from glmctl.testing.tiny_checkpoint import TinySpec, hf_config

    numbers = TinySpec(
        layers=rank.num_hidden_layers, hidden_size=rank.hidden_size, vocab_size=rank.vocab_size,
        intermediate_size=rank.intermediate_size, num_attention_heads=rank.num_attention_heads,
        q_lora_rank=rank.q_lora_rank, kv_lora_rank=rank.kv_lora_rank, qk_nope_head_dim=rank.qk_nope_head_dim,
        v_head_dim=rank.v_head_dim, index_n_heads=rank.index_n_heads, index_head_dim=rank.index_head_dim,
        index_topk=rank.index_topk, index_kpool=rank.index_kpool, linear_num_heads=rank.linear_num_heads,
        linear_head_dim=rank.linear_head_dim, linear_conv_kernel_dim=rank.linear_conv_kernel_dim,
        n_routed_experts=rank.n_routed_experts, num_experts_per_tok=rank.num_experts_per_tok,
        n_shared_experts=rank.n_shared_experts, moe_intermediate_size=rank.moe_intermediate_size,
        hc_mult=rank.hc_mult, mtp_layers=rank.num_nextn_predict_layers,
        max_position_embeddings=rank.max_position_embeddings,
    )
    config = hf_config(numbers, tokenizer_ids)
    config.update(
        layer_types=list(rank.layer_types),
        indexer_types=list(indexer_types[: rank.num_hidden_layers]),
        mlp_layer_types=list(rank.mlp_layer_types),
        first_k_dense_replace=len(rank.dense_mlp_layers),
    )
    if experts == "fp8":
        config["quantization_config"] = fp8_quantization_config()
    elif experts == "exl3":
        config["quantization_config"] = exl3_quantization_config(rank, exl3_bits)
    elif experts != "bf16":
        raise UsageError(f"--experts {experts!r} is not one of {', '.join(EXPERT_VARIANTS)}")
    return config


@dataclass
class RankConfigInfo:
    path: Path
    rank: ModelSpec
    tp: int
    experts: str
    config: dict
    tokenizer_vocab: int
    files: list[str]

    def summary(self) -> dict:
        c = self.config
        return {
            "path": str(self.path), "tp": self.tp, "experts": self.experts,
            "quant_method": (c.get("quantization_config") or {}).get("quant_method", "none"),
            "num_attention_heads": c["num_attention_heads"], "linear_num_heads": c["linear_num_heads"],
            "moe_intermediate_size": c["moe_intermediate_size"], "intermediate_size": c["intermediate_size"],
            "vocab_size": c["vocab_size"], "tokenizer_vocab": self.tokenizer_vocab,
            "n_routed_experts": c["n_routed_experts"], "index_n_heads": c["index_n_heads"],
            "num_hidden_layers": c["num_hidden_layers"], "mtp_layers": c["num_nextn_predict_layers"],
            "files": self.files,
        }


def build_rank_config(path: str | os.PathLike, *, tp: int = 8, experts: ExpertsVariant = "bf16", exl3_bits: int = 4,
                      num_layers: int | None = None, mtp_layers: int | None = None, dense_mlps: bool = False,
                      preset: str = "glm-5.3-flash", force: bool = False) -> RankConfigInfo:
    """Write the rank model's directory atomically (a temp dir beside `path`, renamed at the end)."""
    from glmctl.plan.model import load_model_spec
    from glmctl.plan.prediction.rank import rank_model_spec, truncated_model_spec
    from glmctl.plan.presets import PRESETS
    from glmctl.testing.tiny_checkpoint import _check_target, _write_json
    from glmctl.testing.tiny_tokenizer import train_tokenizer

    if preset not in PRESETS:
        raise UsageError(f"unknown preset {preset!r}", hint=f"one of: {', '.join(PRESETS)}")
    if experts not in EXPERT_VARIANTS:
        raise UsageError(f"--experts {experts!r} is not one of {', '.join(EXPERT_VARIANTS)}")
    from glmctl.quantize.exl3_format import SUPPORTED_BITS

    if experts == "exl3" and exl3_bits not in SUPPORTED_BITS:
        raise UsageError(f"--exl3-bits {exl3_bits} is not one of {SUPPORTED_BITS}")
    rank = truncated_model_spec(rank_model_spec(load_model_spec(preset), tp), num_layers, mtp_layers, dense_mlps)
    indexer_types = PRESETS[preset]["indexer_types"]
    target = Path(path).absolute()
    _check_target(target, force)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    try:
        tok = train_tokenizer(tmp, rank.vocab_size, rank.max_position_embeddings)
        _pad_tokenizer(tmp, rank.vocab_size)
        ids = {"stop_token_ids": tok.stop_token_ids, "pad_token_id": tok.pad_token_id}
        config = rank_hf_config(rank, ids, indexer_types, experts, exl3_bits)
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", {
            "eos_token_id": tok.stop_token_ids, "pad_token_id": tok.pad_token_id, "bos_token_id": None,
        })
        _write_json(tmp / RECIPE_FILE, {
            "generator": "glmctl testing rank-config", "preset": preset, "tp": tp, "experts": experts,
            "exl3_bits": exl3_bits if experts == "exl3" else None, "num_layers": rank.num_hidden_layers,
            "mtp_layers": rank.num_nextn_predict_layers, "dense_mlps": dense_mlps,
            "weights": "none: serve with --load-format dummy",
        })
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return RankConfigInfo(path=target, rank=rank, tp=tp, experts=experts, config=config,
                          tokenizer_vocab=rank.vocab_size, files=sorted(p.name for p in target.iterdir()))


def _pad_tokenizer(directory: Path, vocab_size: int) -> None:
    """Fill the trained vocabulary up to the model's with reserved special tokens, so every id a
    random-weight model samples decodes (the real tokenizer covers its vocabulary the same way)."""
    path = directory / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    used = set(data["model"]["vocab"].values()) | {t["id"] for t in data.get("added_tokens", [])}
    next_id = max(used) + 1
    for i, token_id in enumerate(range(next_id, vocab_size)):
        data["added_tokens"].append({"id": token_id, "content": f"<|reserved_{i}|>", "single_word": False,
                                     "lstrip": False, "rstrip": False, "normalized": False, "special": True})
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
