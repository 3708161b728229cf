"""Predict the 8x L40 node's decode and prefill from one rank's step measured on another GPU.

Input (`MeasuredRun`, a JSON file): a per-rank step of the rank model (`glmctl.plan.rank`) measured
on a stand-in GPU (the H200), broken down by kind (kind -> µs), with the stand-in's memory
bandwidth and tensor throughput measured in the same run, for sessions x context cells. A cell
that has only a measured step time takes the reference breakdown's shares.

Each kind is scaled by the ratio of the resource that bounds it (`Bound`): memory bandwidth for
bandwidth-bound kinds (stand-in measured / L40 datasheet), tensor throughput for compute-bound ones,
nothing for launch gaps (kernel-launch latency inside a CUDA graph is the GPU front end's, taken as
equal). The rank model runs no collectives; the node's are added from the model's own call list
(`decode_step_collectives`: two all-reduces per layer, the vocab-parallel embedding's all-reduce,
the logits all-gather, and the same for each MTP draft pass) timed by a `CollectiveTimeModel`
(default: `glmctl.collectives.cost_model.time`, the host-staged protocol's model of the node).
Tokens per second = sessions x tokens per step / step time, with tokens per step a stated
acceptance, never a measurement (random weights make the measured acceptance meaningless).

The L40 figures are datasheet peaks, so a kind scaled by them assumes the L40 reaches its peak as
well as the stand-in reached its measured figure: every predicted cell names what it rests on.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from glmctl.errors import ConfigError
from glmctl.plan.model import ModelSpec, load_model_spec
from glmctl.plan.setup import parse_speculative

Bound = Literal["bandwidth", "compute_bf16", "compute_fp8", "launch"]


class DeviceFigures(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    memory_bandwidth_gbps: float = Field(gt=0)  # GB/s (1e9)
    bf16_tflops: float = Field(gt=0)  # dense tensor throughput
    fp8_tflops: float | None = None  # None: twice bf16 (stated where used)
    source: str

    def throughput(self, bound: Bound) -> float:
        if bound == "bandwidth":
            return self.memory_bandwidth_gbps
        if bound == "compute_fp8":
            return self.fp8_tflops or 2 * self.bf16_tflops
        return self.bf16_tflops


L40_DATASHEET = DeviceFigures(
    name="L40", memory_bandwidth_gbps=864.0, bf16_tflops=181.05, fp8_tflops=362.1,
    source="NVIDIA L40 datasheet: 864 GB/s GDDR6, 181 TFLOP/s dense BF16 and 362 dense FP8 tensor",
)

# What bounds each kind of a decode step (a few tokens per sequence: weights and caches are read
# once per step) and of a prefill chunk (thousands of tokens: GEMM and attention maths).
# Kinds as `bench/rank_sim.py` groups the profiler's kernels (dense_gemm, sampler, memcpy, other,
# gpu_idle_in_span) and as the issue names them (shared_dense_mlp, sampler_mtp, launch_gaps);
# host_between_steps is the measured step beyond the profiled kernel span (CPU-side scheduling).
_NOT_SCALED = ("launch_gaps", "gpu_idle_in_span", "host_between_steps")
DECODE_BOUNDS: dict[str, Bound] = {
    **{k: "bandwidth" for k in ("mla_attention", "indexer", "kda", "routed_experts", "shared_dense_mlp",
                                "dense_gemm", "norms_mhc", "sampler_mtp", "sampler", "memcpy", "other")},
    **{k: "launch" for k in _NOT_SCALED},
}
PREFILL_BOUNDS: dict[str, Bound] = {
    **{k: "compute_bf16" for k in ("mla_attention", "kda", "routed_experts", "shared_dense_mlp", "dense_gemm")},
    "indexer": "compute_fp8",
    **{k: "bandwidth" for k in ("norms_mhc", "sampler_mtp", "sampler", "memcpy", "other")},
    **{k: "launch" for k in _NOT_SCALED},
}
UNKNOWN_KIND_BOUND: Bound = "bandwidth"
# Kinds whose prefill cost grows with the context already cached: the indexer scores every pooled
# key; sparse MLA reads a fixed top-k, KDA and the MLPs do not look back.
PREFILL_CONTEXT_LINEAR = frozenset({"indexer"})

# The report's 70 -> 163 tok/s single-session gain at 64k with MTP-3: 163 / 70 = 2.33 tokens per
# verify step is a lower bound (an MTP-3 step costs more than a plain one); used as stated.
REPORT_TOKENS_PER_STEP = {"none": 1.0, "mtp:3": round(163 / 70, 3)}
ACCEPTANCE_SOURCE = "report: single-session 64k decode 70 -> 163 tok/s with MTP-3 (163/70, a lower bound)"

REPORT = "shared/seed/serving-glm53-flash-on-8xL40.txt"
# (sessions, context label, speculative) -> tok/s the report measured on 8x L40, 4-bit experts.
REPORT_DECODE_CELLS: dict[tuple[int, str, str], float] = {
    (8, "22k", "mtp:3"): 646.0, (8, "64k", "mtp:3"): 642.0, (8, "240k", "mtp:3"): 704.0,
    (2, "240k", "mtp:3"): 276.0, (1, "64k", "mtp:3"): 186.0,
}
CONTEXT_LABELS = {"22k": 22_000, "64k": 64_000, "240k": 240_000}
REPORT_PREFILL_256K_S = (57.0, 72.0)  # one 256k prompt, 4-bit experts
REPORT_QUEUE_8X227K_S = 220.0  # last of eight ~227k prompts arriving together


class CollectiveTimeModel(Protocol):
    """Seconds one collective call takes on the node: `op` ("all_reduce", "all_gather"), the number
    of ranks, payload bytes per rank, payload dtype ("bf16", "int8")."""

    def __call__(self, op: str, ranks: int, nbytes: int, dtype: str) -> float: ...


class HostStagedFallback(BaseModel):
    """A simple host-staged model, for when `glmctl.collectives.cost_model` (the protocol's own,
    the default) is not installed, or to see how much the prediction rests on it. All its
    constants are assumptions, not measurements.

    all_reduce, the cheaper of: one-shot (each rank copies its payload B to pinned host memory and
    reads the other ranks' back: (N-1)B over its link, N^2 B through host memory) and two-shot
    (reduce-scatter then all-gather through host memory: 2B over each link, 3NB through host
    memory). all_gather: each rank writes its shard and reads the others' ((N-1)B, N^2 B). Host
    traffic below `host_cache_bytes` is taken to stay in the host's caches (decode payloads)."""

    model_config = ConfigDict(frozen=True)

    latency_us: float = 15.0  # flag write + poll through host memory and a kernel launch, per call
    link_gbps: float = 25.0  # PCIe Gen4 x16, per direction, per GPU
    host_gbps: float = 100.0  # the VM's host memory bandwidth (report: "about 100 GB/s")
    host_cache_bytes: int = 32 << 20
    int8_ratio: float = 0.52  # INT8 payload + scales vs bf16

    @property
    def label(self) -> str:
        return (f"fallback host-staged model (assumed: {self.latency_us:g} µs per call, {self.link_gbps:g} GB/s "
                f"PCIe per GPU, {self.host_gbps:g} GB/s host memory beyond {self.host_cache_bytes >> 20} MiB)")

    def _cost(self, link_bytes: float, host_bytes: float) -> float:
        host = host_bytes / (self.host_gbps * 1e9) if host_bytes > self.host_cache_bytes else 0.0
        return max(link_bytes / (self.link_gbps * 1e9), host)

    def __call__(self, op: str, ranks: int, nbytes: int, dtype: str) -> float:
        n = ranks
        b = nbytes * (self.int8_ratio if dtype == "int8" else 1.0)
        one_shot = self._cost((n - 1) * b, n * n * b)
        if op == "all_reduce":
            one_shot = min(one_shot, self._cost(2 * b, 3 * n * b))
        return self.latency_us * 1e-6 + one_shot


class Collective(BaseModel):
    op: Literal["all_reduce", "all_gather"]
    bytes: int = Field(ge=0)  # payload per rank per call
    count: int = Field(ge=0)
    dtype: str = "bf16"
    what: str = ""


class StepCell(BaseModel):
    """One measured cell: `step_us` (1e6 / measured steps per second), a breakdown, or both."""

    sessions: int = Field(ge=1)
    context_tokens: int = Field(ge=1)
    speculative: str = "none"
    step_us: float | None = Field(None, gt=0)
    breakdown_us: dict[str, float] | None = None
    collectives: list[Collective] | None = None  # default: the model's own per-step calls


class PrefillMeasurement(BaseModel):
    """Either one chunk's breakdown at a known context, or whole measured prefills (TTFT of one
    prompt; optionally of the last of several prompts arriving together)."""

    chunk_tokens: int = Field(2048, ge=1)  # max_num_batched_tokens: tokens per prefill step
    context_tokens: int | None = Field(None, ge=0)  # context cached before the measured chunk
    breakdown_us: dict[str, float] | None = None
    ttft_s: float | None = Field(None, gt=0)
    prompt_tokens: int | None = Field(None, ge=1)
    queue_ttft_s: float | None = Field(None, gt=0)  # the last prompt's TTFT
    queue_prompts: int = Field(8, ge=1)
    queue_prompt_tokens: int | None = Field(None, ge=1)
    allreduce_dtype: str = "int8"  # the report compresses the prefill all-reduce

    @model_validator(mode="after")
    def _one_form(self) -> PrefillMeasurement:
        if self.breakdown_us is not None and self.context_tokens is None:
            raise ValueError("a chunk breakdown needs context_tokens")
        if self.breakdown_us is None and (self.ttft_s is None or self.prompt_tokens is None):
            raise ValueError("give breakdown_us + context_tokens, or ttft_s + prompt_tokens")
        return self


class MeasuredRun(BaseModel):
    """The measurements, written by hand or from `bench/rank_sim.py` records: `rank_sim` names
    record files (relative to this file) or holds them; their cells, breakdown and TTFTs then fill
    `reference`, `cells` and `prefill` (`glmctl.plan.rank_sim_records`)."""

    source: str  # where the measurements come from (file, run, date)
    device: DeviceFigures  # the stand-in GPU's measured figures
    tp: int = 8
    reference: StepCell | None = None  # the cell with the full breakdown (the report: 8 x 240k, MTP-3)
    rank_sim: list[str | dict] = []
    cells: list[StepCell] = []
    tokens_per_step: dict[str, float] = {}  # by speculative method; default REPORT_TOKENS_PER_STEP
    bounds: dict[str, Bound] = {}  # per-kind overrides of DECODE_BOUNDS
    prefill: PrefillMeasurement | None = None


class KindLine(BaseModel):
    kind: str
    measured_us: float
    bound: Bound
    ratio: float  # predicted / measured
    predicted_us: float


class CellPrediction(BaseModel):
    sessions: int
    context_tokens: int
    context_label: str
    speculative: str
    measured_step_us: float
    breakdown_basis: str
    kinds: list[KindLine]
    collectives_us: float
    collective_calls: int
    predicted_step_us: float
    tokens_per_step: float
    predicted_tok_s: float
    report_tok_s: float | None
    ratio_to_report: float | None  # predicted / report
    dominated_by: str
    label: str


class PrefillPrediction(BaseModel):
    prompt_tokens: int
    predicted_ttft_s: float
    collectives_s: float
    report_s: tuple[float, float] | None
    label: str


class NodePrediction(BaseModel):
    source: str
    stand_in: DeviceFigures
    target: DeviceFigures
    collective_model: str
    acceptance: str
    cells: list[CellPrediction]
    prefill: list[PrefillPrediction]
    notes: list[str]


def load_measured_run(path: str | Path) -> MeasuredRun:
    """A `MeasuredRun` JSON file; `rank_sim` records in it are read and turned into cells."""
    try:
        run = MeasuredRun.model_validate(json.loads(Path(path).read_text()))
        if run.rank_sim:
            from glmctl.plan.rank_sim_records import with_rank_sim_records

            run = with_rank_sim_records(run, Path(path).parent)
        return run
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read the measured run {path}: {exc}") from exc
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"{path}: {where}: {first['msg']}",
                          hint="see glmctl.plan.node_prediction.MeasuredRun for the schema") from exc


