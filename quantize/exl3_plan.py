"""What `glmctl quantize exl3` will do to a checkpoint, decided before anything is written.

`plan_exl3` finds every routed-expert projection, groups them by MoE layer, keeps the layers whose
experts module matches `--experts`, checks shapes against config.json and the 128-element
tensor-parallel rule (`exl3_format.tp_problems`), and lays out the output: one shard per converted
layer plus the source shards without the converted tensors. Pure bookkeeping over headers: no
tensor data is read, so `--dry-run` and the unit tests run anywhere.
"""

from __future__ import annotations

import fnmatch
from dataclasses import asdict, dataclass, field
from pathlib import Path

from glmctl.quantize.checkpoint import Checkpoint
from glmctl.quantize.exl3_format import (
    DEFAULT_TP_DEGREES,
    PROJECTIONS,
    SUPPORTED_BITS,
    Exl3ExpertsSpec,
    Projection,
    exl3_bytes,
    io_features,
    layer_index,
    parse_expert_linear,
    planned_tensors,
    tp_problems,
)
from glmctl.quantize.safetensors_io import FLOAT_DTYPES, PlannedTensor, TensorEntry

from glmctl.errors import ConfigError, UsageError

DEFAULT_EXPERTS_GLOB = "*"


@dataclass(frozen=True)
class Exl3Settings:
    """Everything that changes the output; a resumed job must have the same (glmctl.quantize.job)."""

    bits: int = 4
    experts: tuple[str, ...] = (DEFAULT_EXPERTS_GLOB,)
    calibration: tuple[str, ...] = ()  # text files; empty: calibration-free
    calibration_tokens: int = 131072
    calibration_row: int = 2048
    tp_degrees: tuple[int, ...] = DEFAULT_TP_DEGREES
    seed: int = 0

    @property
    def calibrated(self) -> bool:
        return bool(self.calibration)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["experts"], d["calibration"], d["tp_degrees"] = list(self.experts), list(self.calibration), list(self.tp_degrees)
        if not self.calibrated:
            d.pop("calibration_tokens"), d.pop("calibration_row")
        return d


@dataclass(frozen=True)
class SourceTensor:
    shard: str
    entry: TensorEntry
    scale: TensorEntry | None = None  # weight_scale_inv of a block-FP8 source


@dataclass
class LayerPlan:
    """One MoE layer whose routed experts become EXL3: one conversion unit, one output shard."""

    module: str  # "<prefix>layers.L.mlp.experts"
    layer: int
    num_experts: int
    hidden: int
    intermediate: int
    sources: dict[tuple[int, str], SourceTensor]  # (expert, proj) -> source weight
    unit: str  # output shard file name, also the job unit

    def linear(self, expert: int, proj: Projection) -> str:
        return f"{self.module}.{expert}.{proj}"

    def layout(self, bits: int) -> list[PlannedTensor]:
        out = []
        for e in range(self.num_experts):
            for proj in PROJECTIONS:
                out += planned_tensors(self.linear(e, proj), *io_features(proj, self.hidden, self.intermediate), bits)
        return out

    def bytes_in(self) -> int:
        return sum(s.entry.nbytes + (s.scale.nbytes if s.scale else 0) for s in self.sources.values())

    def bytes_out(self, bits: int) -> int:
        return sum(exl3_bytes(*io_features(p, self.hidden, self.intermediate), bits)
                   for (_, p) in self.sources)


@dataclass
class Exl3Plan:
    settings: Exl3Settings
    layers: list[LayerPlan]
    passthrough: dict[str, list[PlannedTensor]]  # source shard -> tensors kept, in source order
    skipped_modules: list[str]  # experts modules not selected by --experts
    spec: Exl3ExpertsSpec
    fp8_block: int | None = None  # block edge of a block-FP8 source
    notes: list[str] = field(default_factory=list)

    @property
    def quantization_config(self) -> dict:
        return self.spec.to_config()

    def bytes_out(self) -> int:
        kept = sum(t.nbytes for layout in self.passthrough.values() for t in layout)
        return kept + sum(layer.bytes_out(self.settings.bits) for layer in self.layers)

    def weight_map(self) -> dict[str, str]:
        out = {t.name: shard for shard, layout in self.passthrough.items() for t in layout}
        for layer in self.layers:
            out.update({t.name: layer.unit for t in layer.layout(self.settings.bits)})
        return dict(sorted(out.items()))


