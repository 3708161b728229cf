"""Predict the 8x L40 node's decode and prefill from one rank's step measured on another GPU.

Input (`MeasuredRun`, a JSON file): a per-rank step of the rank model (`glmctl.plan.prediction.rank`) measured
on a stand-in GPU (the H200), broken down by kind (kind -> µs), with the stand-in's memory
bandwidth and tensor throughput, for sessions x context cells. A cell that has only a measured
step time takes the reference breakdown's shares; when no cell has a breakdown, every step is
scaled whole by a stated assumption with its range (`glmctl.plan.prediction.node_whole_step`).

Each kind is scaled by the ratio of the resource that bounds it (`Bound`): memory bandwidth for
bandwidth-bound kinds (stand-in measured / L40 datasheet), tensor throughput for compute-bound ones,
nothing for launch gaps (kernel-launch latency inside a CUDA graph is the GPU front end's, taken as
equal). The rank model runs no collectives; the node's are added from the model's own call list
(`decode_collectives.decode_step_collectives`: two all-reduces per layer, the vocab-parallel embedding's all-reduce,
the logits all-gather, and for each MTP draft pass its layer's all-reduces and its draft tokens' (max,
index) gather) timed by a `CollectiveTimeModel`
(default: `glmctl.collectives.cost_model.time`, the host-staged protocol's model of the node).
Tokens per second = sessions x tokens per step / step time, with tokens per step a stated
acceptance, never a measurement (random weights make the measured acceptance meaningless).

The L40 figures are datasheet peaks, so a kind scaled by them assumes the L40 reaches its peak as
well as the stand-in reached its measured figure: every predicted cell names what it rests on.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from glmctl.errors import ConfigError
from glmctl.plan.model import ModelSpec, load_model_spec
from glmctl.plan.prediction import node_whole_step as whole
from glmctl.plan.prediction.decode_bytes import step_bytes
from glmctl.plan.prediction.decode_collectives import decode_step_collectives
from glmctl.plan.prediction.node_records import (
    ACCEPTANCE_SOURCE,
    CONTEXT_LABELS,
    DECODE_BOUNDS,
    L40_DATASHEET,
    NON_BANDWIDTH_RATIO_LOW,
    REPORT_DECODE_CELLS,
    REPORT_TOKENS_PER_STEP,
    TARGET_COPY_EFFICIENCY,
    CellPrediction,
    CollectiveTimeModel,
    DeviceFigures,
    KindLine,
    MeasuredRun,
    NodePrediction,
    StepCell,
    bound_ratio,
    collectives_us,
    roofline_us,
    scaled_kinds,
)
from glmctl.plan.serving_setup import parse_speculative


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


def load_measured_run(path: str | Path) -> MeasuredRun:
    """A `MeasuredRun` JSON file; `rank_sim` records in it are read and turned into cells."""
    try:
        run = MeasuredRun.model_validate(json.loads(Path(path).read_text()))
        if run.rank_sim:
            from glmctl.plan.prediction.rank_sim_records import with_rank_sim_records

            run = with_rank_sim_records(run, Path(path).parent)
        return run
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read the measured run {path}: {exc}") from exc
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"{path}: {where}: {first['msg']}",
                          hint="see glmctl.plan.prediction.node_prediction.MeasuredRun for the schema") from exc


def context_label(tokens: int) -> str:
    """The report's context column nearest to `tokens` (by ratio)."""
    return min(CONTEXT_LABELS, key=lambda k: abs(math.log(tokens / CONTEXT_LABELS[k])))


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
    measured = [c for c in ([ref] if ref is not None else []) + run.cells]
    if not measured:
        raise ConfigError("the measured run has no cells", hint="give a reference cell or cells with step_us")
    shares_of = ref if ref is not None and ref.breakdown_us else None
    cells = []
    for cell in measured:
        spec = str(parse_speculative(cell.speculative))
        if spec not in acceptance:
            raise ConfigError(f"no tokens per step for {spec}", hint='add it to "tokens_per_step" (stated acceptance)')
        calls = cell.collectives or decode_step_collectives(model, run.tp, cell.sessions,
                                                            parse_speculative(spec).num_tokens)
        coll = collectives_us(calls, run.tp, time_model)
        need = {kind: (0.0, nbytes) for kind, nbytes in step_bytes(
            model, cell.sessions, cell.context_tokens, parse_speculative(spec).num_tokens,
            cell.experts or run.experts, run.tp).items()}
        kinds, basis, extra = _cell_kinds(cell, shares_of, bounds, run, target, coll, acceptance[spec], spec, need)
        step = sum(k.predicted_us for k in kinds) + coll
        tok_s = cell.sessions * acceptance[spec] / (step * 1e-6)
        roofline_range = {}
        if not extra and any(k.bound == "roofline" for k in kinds):
            fast = sum(k.predicted_us if k.bound != "roofline" else
                       roofline_us(k.measured_us, k.bytes, target, NON_BANDWIDTH_RATIO_LOW)[0] for k in kinds) + coll
            roofline_range = {"range_tok_s": (round(tok_s, 1),
                                              round(cell.sessions * acceptance[spec] / (fast * 1e-6), 1))}
        label_ctx = context_label(cell.context_tokens)
        report = REPORT_DECODE_CELLS.get((cell.sessions, label_ctx, spec))
        if extra and report:
            extra["report_implied_share"] = _rounded(whole.share_for(
                report, cell.step_us, bound_ratio(run.device, target, run.whole_step.bound), coll,
                cell.sessions, acceptance[spec]))
        top = max(kinds, key=lambda k: k.predicted_us)
        dominant = ("collectives" if coll > top.predicted_us else
                    "the step, measured whole" if extra else top.kind)
        share = max(coll, step - coll if extra else top.predicted_us) / step
        cells.append(CellPrediction(
            sessions=cell.sessions, context_tokens=cell.context_tokens, context_label=label_ctx, speculative=spec,
            measured_step_us=sum(k.measured_us for k in kinds), breakdown_basis=basis, kinds=kinds,
            collectives_us=round(coll, 1), collective_calls=sum(c.count for c in calls),
            predicted_step_us=round(step, 1), tokens_per_step=acceptance[spec], predicted_tok_s=round(tok_s, 1),
            report_tok_s=report, ratio_to_report=round(tok_s / report, 3) if report else None,
            dominated_by=f"{dominant} ({share:.0%})",
            label=(f"predicted (from the {run.device.name} rank step, {basis}; "
                   + (f"roofline per kind: its bytes at the {target.name}'s bandwidth or its {run.device.name} "
                      "time, the longer; " if roofline_range else "")
                   + f"scaled to {target.name} "
                   f"{'datasheet' if target is L40_DATASHEET else 'figures'}; collectives from "
                   f"{short}; {acceptance[spec]:g} tokens/step "
                   "stated)"),
            **extra, **roofline_range,
        ))
    from glmctl.plan.prediction.node_prefill import predict_prefill

    prefill = predict_prefill(run, model, target, time_model, short) if run.prefill else []
    notes = [
        f"stand-in figures: {run.device.source}",
        f"target figures: {target.source}",
        "the rank model's sampler sees its own vocabulary; on the node each rank gathers the full "
        f"{model.vocab_size:,}-token logits first, so the sampler's kinds (sampler, sampler_mtp) are an "
        "underestimate there",
        "launch_gaps are not scaled: in-graph launch latency is taken as equal on both GPUs",
        f"roofline kinds ({', '.join(k for k, b in bounds.items() if b == 'roofline')}): predicted = the larger of "
        f"the bytes each must move per step (glmctl.plan.prediction.decode_bytes, {run.experts} experts) at "
        f"{TARGET_COPY_EFFICIENCY:.0%} of the {target.name}'s datasheet bandwidth (the stand-in's measured copy "
        f"share, assumed) and its {run.device.name} time (what did not run at bandwidth there: launch latency, "
        f"issue, ALU; taken as equal; the range's fast end takes it x{NON_BANDWIDTH_RATIO_LOW:.2f}, the SM count x "
        "boost clock ratio, for ALU-bound work); torch glue, activation and runner kernels are launch-bound",
    ]
    if shares_of is None:
        notes.append("no breakdown was measured: every step is scaled whole by the stated assumption "
                     f"({whole.describe(run.whole_step, run.device, target)}); the range and the share the "
                     "report's cell implies show how much each cell rests on it")
    if run.device.fp8_tflops is None and any(b == "compute_fp8" for b in bounds.values()):
        notes.append(f"{run.device.name} FP8 throughput not measured: taken as twice its measured bf16")
    return NodePrediction(source=run.source, stand_in=run.device, target=target, collective_model=label_model,
                          acceptance=ACCEPTANCE_SOURCE if not run.tokens_per_step else "stated in the measured run",
                          cells=cells, prefill=prefill, notes=notes)


