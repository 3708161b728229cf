"""Which tensors of a checkpoint become block-FP8, and the `quantization_config` that describes them.

Selection: `--modules` globs (fnmatch, `*` crosses dots) match *module* names, i.e. tensor names
without the trailing `.weight`; `--exclude` globs remove matches. A selected tensor is converted
when it is a 2-D bf16/fp16/fp32 `.weight`; everything else passes through byte for byte:

- tensors that are already FP8 (and their `weight_scale_inv`) are copied unchanged;
- never converted: norms, biases, the MoE router (`mlp.gate`), KDA `*_conv1d`, `A_log`, `dt_bias`,
  the mHC mixers and every tensor that is not a 2-D `.weight`; embeddings and LM heads only with
  `--embeddings` (vLLM 0.30 cannot load them in FP8; transformers can).

Default selection (`DEFAULT_MODULES`): the attention projections of both layer kinds, what step 7
of the report converted: KDA `q,k,v,o`, MLA `q_a,q_b,kv_a_proj_with_mqa,kv_b,o` and the indexer's
`wq_b, wk`. Left out by default, with reasons: KDA `f_a,f_b,g_a,g_b` (the low-rank forget and output
gates: the forget gate is exponentiated into the decay, so its error compounds over long contexts,
for ~2% of KDA weights) and `b_proj` / indexer `weights_proj` (one row per head, 64 / 32 rows:
under one 128-row block; `b_proj` would also put a partial block mid-way through vLLM's fused
`in_proj_qkvbfg_a`). `--modules` selects any of them.

Refused, with the reason (nothing is written): a selected matrix whose input dim K is not a multiple
of the block (vLLM's glm5next loader derives the block width as K // scale columns, so a partial K
block is dequantised on the wrong grid); half of a fused GEMM that vLLM 0.30 loads in FP8 (dense or
shared-expert gate/up, an expert's gate/up, some experts of a layer but not all); a member other
than the last of such a GEMM whose N is not a multiple of the block. Partial blocks at the bottom
edge (N not a multiple) are otherwise fine: vLLM allocates ceil(N/B) scale rows and so do we.
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from glmctl.quantize.checkpoint import Checkpoint
from glmctl.quantize.fp8 import scale_shape
from glmctl.quantize.glm5next import (
    FATE_TEXT,
    LayerKinds,
    experts_module,
    fused_group_of,
    plugin_fate,
    vllm_fate,
)
from glmctl.quantize.safetensors_io import FLOAT_DTYPES, PlannedTensor, ShardHeader, TensorEntry

from glmctl.errors import UsageError

DEFAULT_MODULES: tuple[str, ...] = (
    # KDA (linear-attention layers)
    "*.self_attn.q_proj", "*.self_attn.k_proj", "*.self_attn.v_proj", "*.self_attn.o_proj",
    # MLA (indexed-attention layers) and their lightning indexer
    "*.self_attn.q_a_proj", "*.self_attn.q_b_proj", "*.self_attn.kv_a_proj_with_mqa",
    "*.self_attn.kv_b_proj", "*.self_attn.indexer.wq_b", "*.self_attn.indexer.wk",
)
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
_NEVER = ("norm", "conv1d", "A_log", "dt_bias", "hc_", "bias")  # substrings of the last name part
_EMBEDDINGS = ("embed_tokens", "lm_head", "shared_head.head", "wte", "word_embeddings")

Action = Literal["quantize", "keep_fp8", "copy"]


@dataclass(frozen=True)
class Fp8Settings:
    block: int = 128
    modules: tuple[str, ...] = DEFAULT_MODULES
    exclude: tuple[str, ...] = ()
    embeddings: bool = False

    def as_dict(self) -> dict:
        return {"block": self.block, "modules": list(self.modules), "exclude": list(self.exclude),
                "embeddings": self.embeddings}


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shard: str
    action: Action
    role: str  # "kda self_attn.q_proj", "expert mlp.experts.*.down_proj", ...
    fate: str  # glm5next.Fate of the module in FP8 ("" when it stays as it is)
    bytes_in: int
    bytes_out: int  # weight + scale for quantized tensors
    plugin_fate: str = ""  # glm5next.Fate with glmctl's plugin ("" when it stays as it is)


@dataclass
class Fp8Plan:
    settings: Fp8Settings
    tensors: dict[str, TensorPlan]
    layouts: dict[str, list[PlannedTensor]]  # output shard -> tensors in write order
    quantization_config: dict
    notes: list[str] = field(default_factory=list)

    @property
    def quantized(self) -> list[TensorPlan]:
        return [t for t in self.tensors.values() if t.action == "quantize"]

    def bytes_out(self, shards: set[str] | None = None) -> int:
        return sum(t.nbytes for s, layout in self.layouts.items() if shards is None or s in shards
                   for t in layout)


def module_of(tensor: str) -> str:
    return tensor[: -len(".weight")] if tensor.endswith(".weight") else tensor


def is_embedding(module: str) -> bool:
    return any(module == e or module.endswith("." + e) for e in _EMBEDDINGS)


def is_linear_weight(entry: TensorEntry) -> bool:
    """A 2-D float `.weight` that is not a norm, router, conv, mHC mixer or KDA gate parameter."""
    if not entry.name.endswith(".weight") or len(entry.shape) != 2 or entry.dtype not in FLOAT_DTYPES:
        return False
    last = module_of(entry.name).rsplit(".", 1)[-1]
    return last != "gate" and not any(s in last for s in _NEVER)


def _role(module: str, kinds: LayerKinds) -> str:
    site = kinds.site(module)
    if site is None:
        return module.split(".")[-1] if is_embedding(module) else module
    leaf = site.leaf
    parts = leaf.split(".")
    if len(parts) >= 4 and parts[:2] == ["mlp", "experts"]:
        return f"expert mlp.experts.*.{parts[3]}"
    kind = "mtp" if kinds.layer_types and site.layer >= kinds.num_hidden_layers else site.kind
    return f"{kind} {leaf}"


def plan_fp8(ckpt: Checkpoint, settings: Fp8Settings) -> Fp8Plan:
    if settings.block < 16 or settings.block & (settings.block - 1):
        raise UsageError(f"--block {settings.block} is not a power of two >= 16",
                         hint="vLLM 0.30's GLM-5.3-Flash checkpoints use --block 128")
    _check_source_scheme(ckpt, settings.block)
    kinds = LayerKinds(ckpt.text_config())
    entries = {e.name: (s, e) for s, e in ckpt.tensors()}
    hits: Counter[str] = Counter()
    selected: set[str] = set()
    for name, (_, entry) in entries.items():
        module = module_of(name)
        globs = [g for g in settings.modules if fnmatch.fnmatchcase(module, g)]
        if not globs or any(fnmatch.fnmatchcase(module, g) for g in settings.exclude):
            continue
        hits.update(globs)
        if is_linear_weight(entry) and (settings.embeddings or not is_embedding(module)):
            selected.add(name)
    notes = [f"--modules {g!r} matched no tensor" for g in settings.modules if not hits[g]]
    if settings.embeddings:
        selected |= {n for n, (_, e) in entries.items() if is_linear_weight(e) and is_embedding(module_of(n))}
    _refuse_bad_shapes(selected, entries, settings.block, kinds)

    fp8_out = selected | {n for n, (_, e) in entries.items() if e.dtype in FP8_DTYPES}
    _refuse_split_fused(fp8_out, entries, settings.block, kinds, notes)
    if not selected:
        raise UsageError("nothing to convert: no bf16/fp16/fp32 matrix matches the selection",
                         hint="check --modules/--exclude against the tensor names "
                              "(glmctl quantize fp8 SRC DST --dry-run lists what is selected)")

    tensors: dict[str, TensorPlan] = {}
    layouts: dict[str, list[PlannedTensor]] = {}
    for shard in ckpt.shards:
        layout = layouts.setdefault(shard.path.name, [])
        for name, entry in shard.tensors.items():
            tensors[name] = _plan_tensor(shard, entry, name in selected, settings.block, kinds, layout)
    fates = Counter(t.fate for t in tensors.values() if t.action == "quantize")
    if fates["rejected"]:
        notes.append(f"{fates['rejected']} converted tensor(s) are {FATE_TEXT['rejected']}")
    if fates["bf16_at_load"]:
        notes.append(f"{fates['bf16_at_load']} converted tensor(s) are {FATE_TEXT['bf16_at_load']}")
    if fates["rejected"] or fates["bf16_at_load"]:
        plugin = Counter(t.plugin_fate for t in tensors.values() if t.action == "quantize")
        notes.append(f"with the glmctl plugin: {plugin['fp8']} converted tensor(s) stay FP8 in GPU "
                     f"memory, {plugin['bf16_at_load']} are dequantised to BF16 at load"
                     + (f", {plugin['rejected']} do not load" if plugin["rejected"] else ""))
    ragged = sorted(n for n in selected if entries[n][1].shape[0] > settings.block
                    and entries[n][1].shape[0] % settings.block)
    if ragged:
        notes.append(f"{len(ragged)} converted matri{'x ends' if len(ragged) == 1 else 'ces end'} in a partial "
                     f"block of rows (e.g. {ragged[0]}): vLLM loads that, transformers 5.24's FP8 loader "
                     "does not (it needs rows divisible by the scale rows)")
    qconfig = quantization_config(ckpt, fp8_out, settings.block, kinds)
    return Fp8Plan(settings, tensors, layouts, qconfig, notes)


def _check_source_scheme(ckpt: Checkpoint, block: int) -> None:
    prior = ckpt.config.get("quantization_config")
    if not prior:
        return
    method = str(prior.get("quant_method", "?"))
    if method != "fp8":
        raise UsageError(f"SRC is already quantised with {method!r}; block-FP8 can only be added to a "
                         "bf16/fp16/fp32 checkpoint or a block-FP8 one", hint="convert from the BF16 or "
                         "FP8 release of the model")
    blocks = prior.get("weight_block_size")
    if blocks is None:
        raise UsageError("SRC is a per-tensor FP8 checkpoint (no weight_block_size); vLLM holds one FP8 "
                         "scheme per model", hint="convert from the BF16 release instead")
    if list(blocks) != [block, block]:
        raise UsageError(f"SRC's FP8 tensors use {list(blocks)} blocks; vLLM holds one block size per "
                         f"model, so --block must match", hint=f"pass --block {blocks[0]}"
                         if len(set(blocks)) == 1 else "convert from the BF16 release instead")
    if prior.get("activation_scheme", "dynamic") != "dynamic":
        raise UsageError("SRC uses static FP8 activation scales; vLLM's block-FP8 path is dynamic only")


def _plan_tensor(shard: ShardHeader, entry: TensorEntry, convert: bool, block: int,
                 kinds: LayerKinds, layout: list[PlannedTensor]) -> TensorPlan:
    module = module_of(entry.name)
    if not convert:
        layout.append(PlannedTensor(entry.name, entry.dtype, entry.shape))
        action: Action = "keep_fp8" if entry.dtype in FP8_DTYPES else "copy"
        return TensorPlan(entry.name, shard.path.name, action, _role(module, kinds), "",
                          entry.nbytes, entry.nbytes)
    weight = PlannedTensor(entry.name, "F8_E4M3", entry.shape)
    scale = PlannedTensor(f"{module}.weight_scale_inv", "F32", scale_shape(entry.shape, block))
    layout += [weight, scale]
    return TensorPlan(entry.name, shard.path.name, "quantize", _role(module, kinds),
                      vllm_fate(module, kinds), entry.nbytes, weight.nbytes + scale.nbytes,
                      plugin_fate(module, kinds))


def _refuse_bad_shapes(selected: set[str], entries: dict, block: int, kinds: LayerKinds) -> None:
    bad = sorted(n for n in selected if entries[n][1].shape[1] % block)
    if bad:
        shapes = ", ".join(f"{n} {list(entries[n][1].shape)}" for n in bad[:3])
        raise UsageError(
            f"{len(bad)} selected matri{'x has' if len(bad) == 1 else 'ces have'} an input dim K that "
            f"is not a multiple of --block {block}: {shapes}{' ...' if len(bad) > 3 else ''}; vLLM's "
            "glm5next loader derives the block width as K // scale columns and would dequantise a "
            "partial K block on the wrong grid",
            hint="leave them out with --exclude, or pick a --block that divides K")
    scaled = {module_of(n) + ".weight_scale_inv" for n in selected}
    clash = sorted(scaled & set(entries))
    if clash:
        raise UsageError(f"{clash[0]} already exists although its weight is not FP8",
                         hint="the source checkpoint is inconsistent; exclude that module")


def _refuse_split_fused(fp8_out: set[str], entries: dict, block: int, kinds: LayerKinds,
                        notes: list[str]) -> None:
    """vLLM's fused GEMMs: one precision for all shards, partial blocks only in the last shard."""
    seen: set[str] = set()
    experts: dict[str, set[bool]] = {}
    for name in sorted(entries):
        module = module_of(name)
        moe = experts_module(module, kinds)
        if moe and name.endswith(".weight"):
            experts.setdefault(moe, set()).add(name in fp8_out)
        group = fused_group_of(module, kinds)
        if group is None or group[1] in seen:
            continue
        family, fused, members = group
        seen.add(fused)
        present = [m for m in members if f"{m}.weight" in entries]
        states = {f"{m}.weight" in fp8_out for m in present}
        loaded_fp8 = family in ("mlp", "expert")  # vLLM 0.30 builds these with the fp8 method
        if loaded_fp8 and len(states) > 1:
            raise UsageError(
                f"vLLM fuses {', '.join(present)} into one GEMM ({fused}), so they must all be FP8 "
                "or all stay as they are; the selection splits them",
                hint="select all of them or none (adjust --modules/--exclude)")
        misaligned = [m for m in present[:-1] if f"{m}.weight" in fp8_out
                      and entries[f"{m}.weight"][1].shape[0] % block]
        if misaligned and loaded_fp8:
            raise UsageError(
                f"{misaligned[0]} has {entries[misaligned[0] + '.weight'][1].shape[0]} output rows, not a "
                f"multiple of --block {block}, and is not the last shard of vLLM's fused {fused}: "
                "the shards after it would be read with shifted block scales", hint="exclude the group")
        if misaligned:
            notes.append(f"{misaligned[0]} ends in a partial block mid-way through vLLM's fused "
                         f"{fused.rsplit('.', 1)[-1]}: a loader that fuses it in FP8 must re-block it")
    for moe, states in sorted(experts.items()):
        if len(states) > 1:
            raise UsageError(f"some but not all routed experts of {moe} are selected; vLLM's FusedMoE "
                             "holds one precision per layer", hint="select all experts of a layer or none")


