"""The node prediction's records and constants: what a measured run holds (`MeasuredRun`), what
a prediction says (`NodePrediction`), the device figures they are scaled between, the report's
cells, and the per-kind scaling both the decode (`node_prediction`) and prefill (`node_prefill`)
predictions use. Pure pydantic: no torch, nothing measured here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

Bound = Literal["bandwidth", "compute_bf16", "compute_fp8", "launch", "roofline"]


class DeviceFigures(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    memory_bandwidth_gbps: float = Field(gt=0)  # GB/s (1e9)
    bf16_tflops: float = Field(gt=0)  # dense tensor throughput
    fp8_tflops: float | None = None  # None: twice bf16 (stated where used)
    source: str

    def throughput(self, bound: Bound) -> float:
        if bound in ("bandwidth", "roofline"):
            return self.memory_bandwidth_gbps
        if bound == "compute_fp8":
            return self.fp8_tflops or 2 * self.bf16_tflops
        return self.bf16_tflops


L40_DATASHEET = DeviceFigures(
    name="L40", memory_bandwidth_gbps=864.0, bf16_tflops=181.05, fp8_tflops=362.1,
    source="NVIDIA L40 datasheet: 864 GB/s GDDR6, 181 TFLOP/s dense BF16 and 362 dense FP8 tensor",
)
# The stand-in as measured on this workplace's nvidia-h200 machines (device-to-device copy through
# PyTorch, bytes read + written; 8192^3 bf16 matmul on random data), not in the rank-sim run itself.
H200_MEASURED_HERE = DeviceFigures(
    name="H200", memory_bandwidth_gbps=4300.0, bf16_tflops=788.0,
    source="H200 as measured on this workplace's nvidia-h200 machines (copy ~4.3 TB/s, bf16 matmul 788 TFLOP/s; "
           "not in the rank-sim run); FP8 not measured",
)

# What bounds each kind of a decode step (a few tokens per sequence: weights and caches are read
# once per step) and of a prefill chunk (thousands of tokens: GEMM and attention maths).
# Kinds as `bench/rank_sim.py` groups the profiler's kernels (dense_gemm, sampler, memcpy, other,
# gpu_idle_in_span) and as the issue names them (shared_dense_mlp, sampler_mtp, launch_gaps);
# host_between_steps is the measured step beyond the profiled kernel span (CPU-side scheduling).
_NOT_SCALED = ("launch_gaps", "gpu_idle_in_span", "host_between_steps")
# Decode kinds whose bytes `decode_bytes.step_bytes` models take the roofline (`roofline_us`):
# the bytes they must move at the target's bandwidth, or their stand-in time where that is longer
# (what did not run at bandwidth there: launch latency, issue, ALU). Small kernels between them
# (glue, activation, runner bookkeeping) are launch-bound.
ROOFLINE_KINDS = ("mla_attention", "indexer", "kda", "routed_experts", "fp8_linear", "dense_gemm", "norms_mhc")
DECODE_BOUNDS: dict[str, Bound] = {
    **{k: "roofline" for k in ROOFLINE_KINDS},
    **{k: "bandwidth" for k in ("shared_dense_mlp", "sampler_mtp", "sampler", "memcpy", "other")},
    **{k: "launch" for k in (*_NOT_SCALED, "torch_glue", "activation", "runner")},
}
# The roofline's two stated inputs. A device copy reaches this share of the target's datasheet
# bandwidth, taken as the stand-in's: the H200's measured ~4.3 TB/s of its datasheet 4.8 TB/s.
TARGET_COPY_EFFICIENCY = 4.3 / 4.8
# What a kind's stand-in time beyond its bandwidth floor becomes on the target: x1 (launch latency,
# taken as equal) down to x0.74 (issue-bound ALU work: an H200's 132 SMs x 1.98 GHz over an L40's
# 142 SMs x 2.49 GHz, datasheet boost clocks). The prediction takes x1; the range shows x0.74.
NON_BANDWIDTH_RATIO = 1.0
NON_BANDWIDTH_RATIO_LOW = (132 * 1.98) / (142 * 2.49)
# A prefill chunk's kinds whose FLOPs and bytes `prefill_work.chunk_work` models take the roofline
# too, their FLOPs at the target's tensor rate (the indexer's at the FP8 rate) beside their bytes.
PREFILL_BOUNDS: dict[str, Bound] = {
    **{k: "roofline" for k in ROOFLINE_KINDS},
    "shared_dense_mlp": "compute_bf16",
    **{k: "bandwidth" for k in ("sampler_mtp", "sampler", "memcpy", "other")},
    **{k: "launch" for k in (*_NOT_SCALED, "torch_glue", "activation", "runner")},
}
ROOFLINE_COMPUTE: dict[str, Bound] = {"indexer": "compute_fp8"}  # other roofline kinds: compute_bf16
# A tensor GEMM reaches this share of the target's datasheet rate, taken as the stand-in's: the
# H200's measured 788 TFLOP/s (8192^3 bf16) of its datasheet ~990.
TARGET_COMPUTE_EFFICIENCY = 788.0 / 990.0
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
    experts: str | None = None  # the rank model's experts variant (exl3, fp8, bf16); default the run's


class PrefillMeasurement(BaseModel):
    """Either one chunk's breakdown at a known context, or whole measured prefills (TTFT of one
    prompt; optionally of the last of several prompts arriving together). `ttft_basis` says which
    measured figure `ttft_s` is (e.g. the gap between consecutive first tokens of a queue)."""

    chunk_tokens: int = Field(2048, ge=1)  # max_num_batched_tokens: tokens per prefill step
    context_tokens: int | None = Field(None, ge=0)  # context cached before the measured chunk
    breakdown_us: dict[str, float] | None = None
    ttft_s: float | None = Field(None, gt=0)
    prompt_tokens: int | None = Field(None, ge=1)
    queue_ttft_s: float | None = Field(None, gt=0)  # the last prompt's TTFT
    queue_prompts: int = Field(8, ge=1)
    queue_prompt_tokens: int | None = Field(None, ge=1)
    allreduce_dtype: str = "int8"  # the report compresses the prefill all-reduce
    ttft_basis: str = "measured TTFT"
    queue_basis: str = "the last prompt's measured TTFT"

    @model_validator(mode="after")
    def _one_form(self) -> PrefillMeasurement:
        if self.breakdown_us is not None and self.context_tokens is None:
            raise ValueError("a chunk breakdown needs context_tokens")
        if self.breakdown_us is None and (self.ttft_s is None or self.prompt_tokens is None):
            raise ValueError("give breakdown_us + context_tokens, or ttft_s + prompt_tokens")
        return self


class WholeStepAssumption(BaseModel):
    """How a step measured whole (no breakdown) is scaled: a stated assumption, printed with every
    such cell (`glmctl.plan.prediction.node_whole_step`)."""

    model_config = ConfigDict(frozen=True)

    bound: Bound = "bandwidth"  # what the scaled share of the step is taken to be bound by
    scaled_share: float = Field(1.0, ge=0.0, le=1.0)  # the prediction's share; the rest is unscaled
    range_shares: tuple[float, float] = (0.0, 1.0)  # the sensitivity range's two ends

    @model_validator(mode="after")
    def _ordered(self) -> WholeStepAssumption:
        lo, hi = self.range_shares
        if not 0.0 <= lo <= hi <= 1.0:
            raise ValueError("range_shares must be two shares 0 <= low <= high <= 1")
        return self


class MeasuredRun(BaseModel):
    """The measurements, written by hand or from `bench/rank_sim.py` records: `rank_sim` names
    record files (relative to this file) or holds them; their cells, breakdown and TTFTs then fill
    `reference`, `cells` and `prefill` (`glmctl.plan.prediction.rank_sim_records`)."""

    source: str  # where the measurements come from (file, run, date)
    device: DeviceFigures  # the stand-in GPU's measured figures
    tp: int = 8
    reference: StepCell | None = None  # the cell with the full breakdown (the report: 8 x 240k, MTP-3)
    rank_sim: list[str | dict] = []
    cells: list[StepCell] = []
    tokens_per_step: dict[str, float] = {}  # by speculative method; default REPORT_TOKENS_PER_STEP
    bounds: dict[str, Bound] = {}  # per-kind overrides of DECODE_BOUNDS
    experts: str = "exl3"  # the rank model's experts variant, for the roofline's bytes
    prefill: PrefillMeasurement | None = None
    whole_step: WholeStepAssumption = WholeStepAssumption()  # cells measured whole, when no breakdown exists


class KindLine(BaseModel):
    kind: str
    measured_us: float
    bound: Bound
    ratio: float  # predicted / measured
    predicted_us: float
    bytes: float | None = None  # roofline kinds: the bytes the kind must move per step (or chunk)
    flops: float | None = None  # roofline kinds of a prefill chunk: the FLOPs it must do
    floor_us: float | None = None  # roofline kinds: the longer of those bytes and FLOPs at the target's rates


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
    # cells measured whole: tok/s at the range's two shares, and the share the report's cell implies
    range_tok_s: tuple[float, float] | None = None
    range_shares: tuple[float, float] | None = None
    report_implied_share: float | None = None


class PrefillPrediction(BaseModel):
    prompt_tokens: int
    predicted_ttft_s: float
    collectives_s: float
    report_s: tuple[float, float] | None
    label: str
    range_s: tuple[float, float] | None = None  # whole measured TTFTs: nothing scaled .. all scaled


class NodePrediction(BaseModel):
    source: str
    stand_in: DeviceFigures
    target: DeviceFigures
    collective_model: str
    acceptance: str
    cells: list[CellPrediction]
    prefill: list[PrefillPrediction]
    notes: list[str]


def bound_ratio(stand_in: DeviceFigures, target: DeviceFigures, bound: Bound) -> float:
    """Target time / stand-in time for work bound by `bound` (launch latency: 1)."""
    return 1.0 if bound == "launch" else stand_in.throughput(bound) / target.throughput(bound)


def roofline_us(measured_us: float, nbytes: float, target: DeviceFigures,
                other_ratio: float = NON_BANDWIDTH_RATIO, flops: float = 0.0,
                compute: Bound = "compute_bf16") -> tuple[float, float]:
    """(predicted µs, floor µs): the floor is the longer of the bytes at the target's copy
    bandwidth and the FLOPs at its tensor rate (`compute`); the prediction is the floor, or the
    stand-in's time x `other_ratio` where that is longer."""
    floor = nbytes / (target.memory_bandwidth_gbps * 1e9 * TARGET_COPY_EFFICIENCY) * 1e6
    if flops:
        floor = max(floor, flops / (target.throughput(compute) * 1e12 * TARGET_COMPUTE_EFFICIENCY) * 1e6)
    return max(floor, measured_us * other_ratio), floor


