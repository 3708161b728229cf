"""What the planner needs to know about a GLM-5.3-Flash-architecture model (`ModelSpec`).

A model comes from a checkpoint directory, a `config.json`, or a built-in preset (`presets.py`). Both
config schemas vLLM 0.30 and transformers 5.24 read are accepted: the flat `glm5_next` /
`glm5_next_text` form and the multimodal form with a nested `text_config`. A field the file leaves
out takes the transformers default (the `glm-5.3-flash` preset) and is listed in `defaulted`, so a
plan never silently rests on a guess.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from glmctl.errors import ConfigError
from glmctl.plan.presets import GLM53_FLASH, PRESET_CHECKPOINT_QUANT, PRESETS

SUPPORTED_MODEL_TYPES = ("glm5_next", "glm5_next_text")
INDEXED = "indexed_attention"
LINEAR = "linear_attention"
# Spellings of an MLA (DSA) layer in the schemas we read, normalised to INDEXED.
_INDEXED_ALIASES = {INDEXED, "full_attention", "deepseek_sparse_attention", "attention"}


class ModelSpec(BaseModel):
    """Architecture numbers of one GLM-5.3-Flash-family model (text model plus its MTP layers)."""

    model_config = ConfigDict(frozen=True)

    name: str
    source: str
    model_type: str
    dtype: str = "bfloat16"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    layer_types: list[str]
    mlp_layer_types: list[str]
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_topk: int | None
    index_head_dim: int
    index_n_heads: int
    index_kpool: int
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    hc_mult: int  # mHC residual streams; 0 when mHC is off
    num_nextn_predict_layers: int
    tie_word_embeddings: bool = False
    max_position_embeddings: int
    checkpoint_quant: str = "bf16"  # how the checkpoint stores the quantizable groups
    # Attention families ("kda", "mla") whose projections the checkpoint stores in block FP8
    # (`glmctl quantize fp8`'s default); glmctl's plugin keeps them FP8 in GPU memory.
    fp8_attention: list[str] = []
    has_vision: bool = False  # a vision tower in the checkpoint (not planned: text serving only)
    defaulted: list[str] = []

    @property
    def mla_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == INDEXED]

    @property
    def kda_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    @property
    def dense_mlp_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.mlp_layer_types) if t != "sparse"]

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.mlp_layer_types) if t == "sparse"]

    @property
    def has_indexer(self) -> bool:
        return self.index_topk is not None

    @property
    def mla_head_size(self) -> int:
        """The latent stored per token by an MLA layer: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def load_model_spec(source: str | Path) -> ModelSpec:
    """A preset name, a checkpoint directory, or a config.json path -> ModelSpec."""
    text = str(source)
    if text in PRESETS:
        return _from_config(PRESETS[text], name=text, source=f"preset {text} (transformers 5.24 defaults)",
                            checkpoint_quant=PRESET_CHECKPOINT_QUANT[text])
    path = Path(text).expanduser()
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.is_file():
        raise ConfigError(
            f"no model at '{text}': not a preset, a checkpoint directory or a config.json",
            hint=f"use a checkpoint directory, a config.json, or one of: {', '.join(PRESETS)}",
        )
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {config_path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ConfigError(f"{config_path} is not a model config (a JSON object), it is a {type(config).__name__}")
    name = config_path.parent.name if config_path.name == "config.json" else config_path.stem
    try:
        spec = _from_config(config, name=name, source=str(config_path),
                            checkpoint_quant=_checkpoint_quant(config))
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ConfigError(f"{config_path}: {'.'.join(map(str, first['loc']))} = {first.get('input')!r}: "
                          f"{first['msg']}", hint="a GLM-5.3-Flash config.json (model_type glm5_next)") from exc
    except (TypeError, ValueError, AttributeError, KeyError) as exc:  # a field of the wrong shape
        raise ConfigError(f"{config_path} is not a GLM-5.3-Flash config the planner can read "
                          f"({type(exc).__name__}: {exc})", hint="a GLM-5.3-Flash config.json (model_type glm5_next)") from exc
    _check_sizes(spec, str(config_path))
    if spec.checkpoint_quant != "bf16":
        spec = spec.model_copy(update={"fp8_attention": _fp8_attention(spec, config_path.parent, config)})
    return spec


# Sizes a model cannot have zero of; the rest (RoPE dims, shared experts, mHC streams, MTP layers) may be 0.
_POSITIVE = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
             "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
             "index_head_dim", "index_n_heads", "index_kpool", "linear_num_heads", "linear_head_dim",
             "linear_conv_kernel_dim", "n_routed_experts", "num_experts_per_tok", "max_position_embeddings")