def decode_step_collectives(model: ModelSpec, tp: int, sessions: int, num_spec: int) -> list[Collective]:
    """The collectives one decode (verify) step makes on each rank of a TP-`tp` node, bf16 payloads:
    per layer the attention o_proj and the MLP/MoE output all-reduce (row-parallel), one for the
    vocab-parallel embedding, the logits all-gather; each MTP draft pass repeats embedding, its
    layer's two, and the logits (first pass over every verified token, later ones one per sequence)."""
    tokens = sessions * (1 + num_spec)
    row = model.hidden_size * 2
    vocab_rank = -(-model.vocab_size // 64) * 64 // tp
    calls = [
        Collective(op="all_reduce", bytes=tokens * row, count=2 * model.num_hidden_layers + 1,
                   what="attention + MLP outputs, embedding"),
        Collective(op="all_gather", bytes=tokens * vocab_rank * 2, count=1, what="logits"),
    ]
    if num_spec:
        for label, n, passes in (("first draft pass", tokens, 1), ("later draft passes", sessions, num_spec - 1)):
            if passes:
                calls += [Collective(op="all_reduce", bytes=n * row, count=3 * passes, what=f"MTP {label}"),
                          Collective(op="all_gather", bytes=n * vocab_rank * 2, count=passes,
                                     what=f"MTP {label} logits")]
    return calls


def context_label(tokens: int) -> str:
    """The report's context column nearest to `tokens` (by ratio)."""
    return min(CONTEXT_LABELS, key=lambda k: abs(math.log(tokens / CONTEXT_LABELS[k])))


def _ratio(stand_in: DeviceFigures, target: DeviceFigures, bound: Bound) -> float:
    return 1.0 if bound == "launch" else stand_in.throughput(bound) / target.throughput(bound)


def scaled_kinds(breakdown: dict[str, float], bounds: dict[str, Bound], stand_in: DeviceFigures,
            target: DeviceFigures, factor: Callable[[str], float] = lambda kind: 1.0) -> list[KindLine]:
    lines = []
    for kind, us in breakdown.items():
        bound = bounds.get(kind, UNKNOWN_KIND_BOUND)
        r = _ratio(stand_in, target, bound) * factor(kind)
        lines.append(KindLine(kind=kind, measured_us=us, bound=bound, ratio=round(r, 4), predicted_us=us * r))
    return lines


def collectives_us(calls: list[Collective], ranks: int, time_model: CollectiveTimeModel) -> float:
    return sum(c.count * time_model(c.op, ranks, c.bytes, c.dtype) for c in calls) * 1e6


def default_collective_model() -> tuple[CollectiveTimeModel, str, str]:
    """(model, description, short name): the host-staged protocol's own cost model
    (`glmctl.collectives.cost_model.time`, the report's node links), else the fallback."""
    try:
        from glmctl.collectives import cost_model
    except ImportError:  # a control-plane install without the collectives package
        fallback = HostStagedFallback()
        return fallback, fallback.label, "the fallback model"
    return (cost_model.time, f"glmctl.collectives.cost_model: {cost_model.L40_NODE.name}; protocol costs "
            f"{cost_model.PROTOCOL_COSTS.source}", "glmctl.collectives.cost_model")


def predict_node(run: MeasuredRun, model: ModelSpec | None = None, target: DeviceFigures = L40_DATASHEET,
                 time_model: CollectiveTimeModel | None = None, collective_label: str | None = None) -> NodePrediction:
    """Predict each measured cell (and the prefill, when measured) on the TP node of `target` GPUs.
    `time_model`: seconds per collective call (default: `default_collective_model()`)."""
    model = model or load_model_spec("glm-5.3-flash")
    if time_model is None:
        time_model, label_model, short = default_collective_model()
    else:
        label_model = collective_label or getattr(time_model, "label", "the collective model given")
        short = "the fallback model" if isinstance(time_model, HostStagedFallback) else "the given model"
    bounds = {**DECODE_BOUNDS, **run.bounds}
    acceptance = {**REPORT_TOKENS_PER_STEP, **run.tokens_per_step}
    ref = run.reference
    if ref is None or not ref.breakdown_us:
        raise ConfigError("the reference cell has no breakdown_us", hint="measure one decode step by kind")
    ref_total = sum(ref.breakdown_us.values())
    cells = []
    for cell in [ref, *run.cells]:
        if cell.breakdown_us:
            breakdown, basis = cell.breakdown_us, "its own breakdown"
        elif cell.step_us:
            breakdown = {k: v / ref_total * cell.step_us for k, v in ref.breakdown_us.items()}
            basis = f"its measured step x the {ref.sessions} x {ref.context_tokens:,} breakdown's shares"
        else:
            raise ConfigError(f"cell {cell.sessions} x {cell.context_tokens:,} has neither step_us nor breakdown_us")
        spec = str(parse_speculative(cell.speculative))
        if spec not in acceptance:
            raise ConfigError(f"no tokens per step for {spec}", hint='add it to "tokens_per_step" (stated acceptance)')
        calls = cell.collectives or decode_step_collectives(model, run.tp, cell.sessions,
                                                            parse_speculative(spec).num_tokens)
        kinds = scaled_kinds(breakdown, bounds, run.device, target)
        coll = collectives_us(calls, run.tp, time_model)
        step = sum(k.predicted_us for k in kinds) + coll
        tok_s = cell.sessions * acceptance[spec] / (step * 1e-6)
        label_ctx = context_label(cell.context_tokens)
        report = REPORT_DECODE_CELLS.get((cell.sessions, label_ctx, spec))
        top = max(kinds, key=lambda k: k.predicted_us)
        dominant = ("collectives" if coll > top.predicted_us else top.kind)
        share = max(coll, top.predicted_us) / step
        cells.append(CellPrediction(
            sessions=cell.sessions, context_tokens=cell.context_tokens, context_label=label_ctx, speculative=spec,
            measured_step_us=sum(breakdown.values()), breakdown_basis=basis, kinds=kinds,
            collectives_us=round(coll, 1), collective_calls=sum(c.count for c in calls),
            predicted_step_us=round(step, 1), tokens_per_step=acceptance[spec], predicted_tok_s=round(tok_s, 1),
            report_tok_s=report, ratio_to_report=round(tok_s / report, 3) if report else None,
            dominated_by=f"{dominant} ({share:.0%})",
            label=(f"predicted (from the {run.device.name} rank step, {basis}; scaled to {target.name} "
                   f"{'datasheet' if target is L40_DATASHEET else 'figures'}; collectives from "
                   f"{short}; {acceptance[spec]:g} tokens/step "
                   "stated)"),
        ))
    from glmctl.plan.node_prefill import predict_prefill

    prefill = predict_prefill(run, model, target, time_model, short) if run.prefill else []
    notes = [
        f"stand-in figures: {run.device.source}",
        f"target figures: {target.source}",
        "the rank model's sampler sees its own vocabulary; on the node each rank gathers the full "
        f"{model.vocab_size:,}-token logits first, so the sampler's kinds (sampler, sampler_mtp) are an "
        "underestimate there",
        "launch_gaps are not scaled: in-graph launch latency is taken as equal on both GPUs",
    ]
    if run.device.fp8_tflops is None and any(b == "compute_fp8" for b in bounds.values()):
        notes.append(f"{run.device.name} FP8 throughput not measured: taken as twice its measured bf16")
    return NodePrediction(source=run.source, stand_in=run.device, target=target, collective_model=label_model,
                          acceptance=ACCEPTANCE_SOURCE if not run.tokens_per_step else "stated in the measured run",
                          cells=cells, prefill=prefill, notes=notes)
