"""Which GLM-5.3-Flash attention projections the plugin builds in block FP8 (rules only: no torch,
no vLLM, so they are unit-testable anywhere).

Stock vLLM 0.30 builds every KDA and MLA projection without a quant config, so a block-FP8
checkpoint (`glmctl quantize fp8`) is either dequantised at load or refused there. With the plugin,
each projection is one *unit* (one GEMM in vLLM): the `plugin_gemm` of its row in
`glmctl.quantize.glm5next.PROJECTIONS`, FP8 or BF16 as that row's `plugin` fate says (the reasons
for the BF16 ones are there too). `FP8_UNITS` and `BF16_UNITS` are those rows by layer kind.

A unit is FP8 when every leaf of it has a `weight_scale_inv` in the checkpoint (read from its
index, or the shard headers) and its shape fits block FP8 at the tensor-parallel size (vLLM's
`validate_fp8_block_shape` rule: K and every shard's rows per rank are whole blocks, except the
last shard of an unsplit fused GEMM). When the checkpoint's tensor names cannot be read (a hub id
not in the local cache), the quantization config's `modules_to_not_convert` decides instead, and a
BF16 tensor arriving for an FP8-built unit stops the load with a clear error.

Switches: GLMCTL_FP8_ATTENTION=off (or GLMCTL_PLUGIN=off) leaves vLLM as shipped;
GLMCTL_FP8_ATTENTION_METHOD=vllm|dequant picks the FP8 units' linear method (auto, the default:
vLLM's `Fp8LinearMethod` on GPUs, the exact dequantise-at-load method on vLLM's CPU platform).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from glmctl import switches
from glmctl.quantize.glm5next import PROJECTIONS, Projection

_ATTENTION = "self_attn."
# (layer kind, leaf under self_attn, its row) for every attention projection, in checkpoint order
ATTENTION_ROWS: tuple[tuple[str, str, Projection], ...] = tuple(
    (p.family, p.leaf.removeprefix(_ATTENTION), p) for p in PROJECTIONS if p.family in ("kda", "mla"))


def _members(family: str, gemm: str, plugin: bool = False) -> tuple[str, ...]:
    """The leaves vLLM (or, with `plugin`, the plugin) builds into the GEMM `self_attn.<gemm>`."""
    return tuple(leaf for f, leaf, p in ATTENTION_ROWS
                 if f == family and (p.plugin_gemm if plugin else p.gemm) == _ATTENTION + gemm)


def _units(fate: str) -> dict[str, dict[str, tuple[str, ...]]]:
    units: dict[str, dict[str, tuple[str, ...]]] = {}
    for family, leaf, p in ATTENTION_ROWS:
        if p.plugin == fate:
            unit = p.plugin_gemm.removeprefix(_ATTENTION)
            by_unit = units.setdefault(family, {})
            by_unit[unit] = (*by_unit.get(unit, ()), leaf)
    return units


KDA_QKV = _members("kda", "in_proj_qkvbfg_a.qkv", plugin=True)
KDA_BFG_A = _members("kda", "in_proj_qkvbfg_a.bfg_a", plugin=True)
KDA_INPUT = _members("kda", "in_proj_qkvbfg_a")  # vLLM's in_proj_qkvbfg_a shard order
MLA_QKV_A = _members("mla", "fused_qkv_a_proj")

# layer kind -> unit -> checkpoint leaves (relative to self_attn), for the units that can be FP8
FP8_UNITS: dict[str, dict[str, tuple[str, ...]]] = _units("fp8")
# units that stay in the model dtype whatever the checkpoint holds
BF16_UNITS: dict[str, dict[str, tuple[str, ...]]] = _units("bf16_at_load")

_SITE = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:mtp_block\.)?self_attn\.(.+)$")


def switched_off(env: Mapping[str, str] | None = None) -> bool:
    return switches.plugin_off(env) or not switches.read("GLMCTL_FP8_ATTENTION", env)


def method_kind(platform_is_cpu: bool, env: Mapping[str, str] | None = None) -> str:
    """"vllm" (vLLM's Fp8LinearMethod: FP8 in memory) or "dequant" (exact BF16 at load)."""
    value = switches.read("GLMCTL_FP8_ATTENTION_METHOD", env)
    if value != "auto":
        return value
    return "dequant" if platform_is_cpu else "vllm"


def site(name: str) -> tuple[int, str] | None:
    """(layer, leaf under self_attn) of a module name: checkpoint (`model.layers.3.self_attn.q_proj`,
    `model.language_model.layers...`) and vLLM prefixes (`...layers.4.mtp_block.self_attn...`)."""
    m = _SITE.search(name)
    return (int(m[1]), m[2]) if m else None


@dataclass(frozen=True)
class BlockFp8:
    """What the plugin needs from a block-FP8 quantization config."""

    block: int
    ignored: frozenset[str]  # modules_to_not_convert / ignored_layers, as written


def block_fp8_of(weight_block_size, serialized: bool, activation_scheme: str,
                 ignored: Iterable[str] | None) -> BlockFp8 | None:
    """None unless the config is serialized block FP8 with one square block and dynamic activations."""
    if not serialized or weight_block_size is None or activation_scheme != "dynamic":
        return None
    sizes = list(weight_block_size)
    if len(sizes) != 2 or sizes[0] != sizes[1] or sizes[0] <= 0:
        return None
    return BlockFp8(int(sizes[0]), frozenset(ignored or ()))


@dataclass(frozen=True)
class AttentionFp8Selection:
    """The attention weights that are block FP8 in the checkpoint, by (layer, leaf)."""

    block: int
    fp8: frozenset[tuple[int, str]] | None  # None: unknown, decided by `ignored`
    ignored: frozenset[tuple[int, str]]
    source: str  # where `fp8` came from, for the log line

    def all_fp8(self, layer: int, leaves: Sequence[str]) -> bool:
        if self.fp8 is not None:
            return all((layer, leaf) in self.fp8 for leaf in leaves)
        return not any((layer, leaf) in self.ignored for leaf in leaves)


def select(cfg: BlockFp8, tensor_names: Iterable[str] | None) -> AttentionFp8Selection:
    ignored = frozenset(s for s in (site(n) for n in cfg.ignored) if s is not None)
    if tensor_names is None:
        return AttentionFp8Selection(cfg.block, None, ignored, "quantization_config")
    suffix = ".weight_scale_inv"
    fp8 = frozenset(s for s in (site(n[: -len(suffix)]) for n in tensor_names if n.endswith(suffix))
                    if s is not None)
    return AttentionFp8Selection(cfg.block, fp8, ignored, "checkpoint")


def fits_block(rows_per_rank: Sequence[int], cols_per_rank: int, block: int, split_rows: bool) -> bool:
    """vLLM's `validate_fp8_block_shape`: K per rank in whole blocks; every shard's rows per rank in
    whole blocks, except the last shard of a fused GEMM whose rows are not split across ranks."""
    checked = rows_per_rank if split_rows else rows_per_rank[:-1]
    return cols_per_rank % block == 0 and all(r % block == 0 for r in checked)


def checkpoint_tensor_names(model: str, revision: str | None = None) -> list[str] | None:
    """Tensor names of a local checkpoint directory (or one in the Hugging Face cache); None if
    they cannot be read without downloading."""
    from glmctl.quantize.safetensors_io import checkpoint_tensor_names as local_names

    path = Path(model).expanduser()
    if not path.is_dir():
        path = _hub_cache_dir(model, revision)
        if path is None:
            return None
    return local_names(path)


def _hub_cache_dir(repo_id: str, revision: str | None) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    for filename in ("model.safetensors.index.json", "model.safetensors"):
        try:
            found = try_to_load_from_cache(repo_id, filename, revision=revision)
        except Exception:  # noqa: BLE001 - not a repo id: nothing cached
            return None
        if isinstance(found, str):
            return Path(found).parent
    return None