_NON_NEGATIVE = ("qk_rope_head_dim", "n_shared_experts", "hc_mult", "num_nextn_predict_layers")


def _check_sizes(spec: ModelSpec, source: str) -> None:
    bad = [f"{k} = {getattr(spec, k)}" for k in _POSITIVE if getattr(spec, k) < 1]
    bad += [f"{k} = {getattr(spec, k)}" for k in _NON_NEGATIVE if getattr(spec, k) < 0]
    if spec.index_topk is not None and spec.index_topk < 1:
        bad.append(f"index_topk = {spec.index_topk}")
    if spec.num_experts_per_tok > spec.n_routed_experts:
        bad.append(f"num_experts_per_tok {spec.num_experts_per_tok} > n_routed_experts {spec.n_routed_experts}")
    if bad:
        raise ConfigError(f"{source}: impossible sizes: {', '.join(bad)}",
                          hint="a GLM-5.3-Flash config.json (model_type glm5_next)")


# One projection that only each family has, as `glmctl quantize fp8` names its scales.
_FP8_ATTENTION_MARKERS = {"kda": "self_attn.q_proj.weight_scale_inv",
                          "mla": "self_attn.q_b_proj.weight_scale_inv"}


def _fp8_attention(spec: ModelSpec, checkpoint: Path, config: dict) -> list[str]:
    """Which attention families glmctl's plugin builds in block FP8 for this checkpoint, by the
    plugin's own rule (`glmctl.plugin.quantization.fp8_selection.select`): the families whose projections hold
    block-FP8 scales, from the checkpoint's tensor names (its index, else its shard headers). When
    no names can be read (a directory holding only config.json, as `glmctl testing rank-config`
    writes for `--load-format dummy`), the plugin goes by the quantization config instead: a block-FP8
    config makes every family FP8 whose projections `modules_to_not_convert` does not name."""
    from glmctl.quantize.safetensors_io import checkpoint_tensor_names

    names = checkpoint_tensor_names(checkpoint)
    if names is not None:
        return [family for family, marker in _FP8_ATTENTION_MARKERS.items()
                if any(n.endswith(marker) for n in names)]
    from glmctl.plugin.quantization.fp8_selection import site

    block = _block_fp8_config(config)
    if block is None:
        return []
    ignored = {s for s in map(site, block.ignored) if s is not None}
    layers = {"kda": spec.kda_layers, "mla": spec.mla_layers}
    leaf = {family: marker.removeprefix("self_attn.").removesuffix(".weight_scale_inv")
            for family, marker in _FP8_ATTENTION_MARKERS.items()}
    return [family for family in _FP8_ATTENTION_MARKERS
            if any((layer, leaf[family]) not in ignored for layer in layers[family])]


def _block_fp8_config(config: dict):
    """The block-FP8 part of a checkpoint's quantization config, as vLLM's Fp8Config reads it (the
    config itself, or glmctl_exl3's `non_experts`); None when there is none."""
    from glmctl.plugin.quantization.fp8_selection import block_fp8_of

    quant = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config") or {}
    if str(quant.get("quant_method", "")).lower() != "fp8":
        quant = quant.get("non_experts") or {}
    method = str(quant.get("quant_method", "")).lower()
    if method != "fp8":
        return None
    return block_fp8_of(quant.get("weight_block_size"), "fp8" in method, quant.get("activation_scheme", "dynamic"),
                        quant.get("modules_to_not_convert") or quant.get("ignored_layers"))


def _checkpoint_quant(config: dict) -> str:
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not quant:
        return "bf16"
    method = str(quant.get("quant_method", "")).lower()
    if method == "fp8":
        return "fp8"
    if method == "exl3":  # exllamav3's own converter
        return f"exl3:{quant.get('bits', 4)}"
    from glmctl.quantize.exl3_format import QUANT_METHOD, Exl3ExpertsSpec

    if method == QUANT_METHOD:  # `glmctl quantize exl3`: EXL3 routed experts, the rest as the source had it
        return f"exl3:{Exl3ExpertsSpec.from_config(quant).bits}"
    raise ConfigError(
        f"checkpoint quantization '{method}' is not one glmctl plans for (bf16, fp8, exl3, glmctl_exl3)",
        hint="pass the weight formats explicitly (--experts, --dense, --kda, --mla, --embeddings)",
    )