def layer_unit_name(layer: int) -> str:
    return f"model-exl3-layer-{layer:03d}.safetensors"


def plan_exl3(ckpt: Checkpoint, settings: Exl3Settings) -> Exl3Plan:
    if settings.bits not in SUPPORTED_BITS:
        raise UsageError(f"--bits {settings.bits} is not supported", hint=f"choose one of {SUPPORTED_BITS}")
    text = ckpt.text_config()
    hidden, intermediate = _config_int(text, "hidden_size"), _config_int(text, "moe_intermediate_size")
    num_experts = _config_int(text, "n_routed_experts")
    source_qc = ckpt.config.get("quantization_config") or text.get("quantization_config")
    fp8_block = _source_scheme(source_qc)

    by_module: dict[str, dict[tuple[int, str], SourceTensor]] = {}
    scales: dict[str, TensorEntry] = {}
    for shard, entry in ckpt.tensors():
        if entry.name.endswith(".weight_scale_inv"):
            scales[entry.name[: -len("_scale_inv")]] = entry
        if not entry.name.endswith(".weight"):
            continue
        linear = parse_expert_linear(entry.name[: -len(".weight")])
        if linear is not None:
            by_module.setdefault(linear.module, {})[(linear.expert, linear.proj)] = SourceTensor(shard.path.name, entry)
    if not by_module:
        raise UsageError(f"{ckpt.path} has no routed-expert weights (…mlp.experts.N.gate_proj.weight)",
                         hint="SRC must be a GLM-5.3-Flash checkpoint with its MoE layers")

    selected = sorted((m for m in by_module if any(fnmatch.fnmatchcase(m, g) for g in settings.experts)),
                      key=_layer_of)
    if not selected:
        raise UsageError(f"--experts {', '.join(settings.experts)} matches none of the {len(by_module)} "
                         f"experts modules (e.g. {sorted(by_module, key=_layer_of)[0]})",
                         hint="globs match experts module names such as 'model.layers.3.mlp.experts'")
    problems = tp_problems(hidden, intermediate, settings.tp_degrees)
    if problems:
        raise UsageError("EXL3 experts of this model cannot be tensor-parallel at the requested degrees: "
                         + "; ".join(problems),
                         hint="drop the degrees from --tp (the serving profile must use one that passes)")

    layers = []
    converted: set[str] = set()
    for module in selected:
        sources = by_module[module]
        layer = _layer_of(module)
        _check_layer(module, sources, num_experts, hidden, intermediate, fp8_block)
        for key, src in sources.items():
            scale = scales.get(src.entry.name)
            if src.entry.dtype == "F8_E4M3" and scale is None:
                raise ConfigError(f"{src.entry.name} is FP8 without a weight_scale_inv",
                                  hint="the source checkpoint is incomplete")
            sources[key] = SourceTensor(src.shard, src.entry, scale)
            converted.add(src.entry.name)
            if scale is not None:
                converted.add(scale.name)
        layers.append(LayerPlan(module, layer, num_experts, hidden, intermediate, sources, layer_unit_name(layer)))

    passthrough = {}
    for shard in ckpt.shards:
        kept = [PlannedTensor(e.name, e.dtype, e.shape) for e in shard.tensors.values() if e.name not in converted]
        if kept:
            passthrough[shard.path.name] = kept
    clash = set(passthrough) & {layer.unit for layer in layers}
    if clash:
        raise UsageError(f"SRC already has a shard named {sorted(clash)[0]}",
                         hint="SRC looks like an EXL3 output already; convert the original checkpoint")

    spec = Exl3ExpertsSpec(
        bits=settings.bits, modules=[layer.module for layer in layers],
        calibration=({"tokens": settings.calibration_tokens,
                      "sources": [Path(p).name for p in settings.calibration]}
                     if settings.calibrated else "none"),
        tp_degrees=sorted(set(settings.tp_degrees)), non_experts=source_qc)
    skipped = sorted(set(by_module) - set(selected), key=_layer_of)
    notes = []
    if skipped:
        notes.append(f"{len(skipped)} experts module(s) keep their source format: "
                     + ", ".join(skipped[:4]) + (" ..." if len(skipped) > 4 else ""))
    if fp8_block:
        notes.append(f"block-FP8 source ({fp8_block}x{fp8_block}): experts are dequantised to fp32 "
                     "before EXL3 quantisation; everything else stays FP8")
    return Exl3Plan(settings, layers, passthrough, skipped, spec, fp8_block, notes)


