"""The EXL3-experts checkpoint format (`glmctl-exl3/1`): GLM-5.3-Flash with 4-bit routed experts.

Written by `glmctl quantize exl3`, read by the plugin's EXL3 MoE method (glmctl.plugin.quantization.exl3_method)
and by `glmctl serve` profiles with `weights: exl3`. Only the routed experts of the selected MoE
layers change; every other tensor is copied byte for byte (bf16, or block FP8 with its
`weight_scale_inv`).

Files
-----
    DST/config.json                       the source config + the `quantization_config` below
    DST/model.safetensors.index.json      weight_map over every shard
    DST/<source shard name>               the source shard minus the converted expert tensors
                                          (omitted when nothing is left in it)
    DST/model-exl3-layer-LLL.safetensors  the EXL3 tensors of every expert of MoE layer LLL
    DST/glmctl-exl3-report.json           per-tensor proxy error / RMSE, calibration, timings
    (tokenizer, generation config, chat template: copied)

Tensors of one converted expert projection P = `<prefix>layers.L.mlp.experts.E.{gate,up,down}_proj`
(the HF name of the linear; `.weight` and `.weight_scale_inv` of P are gone). K = bits per weight.

    | tensor      | dtype | shape                        | meaning                                        |
    |-------------|-------|------------------------------|------------------------------------------------|
    | P.trellis   | I16   | [in/16, out/16, 16*K]        | one 16x16 tile of weights per [i, j] entry: a  |
    |             |       |                              | tail-biting trellis bitstream, K bits/weight   |
    | P.suh       | F16   | [in]                         | input-channel signs x scales (global scale in) |
    | P.svh       | F16   | [out]                        | output-channel signs x scales                  |
    | P.mul1      | I32   | [] (0-d)                     | codebook marker: 0x83DCD12D viewed as int32    |

    gate_proj, up_proj: in = hidden_size (4096), out = moe_intermediate_size (2048)
    down_proj:          in = moe_intermediate_size, out = hidden_size

This is exllamav3 1.6.5's own per-tensor storage (`quantize_exl3` output; orientation (in, out),
the transpose of `nn.Linear.weight`), so exllamav3's kernels read it unchanged. The weight it
encodes is W = diag(suh) . Had . T . Had . diag(svh) in the (in, out) orientation, where T is the
decoded trellis and Had the normalised 128x128 Sylvester Hadamard applied blockwise to each side.
Because of the 128-wide blocks, a tensor-parallel slice must start and end on a multiple of 128
elements: gate/up are split by output columns (trellis dim 1, svh), down by input rows (trellis
dim 0, suh), exactly where vLLM splits w13/w2; `tp_slice` below does it.

`quantization_config` (config.json)
-----------------------------------
    {
      "quant_method": "glmctl_exl3",            # the plugin registers this name with vLLM 0.30
      "format": "glmctl-exl3/1",
      "experts": {                              # what is EXL3: routed experts only
        "method": "exl3", "bits": 4, "codebook": "mul1", "exllamav3": "1.6.5",
        "modules": ["model.layers.3.mlp.experts", ...],   # converted MoE layers (HF names)
        "calibration": "none" | {"tokens": 131072, "sources": ["corpus.txt"]},
        "tp_degrees": [1, 2, 4, 8]              # tensor-parallel degrees checked at conversion
      },
      "non_experts": null | {...}               # everything else, as the source had it: null for
    }                                           # bf16, else the source quantization_config
                                                # verbatim (e.g. {"quant_method": "fp8",
                                                # "weight_block_size": [128, 128], ...})
Routed experts of MoE layers not in `experts.modules` keep their source format (`non_experts`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from glmctl.quantize.safetensors_io import PlannedTensor

from glmctl.errors import ConfigError, UsageError

if TYPE_CHECKING:
    import torch

QUANT_METHOD = "glmctl_exl3"
FORMAT = "glmctl-exl3/1"
EXLLAMAV3_VERSION = "1.6.5"
CODEBOOK = "mul1"
MUL1_MULTIPLIER = 0x83DCD12D
MUL1_MARKER = MUL1_MULTIPLIER - 2**32  # the same 32 bits as a signed int32 (safetensors has no U32)
CHANNEL_BLOCK = 128  # Hadamard block: every dim and every TP slice is a multiple of this
SUPPORTED_BITS = (2, 3, 4, 5, 6, 7, 8)
DEFAULT_TP_DEGREES = (1, 2, 4, 8)
REPORT_FILE = "glmctl-exl3-report.json"

Projection = Literal["gate_proj", "up_proj", "down_proj"]
PROJECTIONS: tuple[Projection, ...] = ("gate_proj", "up_proj", "down_proj")

_EXPERT = re.compile(r"^(?P<module>(?P<prefix>.*?)layers\.(?P<layer>\d+)\.mlp\.experts)"
                     r"\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class ExpertLinear:
    """A routed-expert projection by its HF module name."""

    module: str  # "<prefix>layers.L.mlp.experts"
    layer: int
    expert: int
    proj: Projection

    @property
    def name(self) -> str:
        return f"{self.module}.{self.expert}.{self.proj}"


def parse_expert_linear(module: str) -> ExpertLinear | None:
    """`model.layers.3.mlp.experts.17.down_proj` -> ExpertLinear; None for anything else."""
    m = _EXPERT.match(module)
    if m is None or "visual" in m["prefix"]:
        return None
    return ExpertLinear(m["module"], int(m["layer"]), int(m["expert"]), m["proj"])  # type: ignore[arg-type]


def layer_index(prefix: str) -> int | None:
    """The decoder-layer index in a checkpoint or vLLM module name (`...layers.45.mtp_block...`)."""
    m = _LAYER.search(prefix + ".")
    return int(m.group(1)) if m else None


def io_features(proj: Projection, hidden: int, intermediate: int) -> tuple[int, int]:
    """(in_features, out_features) of one expert projection."""
    return (intermediate, hidden) if proj == "down_proj" else (hidden, intermediate)


def trellis_shape(in_features: int, out_features: int, bits: int) -> tuple[int, int, int]:
    return (in_features // 16, out_features // 16, 16 * bits)


def planned_tensors(linear_name: str, in_features: int, out_features: int, bits: int) -> list[PlannedTensor]:
    """The four tensors of one converted projection, in the order they are written."""
    return [
        PlannedTensor(f"{linear_name}.trellis", "I16", trellis_shape(in_features, out_features, bits)),
        PlannedTensor(f"{linear_name}.suh", "F16", (in_features,)),
        PlannedTensor(f"{linear_name}.svh", "F16", (out_features,)),
        PlannedTensor(f"{linear_name}.mul1", "I32", ()),
    ]


def exl3_bytes(in_features: int, out_features: int, bits: int) -> int:
    return sum(t.nbytes for t in planned_tensors("x", in_features, out_features, bits))


# -- tensor parallelism ---------------------------------------------------------------------------
def tp_problems(hidden: int, intermediate: int, tp_degrees: Iterable[int]) -> list[str]:
    """Why these expert shapes cannot be served at these TP degrees (empty list: they can).

    vLLM splits each expert's intermediate dimension evenly over the TP ranks (gate/up by output
    column, down by input row); EXL3's 128-wide Hadamard blocks must not be cut.
    """
    problems = []
    for dim, what in ((hidden, "hidden_size"), (intermediate, "moe_intermediate_size")):
        if dim % CHANNEL_BLOCK:
            problems.append(f"{what} {dim} is not a multiple of {CHANNEL_BLOCK} (EXL3 Hadamard block)")
    for tp in sorted(set(tp_degrees)):
        if tp < 1:
            problems.append(f"tensor-parallel degree {tp} is not a positive integer")
        elif intermediate % tp:
            problems.append(f"TP {tp}: moe_intermediate_size {intermediate} does not split evenly over {tp} ranks")
        elif (intermediate // tp) % CHANNEL_BLOCK:
            problems.append(
                f"TP {tp}: each rank would hold {intermediate // tp} intermediate channels per expert, "
                f"not a multiple of {CHANNEL_BLOCK}, so the slice would cut an EXL3 Hadamard block")
    return problems


def rank_span(intermediate: int, tp_size: int, rank: int) -> tuple[int, int]:
    """[begin, end) of the intermediate channels rank `rank` holds (checked by tp_problems)."""
    per = intermediate // tp_size
    if intermediate % tp_size or per % CHANNEL_BLOCK:
        raise ConfigError(
            f"EXL3 experts cannot be split over {tp_size} TP ranks: {tp_problems(CHANNEL_BLOCK, intermediate, [tp_size])[0]}",
            hint="serve with a tensor-parallel degree that the checkpoint was checked for "
                 "(quantization_config.experts.tp_degrees)")
    return rank * per, (rank + 1) * per


def tp_slice(proj: Projection, suffix: str, tensor: torch.Tensor, intermediate: int, tp_size: int,
             rank: int) -> torch.Tensor:
    """This rank's part of one stored tensor (a view; markers and replicated vectors unchanged)."""
    if tp_size == 1 or suffix == "mul1":
        return tensor
    begin, end = rank_span(intermediate, tp_size, rank)
    if proj == "down_proj":  # row-parallel: the input (intermediate) side is split
        if suffix == "trellis":
            return tensor[begin // 16:end // 16]
        return tensor[begin:end] if suffix == "suh" else tensor
    # gate/up, column-parallel: the output (intermediate) side is split
    if suffix == "trellis":
        return tensor[:, begin // 16:end // 16]
    return tensor[begin:end] if suffix == "svh" else tensor


# -- quantization_config ----------------------------------------------------------------------------
@dataclass
class Exl3ExpertsSpec:
    """The `quantization_config` block, parsed and checked."""

    bits: int
    modules: list[str]
    calibration: str | dict = "none"
    tp_degrees: list[int] = field(default_factory=lambda: list(DEFAULT_TP_DEGREES))
    non_experts: dict | None = None
    codebook: str = CODEBOOK
    exllamav3: str = EXLLAMAV3_VERSION

    def layers(self) -> set[int]:
        return {i for m in self.modules if (i := layer_index(m)) is not None}

    def to_config(self) -> dict:
        return {
            "quant_method": QUANT_METHOD,
            "format": FORMAT,
            "experts": {"method": "exl3", "bits": self.bits, "codebook": self.codebook,
                        "exllamav3": self.exllamav3, "modules": list(self.modules),
                        "calibration": self.calibration, "tp_degrees": list(self.tp_degrees)},
            "non_experts": self.non_experts,
        }

    @classmethod
    def from_config(cls, config: dict) -> Exl3ExpertsSpec:
        def bad(what: str) -> ConfigError:
            return ConfigError(f"quantization_config of an EXL3-experts checkpoint: {what}",
                               hint="rebuild the checkpoint with `glmctl quantize exl3`")

        if config.get("quant_method") != QUANT_METHOD:
            raise bad(f"quant_method is {config.get('quant_method')!r}, not {QUANT_METHOD!r}")
        if config.get("format") != FORMAT:
            raise bad(f"format {config.get('format')!r} is not {FORMAT!r} (written by another glmctl?)")
        experts = config.get("experts")
        if not isinstance(experts, dict):
            raise bad("no 'experts' object")
        bits = experts.get("bits")
        if bits not in SUPPORTED_BITS:
            raise bad(f"experts.bits {bits!r} is not one of {SUPPORTED_BITS}")
        if experts.get("codebook") != CODEBOOK:
            raise bad(f"experts.codebook {experts.get('codebook')!r}: only {CODEBOOK!r} is supported")
        modules = experts.get("modules")
        if not isinstance(modules, list) or not all(isinstance(m, str) and layer_index(m) is not None
                                                    for m in modules):
            raise bad("experts.modules must list the converted experts modules (…layers.N.mlp.experts)")
        non_experts = config.get("non_experts")
        if non_experts is not None and not isinstance(non_experts, dict):
            raise bad("non_experts must be null or the source's quantization_config object")
        return cls(bits=bits, modules=modules, calibration=experts.get("calibration", "none"),
                   tp_degrees=[int(t) for t in experts.get("tp_degrees") or DEFAULT_TP_DEGREES],
                   non_experts=non_experts, codebook=experts["codebook"],
                   exllamav3=str(experts.get("exllamav3", EXLLAMAV3_VERSION)))


def check_marker(name: str, marker: torch.Tensor) -> None:
    """Refuse a tensor whose codebook marker is not mul1 (another codebook decodes differently)."""
    if marker.numel() != 1 or int(marker.reshape(()).item()) != MUL1_MARKER:
        raise UsageError(f"{name} does not hold the mul1 codebook marker ({MUL1_MARKER})",
                         hint="the checkpoint was not written by `glmctl quantize exl3`; rebuild it")