def _from_config(raw: dict, *, name: str, source: str, checkpoint_quant: str) -> ModelSpec:
    top_type = raw.get("model_type")
    config = {**raw, **(raw.get("text_config") or {})} if isinstance(raw.get("text_config"), dict) else dict(raw)
    model_type = top_type or config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{source}: model_type '{model_type}' is not GLM-5.3-Flash's (glm5_next)",
            hint="glmctl plans GLM-5.3-Flash-architecture models only",
        )
    _fold_aliases(config)
    defaulted: list[str] = []

    def get(key: str):
        if config.get(key) is None:
            defaulted.append(key)
            return GLM53_FLASH[key]
        return config[key]

    layers = int(get("num_hidden_layers"))
    layer_types = config.get("layer_types")
    if layer_types is None:
        defaulted.append("layer_types")
        layer_types = [INDEXED if i % 4 == 3 else LINEAR for i in range(layers)]  # transformers' rule
    layer_types = [INDEXED if t in _INDEXED_ALIASES else t for t in layer_types]
    mlp_types = config.get("mlp_layer_types")
    if mlp_types is None:
        dense = config.get("first_k_dense_replace")
        if dense is None:
            defaulted.append("mlp_layer_types")
            dense = 3  # transformers' rule
        mlp_types = ["dense"] * min(dense, layers) + ["sparse"] * max(layers - dense, 0)
    if len(layer_types) != layers or len(mlp_types) != layers:
        raise ConfigError(f"{source}: layer_types/mlp_layer_types must list {layers} layers")
    unknown = sorted(set(layer_types) - {INDEXED, LINEAR})
    if unknown:
        raise ConfigError(f"{source}: unknown layer types {unknown}")

    mhc = config.get("mhc", True)
    has_indexer = "index_topk" not in config or config["index_topk"] is not None
    spec = ModelSpec(
        name=name,
        source=source,
        model_type=model_type,
        dtype=str(config.get("dtype") or config.get("torch_dtype") or "bfloat16"),
        vocab_size=get("vocab_size"),
        hidden_size=get("hidden_size"),
        intermediate_size=get("intermediate_size"),
        moe_intermediate_size=get("moe_intermediate_size"),
        num_hidden_layers=layers,
        layer_types=layer_types,
        mlp_layer_types=mlp_types,
        num_attention_heads=get("num_attention_heads"),
        q_lora_rank=get("q_lora_rank"),
        kv_lora_rank=get("kv_lora_rank"),
        qk_nope_head_dim=get("qk_nope_head_dim"),
        qk_rope_head_dim=config.get("qk_rope_head_dim") or 0,
        v_head_dim=get("v_head_dim"),
        index_topk=get("index_topk") if has_indexer else None,
        index_head_dim=get("index_head_dim"),
        index_n_heads=get("index_n_heads"),
        index_kpool=get("index_kpool"),
        linear_num_heads=get("linear_num_heads"),
        linear_head_dim=get("linear_head_dim"),
        linear_conv_kernel_dim=get("linear_conv_kernel_dim"),
        n_routed_experts=get("n_routed_experts"),
        n_shared_experts=config.get("n_shared_experts") or 0,
        num_experts_per_tok=get("num_experts_per_tok"),
        hc_mult=int(get("hc_mult")) if mhc else 0,
        num_nextn_predict_layers=int(get("num_nextn_predict_layers")),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_position_embeddings=get("max_position_embeddings"),
        checkpoint_quant=checkpoint_quant,
        has_vision=isinstance(raw.get("vision_config"), dict),
        defaulted=sorted(set(defaulted)),
    )
    if spec.has_indexer and spec.index_kpool > 1 and spec.index_topk % spec.index_kpool:
        raise ConfigError(f"{source}: index_topk ({spec.index_topk}) must be a multiple of index_kpool")
    return spec


def _fold_aliases(config: dict) -> None:
    """Map the alternative field names of the two schemas onto transformers' names."""
    for alias, key in (("num_experts_per_token", "num_experts_per_tok"),
                       ("mhc_num_residual_streams", "hc_mult")):
        if config.get(key) is None and config.get(alias) is not None:
            config[key] = config[alias]
    linear = config.get("linear_attn_config") or {}
    for alias, key in (("head_dim", "linear_head_dim"), ("num_heads", "linear_num_heads"),
                       ("short_conv_kernel_size", "linear_conv_kernel_dim")):
        if config.get(key) is None and linear.get(alias) is not None:
            config[key] = linear[alias]