def _rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _cell_kinds(cell: StepCell, shares_of: StepCell | None, bounds: dict, run: MeasuredRun, target: DeviceFigures,
                coll: float, tokens_per_step: float, spec: str,
                need: dict[str, tuple[float, float]]) -> tuple[list[KindLine], str, dict]:
    """The cell's kinds scaled to the target, the basis in words, and (cells measured whole) the
    range fields of `CellPrediction`."""
    where = f"cell {cell.sessions} x {cell.context_tokens:,} {spec}"
    if cell.breakdown_us:
        return scaled_kinds(cell.breakdown_us, bounds, run.device, target, work=need), "its own breakdown", {}
    if not cell.step_us:
        raise ConfigError(f"{where} has neither step_us nor breakdown_us")
    if shares_of is not None:
        total = sum(shares_of.breakdown_us.values())
        breakdown = {k: v / total * cell.step_us for k, v in shares_of.breakdown_us.items()}
        basis = f"its measured step x the {shares_of.sessions} x {shares_of.context_tokens:,} breakdown's shares"
        return scaled_kinds(breakdown, bounds, run.device, target, work=need), basis, {}
    a = run.whole_step
    r = bound_ratio(run.device, target, a.bound)
    ends = tuple(round(whole.tok_s_at(s, cell.step_us, r, coll, cell.sessions, tokens_per_step), 1)
                 for s in reversed(a.range_shares))  # slowest first: the most scaled share
    return (whole.whole_step_kinds(cell.step_us, a, run.device, target), whole.describe(a, run.device, target),
            {"range_tok_s": ends, "range_shares": tuple(reversed(a.range_shares))})
