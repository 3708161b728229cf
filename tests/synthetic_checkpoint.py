"""Synthetic GLM-5.3-Flash-named safetensors checkpoints for the converter tests.

Not a model: random values under the real checkpoint names and dtypes (KDA, MLA + indexer, dense
MLP, MoE with routed and shared experts, mHC mixers, norms), with every size a parameter so tests
can pick awkward shapes and the benchmark real ones. `glmctl testing tiny-checkpoint` is the
checkpoint that actually runs; this one exists so the converter can be tested without it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class SyntheticSpec:
    layers: int = 4  # KDA, MLA, KDA, MLA, ...
    hidden: int = 256
    vocab: int = 512
    kda_heads: int = 2
    kda_head_dim: int = 128
    mla_heads: int = 2
    q_lora: int = 128
    kv_lora: int = 256
    head_dim: int = 128  # qk_nope = v_head
    index_heads: int = 4
    index_head_dim: int = 128
    intermediate: int = 384
    experts: int = 4
    moe_intermediate: int = 128
    layers_per_shard: int = 2
    dtype: str = "bfloat16"


def tensor_shapes(spec: SyntheticSpec) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, dtype name)} in checkpoint order."""
    h, dt = spec.hidden, spec.dtype
    out: dict[str, tuple[tuple[int, ...], str]] = {"model.embed_tokens.weight": ((spec.vocab, h), dt)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = ((h,), dt)
        out[p + "post_attention_layernorm.weight"] = ((h,), dt)
        out[p + "hc_attn_fn"] = ((24, 4 * h), "float32")
        a = p + "self_attn."
        if i % 2 == 0:
            pr, d, nh = spec.kda_heads * spec.kda_head_dim, spec.kda_head_dim, spec.kda_heads
            for x, shape in (("q", (pr, h)), ("k", (pr, h)), ("v", (pr, h)), ("b", (nh, h)),
                             ("f_a", (d, h)), ("f_b", (pr, d)), ("g_a", (d, h)), ("g_b", (pr, d)),
                             ("o", (h, pr))):
                out[f"{a}{x}_proj.weight"] = (shape, dt)
            for x in "qkv":
                out[f"{a}{x}_conv1d.weight"] = ((pr, 1, 4), "float32")
            out[a + "A_log"] = ((nh,), "float32")
            out[a + "dt_bias"] = ((pr,), "float32")
            out[a + "o_norm.weight"] = ((d,), dt)
        else:
            nh, hd = spec.mla_heads, spec.head_dim
            out[a + "q_a_proj.weight"] = ((spec.q_lora, h), dt)
            out[a + "q_a_layernorm.weight"] = ((spec.q_lora,), dt)
            out[a + "q_b_proj.weight"] = ((nh * hd, spec.q_lora), dt)
            out[a + "kv_a_proj_with_mqa.weight"] = ((spec.kv_lora, h), dt)
            out[a + "kv_a_layernorm.weight"] = ((spec.kv_lora,), dt)
            out[a + "kv_b_proj.weight"] = ((nh * 2 * hd, spec.kv_lora), dt)
            out[a + "o_proj.weight"] = ((h, nh * hd), dt)
            ix = a + "indexer."
            out[ix + "wq_b.weight"] = ((spec.index_heads * spec.index_head_dim, spec.q_lora), dt)
            out[ix + "wk.weight"] = ((spec.index_head_dim, h), dt)
            out[ix + "k_norm.weight"] = ((spec.index_head_dim,), "float32")
            out[ix + "k_norm.bias"] = ((spec.index_head_dim,), "float32")
            out[ix + "weights_proj.weight"] = ((spec.index_heads, h), dt)
        m = p + "mlp."
        if i == 0:
            out[m + "gate_proj.weight"] = ((spec.intermediate, h), dt)
            out[m + "up_proj.weight"] = ((spec.intermediate, h), dt)
            out[m + "down_proj.weight"] = ((h, spec.intermediate), dt)
        else:
            out[m + "gate.weight"] = ((spec.experts, h), "float32")
            out[m + "gate.e_score_correction_bias"] = ((spec.experts,), "float32")
            for e in range(spec.experts):
                out[f"{m}experts.{e}.gate_proj.weight"] = ((spec.moe_intermediate, h), dt)
                out[f"{m}experts.{e}.up_proj.weight"] = ((spec.moe_intermediate, h), dt)
                out[f"{m}experts.{e}.down_proj.weight"] = ((h, spec.moe_intermediate), dt)
            for x, shape in (("gate", (spec.moe_intermediate, h)), ("up", (spec.moe_intermediate, h)),
                             ("down", (h, spec.moe_intermediate))):
                out[f"{m}shared_experts.{x}_proj.weight"] = (shape, dt)
    out["model.norm.weight"] = ((h,), dt)
    out["lm_head.weight"] = ((spec.vocab, h), dt)
    return out


def config_for(spec: SyntheticSpec) -> dict:
    return {
        "architectures": ["Glm5NextForCausalLM"], "model_type": "glm5_next", "dtype": spec.dtype,
        "hidden_size": spec.hidden, "num_hidden_layers": spec.layers, "vocab_size": spec.vocab,
        "layer_types": ["linear_attention" if i % 2 == 0 else "indexed_attention" for i in range(spec.layers)],
        "mlp_layer_types": ["dense"] + ["sparse"] * (spec.layers - 1),
        "n_routed_experts": spec.experts, "moe_intermediate_size": spec.moe_intermediate,
    }


def write_synthetic_checkpoint(path: Path, spec: SyntheticSpec = SyntheticSpec(), seed: int = 0,
                               overrides: dict | None = None) -> Path:
    """Write config.json, sharded safetensors and the index; `overrides` replaces tensors by name."""
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    shapes = tensor_shapes(spec)
    n_shards = -(-spec.layers // spec.layers_per_shard)

    def shard_of(name: str) -> int:
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) // spec.layers_per_shard
        return 0 if "embed" in name else n_shards - 1

    files = [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]
    weight_map = {}
    total = 0
    for s, fname in enumerate(files):
        tensors = {}
        for name, (shape, dtype) in shapes.items():
            if shard_of(name) != s:
                continue
            fan_in = shape[-1] if len(shape) > 1 else 1
            t = torch.randn(shape, generator=g) / fan_in**0.5 if len(shape) > 1 else 1 + 0.1 * torch.randn(shape, generator=g)
            t = (overrides or {}).get(name, t.to(getattr(torch, dtype)))
            tensors[name] = t.contiguous()
            weight_map[name] = fname
            total += t.numel() * t.element_size()
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (path / "config.json").write_text(json.dumps(config_for(spec), indent=2))
    (path / "tokenizer_config.json").write_text(json.dumps({"synthetic": asdict(spec)}))
    return path
