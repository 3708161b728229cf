"""GLM-5.3-Flash's linear modules by checkpoint name, the GEMMs vLLM 0.30 fuses them into, and what
becomes of each in block FP8: the one description the converter, the plugin and the tiny test
checkpoints read (torch-free).

`PROJECTIONS` is read from vLLM 0.30 `vllm/models/glm5next/nvidia/{model,kda,attention,mtp}.py` and
`layers/quantization/fp8.py` (the installed wheel; re-read when vLLM is upgraded). Per module it
says which GEMM stock vLLM builds it into (`gemm`), which GEMM glmctl's plugin builds it into
(`plugin_gemm`, `glmctl.plugin.quantization.fp8_attention`), and what a block-FP8 weight becomes with each
(`stock`, `plugin`). The mixers and heads outside the table (`mlp.gate` router, `eh_proj`,
embeddings, heads) are built without the fp8 method and never load in FP8.

So with stock vLLM 0.30 only the MLP/expert weights stay FP8 in GPU memory; MLA and indexer `wk`
and every `o_proj` shrink on disk only; the other KDA projections, `kv_b_proj`, `wq_b` and
`weights_proj` in FP8 do not load. `vllm_fate` returns that verdict per module so the converter and
`verify` can say it. With the plugin every attention module loads; `plugin_fate` says which stay
FP8 (alignment permitting: a unit whose rows per rank are not whole blocks is loaded as BF16).

Why the plugin keeps some FP8 weights in BF16:
- `b_proj` has one row per head (64, or 8 per rank at TP 8): inside a fused FP8 GEMM it would end
  in a partial 128-row block and shift the scale blocks of `f_a`/`g_a` behind it. So vLLM's fused
  `in_proj_qkvbfg_a` becomes two GEMMs (`.qkv` in FP8, `.bfg_a` in BF16) and the layer
  concatenates them back in vLLM's order.
- `kv_b_proj`: vLLM's `MLAAttention` absorbs it into BF16 `W_UK_T`/`W_UV` after loading (it has no
  FP8 batched matmul). Those alias a BF16 `kv_b_proj` weight but are a separate copy of an FP8 one,
  so FP8 would hold 3 bytes per weight instead of 2.
- `indexer.wk` is fused with `weights_proj`, whose weights the indexer reads in fp32 straight from
  the fused parameter; both are replicated 128 + 32 rows (about 1 MiB per layer).

The fused GEMMs matter for block scales: vLLM rounds each shard's scale offset up to a block
(`adjust_block_scale_shard`) while the kernels index scales by row // B, so only the last shard of
a fused GEMM may end in a partial block, and all shards of a fused layer must share one precision.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

Fate = Literal["fp8", "bf16_at_load", "rejected", "unknown"]
Family = Literal["kda", "mla", "mlp"]

FATE_SHORT: dict[str, str] = {
    "fp8": "FP8", "bf16_at_load": "BF16 at load", "rejected": "needs plugin", "unknown": "?",
}
PLUGIN_FATE_SHORT: dict[str, str] = {**FATE_SHORT, "rejected": "not loadable"}
PLUGIN_FATE_TEXT: dict[str, str] = {
    "fp8": "kept in FP8 in GPU memory with the glmctl plugin",
    "bf16_at_load": "loaded with the glmctl plugin, dequantised exactly to BF16 at load",
    "rejected": "not loadable by vLLM 0.30, with or without the glmctl plugin",
    "unknown": "not a GLM-5.3-Flash module glmctl knows",
}
FATE_TEXT: dict[str, str] = {
    "fp8": "kept in FP8 by vLLM 0.30",
    "bf16_at_load": "dequantised to BF16 at load by vLLM 0.30 (smaller on disk only)",
    "rejected": "not loadable by stock vLLM 0.30 (needs the glmctl plugin)",
    "unknown": "not a GLM-5.3-Flash module glmctl knows",
}


# The dimensions a projection's shape is given in: config.json fields, and these products of them.
DERIVED_DIMS: dict[str, Callable[[Mapping[str, int]], int]] = {
    "kda_width": lambda c: c["linear_num_heads"] * c["linear_head_dim"],
    "mla_q_width": lambda c: c["num_attention_heads"] * (c["qk_nope_head_dim"] + (c.get("qk_rope_head_dim") or 0)),
    "mla_kv_a_rows": lambda c: c["kv_lora_rank"] + (c.get("qk_rope_head_dim") or 0),
    "mla_kv_b_rows": lambda c: c["num_attention_heads"] * (c["qk_nope_head_dim"] + c["v_head_dim"]),
    "mla_v_width": lambda c: c["num_attention_heads"] * c["v_head_dim"],
    "index_q_width": lambda c: c["index_n_heads"] * c["index_head_dim"],
    "shared_intermediate": lambda c: c["moe_intermediate_size"] * c["n_shared_experts"],
}


@dataclass(frozen=True)
class Projection:
    """One linear module of a decoder layer; `leaf` and the GEMM names are relative to the layer."""

    family: Family  # the layer kind it lives in ("mlp": the dense MLP and the shared experts)
    leaf: str  # checkpoint module: "self_attn.q_proj"
    stock: Fate  # a block-FP8 weight with stock vLLM 0.30
    plugin: Fate  # ... and with glmctl's plugin
    dims: tuple[str, str]  # (out_features, in_features): config fields or DERIVED_DIMS
    fused: str = ""  # the fused GEMM stock vLLM builds it into ("": its own GEMM)
    plugin_fused: str = ""  # the GEMM the plugin builds it into ("": as stock vLLM)

    @property
    def gemm(self) -> str:
        return self.fused or self.leaf

    @property
    def plugin_gemm(self) -> str:
        return self.plugin_fused or self.gemm

    def shape(self, config: Mapping[str, int]) -> tuple[int, int]:
        """(out_features, in_features) of the weight for a config.json (text config) mapping."""
        out_dim, in_dim = (DERIVED_DIMS[d](config) if d in DERIVED_DIMS else config[d] for d in self.dims)
        return out_dim, in_dim


_KDA_IN = "self_attn.in_proj_qkvbfg_a"
_MLA_QKV_A = "self_attn.fused_qkv_a_proj"
_WK = "self_attn.indexer.wk_weights_proj"
_H = "hidden_size"

# In checkpoint order. Stock vLLM builds every KDA projection with quant_config=None: an FP8 one
# has no `weight_scale_inv` parameter to load into (KeyError), except o_proj, which the MLA helper
# `_try_load_fp8_attn_proj` dequantises (it matches any ".o_proj."). MLA gets quant_config=None
# too; `_try_load_fp8_attn_proj` / `_try_load_fp8_indexer_wk` dequantise the projections in
# `_FP8_ATTN_PROJS` and the indexer's wk, the rest is refused. The MLP is built with the fp8 config.
PROJECTIONS: tuple[Projection, ...] = (
    Projection("kda", "self_attn.q_proj", "rejected", "fp8", ("kda_width", _H), _KDA_IN, _KDA_IN + ".qkv"),
    Projection("kda", "self_attn.k_proj", "rejected", "fp8", ("kda_width", _H), _KDA_IN, _KDA_IN + ".qkv"),
    Projection("kda", "self_attn.v_proj", "rejected", "fp8", ("kda_width", _H), _KDA_IN, _KDA_IN + ".qkv"),
    Projection("kda", "self_attn.b_proj", "rejected", "bf16_at_load", ("linear_num_heads", _H), _KDA_IN, _KDA_IN + ".bfg_a"),
    Projection("kda", "self_attn.f_a_proj", "rejected", "bf16_at_load", ("linear_head_dim", _H), _KDA_IN, _KDA_IN + ".bfg_a"),
    Projection("kda", "self_attn.f_b_proj", "rejected", "fp8", ("kda_width", "linear_head_dim")),
    Projection("kda", "self_attn.g_a_proj", "rejected", "bf16_at_load", ("linear_head_dim", _H), _KDA_IN, _KDA_IN + ".bfg_a"),
    Projection("kda", "self_attn.g_b_proj", "rejected", "fp8", ("kda_width", "linear_head_dim")),
    Projection("kda", "self_attn.o_proj", "bf16_at_load", "fp8", (_H, "kda_width")),
    Projection("mla", "self_attn.q_a_proj", "bf16_at_load", "fp8", ("q_lora_rank", _H), _MLA_QKV_A),
    Projection("mla", "self_attn.q_b_proj", "bf16_at_load", "fp8", ("mla_q_width", "q_lora_rank")),
    Projection("mla", "self_attn.kv_a_proj_with_mqa", "bf16_at_load", "fp8", ("mla_kv_a_rows", _H), _MLA_QKV_A),
    Projection("mla", "self_attn.kv_b_proj", "rejected", "bf16_at_load", ("mla_kv_b_rows", "kv_lora_rank")),
    Projection("mla", "self_attn.o_proj", "bf16_at_load", "fp8", (_H, "mla_v_width")),
    Projection("mla", "self_attn.indexer.wq_b", "rejected", "fp8", ("index_q_width", "q_lora_rank")),
    Projection("mla", "self_attn.indexer.wk", "bf16_at_load", "bf16_at_load", ("index_head_dim", _H), _WK),
    Projection("mla", "self_attn.indexer.weights_proj", "rejected", "bf16_at_load", ("index_n_heads", _H), _WK),
    Projection("mlp", "mlp.gate_proj", "fp8", "fp8", ("intermediate_size", _H), "mlp.gate_up_proj"),
    Projection("mlp", "mlp.up_proj", "fp8", "fp8", ("intermediate_size", _H), "mlp.gate_up_proj"),
    Projection("mlp", "mlp.down_proj", "fp8", "fp8", (_H, "intermediate_size")),
    Projection("mlp", "mlp.shared_experts.gate_proj", "fp8", "fp8", ("shared_intermediate", _H), "mlp.shared_experts.gate_up_proj"),
    Projection("mlp", "mlp.shared_experts.up_proj", "fp8", "fp8", ("shared_intermediate", _H), "mlp.shared_experts.gate_up_proj"),
    Projection("mlp", "mlp.shared_experts.down_proj", "fp8", "fp8", (_H, "shared_intermediate")),
)
# A routed expert's projections, relative to `mlp.experts.E`: vLLM's FusedMoE loads them with the
# fp8 config as one [2I, H] GEMM per expert (w13, gate rows first) and w2.
EXPERT_PROJECTIONS: tuple[Projection, ...] = (
    Projection("mlp", "gate_proj", "fp8", "fp8", ("moe_intermediate_size", _H), "gate_up"),
    Projection("mlp", "up_proj", "fp8", "fp8", ("moe_intermediate_size", _H), "gate_up"),
    Projection("mlp", "down_proj", "fp8", "fp8", (_H, "moe_intermediate_size")),
)


def projections(family: Family, under: str = "") -> tuple[Projection, ...]:
    """The rows of one layer kind whose leaf starts with `under` ("self_attn.indexer.")."""
    return tuple(p for p in PROJECTIONS if p.family == family and p.leaf.startswith(under))


def _fused_groups(gemm_of: Callable[[Projection], str]) -> list[tuple[str, str, tuple[str, ...]]]:
    groups: dict[tuple[str, str], list[str]] = {}
    for p in PROJECTIONS:
        groups.setdefault((p.family, gemm_of(p)), []).append(p.leaf)
    return [(family, gemm, tuple(members)) for (family, gemm), members in groups.items() if len(members) > 1]


# Fused GEMMs: (family, fused leaf, members in fused order), as stock vLLM and as the plugin builds them.
FUSED_GROUPS: list[tuple[str, str, tuple[str, ...]]] = _fused_groups(lambda p: p.gemm)
PLUGIN_FUSED_GROUPS: list[tuple[str, str, tuple[str, ...]]] = _fused_groups(lambda p: p.plugin_gemm)
_BY_LEAF = {(p.family, p.leaf): p for p in PROJECTIONS}
_EXPERT_BY_LEAF = {p.leaf: p for p in EXPERT_PROJECTIONS}
_EXPERT = re.compile(rf"^mlp\.experts\.(\d+)\.({'|'.join(_EXPERT_BY_LEAF)})$")
_LAYER = re.compile(r"^(?P<prefix>.*?)layers\.(?P<idx>\d+)\.(?P<leaf>.+)$")


@dataclass(frozen=True)
class ModuleSite:
    """Where a module sits: `prefix` ("model." or "model.language_model."), layer, leaf path."""

    prefix: str
    layer: int
    leaf: str
    kind: Literal["kda", "mla", "unknown"]

    def name(self, leaf: str) -> str:
        return f"{self.prefix}layers.{self.layer}.{leaf}"


class LayerKinds:
    """KDA or MLA per decoder layer, from config.json (`layer_types`, `num_hidden_layers`)."""

    def __init__(self, text_config: dict) -> None:
        self.layer_types = text_config.get("layer_types") or []
        self.num_hidden_layers = int(text_config.get("num_hidden_layers") or len(self.layer_types))
        self.is_glm5next = "glm5_next" in str(text_config.get("model_type", "")) or any(
            "Glm5Next" in a for a in text_config.get("architectures") or [])

    def kind(self, layer: int) -> Literal["kda", "mla", "unknown"]:
        if not self.layer_types:
            return "unknown"
        if layer >= self.num_hidden_layers:
            return "mla"  # MTP layers are MLA(+indexer) decoder layers
        if layer < len(self.layer_types):
            return "kda" if self.layer_types[layer] == "linear_attention" else "mla"
        return "unknown"

    def site(self, module: str) -> ModuleSite | None:
        m = _LAYER.match(module)
        if m is None or "visual" in m["prefix"]:
            return None
        layer = int(m["idx"])
        return ModuleSite(m["prefix"], layer, m["leaf"], self.kind(layer))


def vllm_fate(module: str, kinds: LayerKinds) -> Fate:
    """What stock vLLM 0.30 does with a block-FP8 `module.weight` of GLM-5.3-Flash."""
    if not kinds.is_glm5next:
        return "unknown"
    site = kinds.site(module)
    if site is None:
        return "rejected"  # embeddings, heads, vision tower: built without the fp8 method
    row = _projection_at(site)
    if row is not None:
        return row.stock
    leaf = site.leaf
    return "rejected" if leaf in ("eh_proj", "mlp.gate") or leaf.startswith("shared_head") else "unknown"


def plugin_fate(module: str, kinds: LayerKinds) -> Fate:
    """What vLLM 0.30 with glmctl's plugin does with a block-FP8 `module.weight` of GLM-5.3-Flash
    (alignment permitting: a unit whose rows per rank are not whole blocks is loaded as BF16)."""
    stock = vllm_fate(module, kinds)
    site = kinds.site(module)
    if stock in ("fp8", "unknown") or site is None:
        return stock
    row = _projection_at(site)
    return stock if row is None else row.plugin


def _projection_at(site: ModuleSite) -> Projection | None:
    """The table row of a module: MLP rows in any layer, attention rows in their layer kind."""
    expert = _EXPERT.match(site.leaf)
    if expert:
        return _EXPERT_BY_LEAF[expert[2]]
    found = _BY_LEAF.get(("mlp", site.leaf))
    if found is None and site.kind != "unknown":
        found = _BY_LEAF.get((site.kind, site.leaf))
    return found


def fused_group_of(module: str, kinds: LayerKinds) -> tuple[str, str, list[str]] | None:
    """(family, fused module name, member module names in order) for a fused GEMM member."""
    site = kinds.site(module)
    if site is None:
        return None
    expert = _EXPERT.match(site.leaf)
    if expert:
        row, e = _EXPERT_BY_LEAF[expert[2]], f"mlp.experts.{expert[1]}."
        members = [p.leaf for p in EXPERT_PROJECTIONS if p.gemm == row.gemm]
        if len(members) < 2:
            return None
        return "expert", site.name(e + row.gemm), [site.name(e + m) for m in members]
    for family, fused, members in FUSED_GROUPS:
        if site.leaf in members and (family != "kda" or site.kind == "kda"):
            return family, site.name(fused), [site.name(m) for m in members]
    return None


def experts_module(module: str, kinds: LayerKinds) -> str | None:
    """`model.layers.L.mlp.experts` for a routed-expert projection (vLLM's FusedMoE prefix)."""
    site = kinds.site(module)
    if site is None or not _EXPERT.match(site.leaf):
        return None
    return site.name("mlp.experts")