def scaled_kinds(breakdown: dict[str, float], bounds: dict[str, Bound], stand_in: DeviceFigures,
                 target: DeviceFigures, factor: Callable[[str], float] = lambda kind: 1.0,
                 work: dict[str, tuple[float, float]] | None = None,
                 other_ratio: float = NON_BANDWIDTH_RATIO) -> list[KindLine]:
    """Each kind scaled by what bounds it. A roofline kind takes its modelled `work` (FLOPs, bytes;
    `factor` scales its stand-in time, e.g. with the context); one without modelled work is scaled
    as bandwidth-bound (its whole stand-in time by the bandwidth ratio)."""
    lines = []
    for kind, us in breakdown.items():
        bound = bounds.get(kind, UNKNOWN_KIND_BOUND)
        flops, nbytes = (work or {}).get(kind, (0.0, 0.0))
        if bound == "roofline" and (flops or nbytes):
            stand_in_us = us * factor(kind)
            predicted, floor = roofline_us(stand_in_us, nbytes, target, other_ratio, flops,
                                           ROOFLINE_COMPUTE.get(kind, "compute_bf16"))
            lines.append(KindLine(kind=kind, measured_us=us, bound=bound, ratio=round(predicted / us, 4) if us else 1.0,
                                  predicted_us=predicted, bytes=nbytes, flops=flops or None, floor_us=round(floor, 1)))
            continue
        if bound == "roofline":
            bound = "bandwidth"
        r = bound_ratio(stand_in, target, bound) * factor(kind)
        lines.append(KindLine(kind=kind, measured_us=us, bound=bound, ratio=round(r, 4), predicted_us=us * r))
    return lines


def collectives_us(calls: list[Collective], ranks: int, time_model: CollectiveTimeModel) -> float:
    return sum(c.count * time_model(c.op, ranks, c.bytes, c.dtype) for c in calls) * 1e6