def quantization_config(ckpt: Checkpoint, fp8_out: set[str], block: int, kinds: LayerKinds) -> dict:
    """The `quantization_config` block for config.json, in the form vLLM 0.30's Fp8Config reads.

    `modules_to_not_convert` (vLLM falls back to it when `ignored_layers` is absent; transformers
    reads it) lists every linear module left unquantised: checkpoint names, plus vLLM's fused names
    (`mlp.gate_up_proj`, ...) for fused GEMMs that stay unquantised as a whole, because vLLM matches
    a fused layer's own prefix exactly, and `mlp.experts` once per MoE layer with unquantised experts
    (vLLM's experts rule is a substring match on that prefix). `modules_to_convert` (transformers
    only) names converted embeddings. Other keys of a block-FP8 source's config are kept.
    """
    prior = ckpt.config.get("quantization_config") or {}
    skip: set[str] = set()
    fused_state: dict[str, set[bool]] = {}
    for _, entry in ckpt.tensors():
        if not (entry.name.endswith(".weight") and len(entry.shape) == 2
                and (entry.dtype in FLOAT_DTYPES or entry.dtype in FP8_DTYPES)):
            continue
        module = module_of(entry.name)
        is_fp8 = entry.name in fp8_out
        group = fused_group_of(module, kinds)
        if group is not None and group[0] != "expert":  # experts are covered by `mlp.experts`
            fused_state.setdefault(group[1], set()).add(is_fp8)
        if is_fp8:
            continue
        skip.add(experts_module(module, kinds) or module)
    skip |= {fused for fused, states in fused_state.items() if states == {False}}
    config = {k: v for k, v in prior.items()
              if k not in ("ignored_layers", "modules_to_not_convert", "modules_to_convert")}
    # transformers swaps nn.Embedding for its FP8Embedding only for names ending in these
    embeddings = sorted({module_of(n).rsplit(".", 1)[-1] for n in fp8_out if module_of(n).endswith("embed_tokens")})
    if embeddings:
        config["modules_to_convert"] = embeddings
    config.update({
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
        "modules_to_not_convert": sorted(skip),
    })
    return config
