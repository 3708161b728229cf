"""GLM-5.3-Flash's linear modules by checkpoint name, and what vLLM 0.30 does with each in FP8.

Read from vLLM 0.30 `vllm/models/glm5next/nvidia/{model,kda,attention,mtp}.py` and
`layers/quantization/fp8.py` (the installed wheel; re-read when vLLM is upgraded). The last column
is vLLM with glmctl's plugin (`glmctl.plugin.fp8_selection`, `plugin_fate` below):

| module (checkpoint leaf)                 | stock vLLM 0.30 builds it as                     | a block-FP8 tensor there is, stock ...   | ... and with the glmctl plugin            |
|------------------------------------------|--------------------------------------------------|------------------------------------------|-------------------------------------------|
| KDA self_attn.{q,k,v}_proj               | fused `in_proj_qkvbfg_a` (+ b, f_a, g_a), quant_config=None | rejected: no `weight_scale_inv` param (KeyError) | FP8: its own [q,k,v] GEMM            |
| KDA self_attn.{b,f_a,g_a}_proj           | (same fused GEMM)                                | rejected                                 | BF16 at load: a BF16 [b,f_a,g_a] GEMM     |
| KDA self_attn.{f_b,g_b}_proj             | separate linears, quant_config=None              | rejected (same)                          | FP8                                       |
| KDA self_attn.o_proj                     | BF16 linear                                      | dequantised to BF16 at load: the MLA helper below matches any `.o_proj.` | FP8 |
| MLA self_attn.{q_a_proj,kv_a_proj_with_mqa} | fused `fused_qkv_a_proj`, BF16                | dequantised to BF16 at load (`_try_load_fp8_attn_proj`) | FP8 (both, or neither)     |
| MLA self_attn.{q_b,o}_proj               | BF16 (MLA gets quant_config=None)                | dequantised to BF16 at load              | FP8                                       |
| MLA self_attn.kv_b_proj                  | BF16                                             | rejected (not in `_FP8_ATTN_PROJS`)      | BF16 at load (see below)                  |
| indexer.wk (+ weights_proj)              | fused `wk_weights_proj`, BF16                    | wk: dequantised at load (`_try_load_fp8_indexer_wk`); weights_proj: rejected | BF16 at load, both |
| indexer.wq_b                             | BF16 (the indexer inherits MLA's None)           | rejected                                 | FP8                                       |
| mlp.{gate,up}_proj / down_proj, shared_experts | `gate_up_proj` + `down_proj` with the fp8 config | loaded as FP8 (`Fp8LinearMethod`)    | FP8 (unchanged)                           |
| mlp.experts.E.{gate,up,down}_proj        | `FusedMoE` w13 / w2 with the fp8 config          | loaded as FP8 (`Fp8MoEMethod`)           | FP8 (unchanged)                           |
| mlp.gate (router), eh_proj, embeddings, heads | GateLinear / nn.Linear / vocab embedding    | rejected                                 | rejected                                  |

So with stock vLLM 0.30 only the MLP/expert weights stay FP8 in GPU memory; MLA and indexer `wk`
and every `o_proj` shrink on disk only; the other KDA projections, `kv_b_proj`, `wq_b` and
`weights_proj` in FP8 do not load. `vllm_fate` returns that verdict per module so the converter and
`verify` can say it. With the plugin every attention module loads; `plugin_fate` says which stay
FP8. The plugin's BF16 choices: `b_proj` has one row per head, so inside one FP8 GEMM with
`f_a`/`g_a` it would shift their scale blocks; `kv_b_proj` feeds vLLM's BF16 `W_UK_T`/`W_UV`
(MLA has no FP8 batched matmul), which alias a BF16 weight but would copy an FP8 one (3 bytes
per weight instead of 2); `wk`/`weights_proj` are ~1 MiB per layer, read in fp32 by the indexer.

The fused GEMMs matter for block scales: vLLM rounds each shard's scale offset up to a block
(`adjust_block_scale_shard`) while the kernels index scales by row // B, so only the last shard of
a fused GEMM may end in a partial block, and all shards of a fused layer must share one precision.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

Fate = Literal["fp8", "bf16_at_load", "rejected", "unknown"]

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

# Fused GEMMs: (family, fused leaf, members in fused order). Leaves are relative to the layer.
FUSED_GROUPS: list[tuple[str, str, tuple[str, ...]]] = [
    ("kda", "self_attn.in_proj_qkvbfg_a", tuple(f"self_attn.{x}_proj" for x in ("q", "k", "v", "b", "f_a", "g_a"))),
    ("mla", "self_attn.fused_qkv_a_proj", ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa")),
    ("mla", "self_attn.indexer.wk_weights_proj", ("self_attn.indexer.wk", "self_attn.indexer.weights_proj")),
    ("mlp", "mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
    ("mlp", "mlp.shared_experts.gate_up_proj", ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj")),
]
# The plugin splits KDA's fused GEMM in two (glmctl.plugin.fp8_linear.KdaInputProjections).
PLUGIN_FUSED_GROUPS: list[tuple[str, str, tuple[str, ...]]] = [
    ("kda", "self_attn.in_proj_qkvbfg_a.qkv", tuple(f"self_attn.{x}_proj" for x in ("q", "k", "v"))),
    ("kda", "self_attn.in_proj_qkvbfg_a.bfg_a", tuple(f"self_attn.{x}_proj" for x in ("b", "f_a", "g_a"))),
    *(g for g in FUSED_GROUPS if g[0] != "kda"),
]
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)$")
_LAYER = re.compile(r"^(?P<prefix>.*?)layers\.(?P<idx>\d+)\.(?P<leaf>.+)$")

_KDA_LEAVES = {f"self_attn.{x}_proj" for x in ("q", "k", "v", "b", "f_a", "f_b", "g_a", "g_b", "o")}
_MLA_AT_LOAD = {"self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.q_b_proj",
                "self_attn.o_proj", "self_attn.indexer.wk"}
_MLA_REJECTED = {"self_attn.kv_b_proj", "self_attn.indexer.wq_b", "self_attn.indexer.weights_proj"}
_MLP_FP8 = {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp.shared_experts.gate_proj",
            "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj"}


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
    leaf = site.leaf
    if leaf in _MLP_FP8 or _EXPERT.match(leaf):
        return "fp8"
    if leaf == "self_attn.o_proj" and site.kind != "unknown":
        return "bf16_at_load"  # `_try_load_fp8_attn_proj` matches ".o_proj." in KDA layers too
    if site.kind == "kda" and leaf in _KDA_LEAVES:
        return "rejected"
    if site.kind == "mla" and leaf in _MLA_AT_LOAD:
        return "bf16_at_load"
    if site.kind == "mla" and leaf in _MLA_REJECTED:
        return "rejected"
    return "rejected" if leaf in ("eh_proj", "mlp.gate") or leaf.startswith("shared_head") else "unknown"


_PLUGIN_BF16 = {"self_attn.b_proj", "self_attn.f_a_proj", "self_attn.g_a_proj", "self_attn.kv_b_proj",
                "self_attn.indexer.wk", "self_attn.indexer.weights_proj"}


def plugin_fate(module: str, kinds: LayerKinds) -> Fate:
    """What vLLM 0.30 with glmctl's plugin does with a block-FP8 `module.weight` of GLM-5.3-Flash
    (alignment permitting: a unit whose rows per rank are not whole blocks is loaded as BF16)."""
    stock = vllm_fate(module, kinds)
    site = kinds.site(module)
    if stock in ("fp8", "unknown") or site is None or site.kind == "unknown":
        return stock
    if site.kind == "kda" and site.leaf in _KDA_LEAVES or site.kind == "mla" and (
            site.leaf in _MLA_AT_LOAD or site.leaf in _MLA_REJECTED):
        return "bf16_at_load" if site.leaf in _PLUGIN_BF16 else "fp8"
    return stock


def fused_group_of(module: str, kinds: LayerKinds) -> tuple[str, str, list[str]] | None:
    """(family, fused module name, member module names in order) for a fused GEMM member."""
    site = kinds.site(module)
    if site is None:
        return None
    expert = _EXPERT.match(site.leaf)
    if expert and expert[2] != "down_proj":
        # FusedMoE's w13: one [2I, H] GEMM per expert, gate rows first.
        e = expert[1]
        return ("expert", site.name(f"mlp.experts.{e}.gate_up"),
                [site.name(f"mlp.experts.{e}.gate_proj"), site.name(f"mlp.experts.{e}.up_proj")])
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