def _layer_of(module: str) -> int:
    return layer_index(module) or 0


def _config_int(text: dict, key: str) -> int:
    value = text.get(key)
    if not isinstance(value, int) or value <= 0:
        raise ConfigError(f"config.json has no positive integer {key!r}",
                          hint="SRC must be a GLM-5.3-Flash (glm5_next) checkpoint")
    return value


def _source_scheme(qc: dict | None) -> int | None:
    """None for a bf16 source, the block edge for a block-FP8 one; anything else is refused."""
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8" and isinstance(qc.get("weight_block_size"), list):
        block = qc["weight_block_size"]
        if len(block) == 2 and block[0] == block[1] and isinstance(block[0], int):
            return block[0]
    raise UsageError(f"SRC's quantization_config ({method!r}, {qc.get('weight_block_size')!r}) is not "
                     "supported", hint="convert a bf16 or block-FP8 GLM-5.3-Flash checkpoint")


def _check_layer(module: str, sources: dict, num_experts: int, hidden: int, intermediate: int,
                 fp8_block: int | None) -> None:
    missing = [f"{e}.{p}" for e in range(num_experts) for p in PROJECTIONS if (e, p) not in sources]
    extra = sorted(f"{e}.{p}" for (e, p) in sources if e >= num_experts)
    if missing or extra:
        what = f"lacks experts {', '.join(missing[:3])}" if missing else f"has extra experts {', '.join(extra[:3])}"
        raise ConfigError(f"{module} {what} (config.json says n_routed_experts = {num_experts})",
                          hint="the checkpoint is incomplete or does not match its config.json")
    for (e, proj), src in sources.items():
        in_f, out_f = io_features(proj, hidden, intermediate)
        entry = src.entry
        if entry.shape != (out_f, in_f):
            raise ConfigError(f"{module}.{e}.{proj}.weight is {list(entry.shape)}, expected "
                              f"[{out_f}, {in_f}] from config.json", hint="SRC's config.json does not match its weights")
        if entry.dtype == "F8_E4M3" and not fp8_block:
            raise ConfigError(f"{entry.name} is FP8 but config.json has no block-FP8 quantization_config",
                              hint="restore the source config.json")
        if entry.dtype not in (*FLOAT_DTYPES, "F8_E4M3"):
            raise ConfigError(f"{entry.name} is {entry.dtype}; EXL3 conversion reads BF16, F16, F32 or block FP8")


def default_tp_degrees() -> tuple[int, ...]:
    """Tensor-parallel degrees of the shipped serving profiles that serve EXL3 experts.

    Falls back to 1, 2, 4, 8 when no shipped profile says (the profiles package is data only).
    """
    from importlib import resources

    import yaml

    found = set()
    try:
        files = [f for f in resources.files("glmctl.profiles").iterdir() if f.name.endswith(".yaml")]
    except (ModuleNotFoundError, FileNotFoundError):
        files = []
    for f in files:
        try:
            doc = yaml.safe_load(f.read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError):
            continue
        model = doc.get("model") if isinstance(doc, dict) else None
        if isinstance(model, dict) and model.get("weights") == "exl3":
            tp = doc.get("tensor_parallel_size", 1)
            if isinstance(tp, int):
                found.add(tp)
    return tuple(sorted(found)) if found else DEFAULT_TP_DEGREES
