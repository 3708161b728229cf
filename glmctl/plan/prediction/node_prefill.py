"""Predicted 8x L40 prefill (time to first token) from a rank's prefill measured on a stand-in GPU.

Two measurement forms (`PrefillMeasurement`):
- one chunk's breakdown at a known context: each chunk of the prompt is that chunk with every kind
  scaled by its bound (`PREFILL_BOUNDS`) and the indexer grown with the context already cached
  (it scores every pooled key; sparse MLA reads a fixed top-k; KDA and the MLPs do not look back);
- whole measured TTFTs: the longer of the stand-in's time and the target's floor for the same
  chunks (`floor_s`: every modelled kind's FLOPs or bytes at its context, summed), with the range
  up to the stand-in's time scaled by the tensor-throughput ratio (all of it compute-bound); a
  prompt (or queue) of another length than the report's is extrapolated linearly in chunks
  (assumed: a chunk costs the same at any context) and says so.
Either way every chunk adds the node's all-reduces (two per layer and the embedding's, INT8 as
the report runs them) from the collective model; the rank model runs none.
"""

from __future__ import annotations

from glmctl.plan.model import ModelSpec
from glmctl.plan.prediction.node_records import (
    PREFILL_BOUNDS,
    PREFILL_CONTEXT_LINEAR,
    REPORT_PREFILL_256K_S,
    REPORT_QUEUE_8X227K_S,
    ROOFLINE_COMPUTE,
    TARGET_COMPUTE_EFFICIENCY,
    TARGET_COPY_EFFICIENCY,
    Collective,
    CollectiveTimeModel,
    DeviceFigures,
    MeasuredRun,
    PrefillPrediction,
    collectives_us,
    roofline_us,
    scaled_kinds,
)
from glmctl.plan.prediction.prefill_work import chunk_work

REPORT_QUEUE_PROMPT_TOKENS = 227_000
REPORT_SINGLE_PROMPT_TOKENS = 256_000  # the report's "256k prompt" (bench/rank_sim.py's --prefill-256k)


def _chunk_collectives_s(run: MeasuredRun, model: ModelSpec, time_model: CollectiveTimeModel) -> float:
    p = run.prefill
    calls = [Collective(op="all_reduce", bytes=p.chunk_tokens * model.hidden_size * 2,
                        count=2 * model.num_hidden_layers + 1, dtype=p.allreduce_dtype)]
    return collectives_us(calls, run.tp, time_model) * 1e-6


def _chunks(tokens: int, chunk: int) -> int:
    return -(-tokens // chunk)


def predict_prefill(run: MeasuredRun, model: ModelSpec, target: DeviceFigures, time_model: CollectiveTimeModel,
                    collectives_from: str) -> list[PrefillPrediction]:
    p = run.prefill
    assert p is not None
    chunk_coll = _chunk_collectives_s(run, model, time_model)
    if p.breakdown_us is not None:
        return _from_chunk(run, model, target, chunk_coll, collectives_from)
    ratio = run.device.throughput("compute_bf16") / target.throughput("compute_bf16")
    basis = (f"predicted (from the {run.device.name}'s {p.ttft_basis}: the longer of that time and the "
             f"{target.name}'s floor for the same chunks (each kind's FLOPs and bytes at its context, "
             f"glmctl.plan.prediction.prefill_work, at {TARGET_COMPUTE_EFFICIENCY:.0%} of its tensor rate and "
             f"{TARGET_COPY_EFFICIENCY:.0%} of its bandwidth; the {run.device.name} ran far above its own floor, so "
             f"its time is taken as what bounds it; range up to x{ratio:.2f}, all of it compute-bound); "
             f"+ {p.allreduce_dtype} all-reduces per {p.chunk_tokens}-token chunk from {collectives_from}")
    chunks = _chunks(p.prompt_tokens, p.chunk_tokens)
    single = REPORT_SINGLE_PROMPT_TOKENS
    out = [_whole(p.ttft_s, chunks, _chunks(single, p.chunk_tokens), single, f"{p.prompt_tokens:,}-token prompt",
                  ratio, chunk_coll, REPORT_PREFILL_256K_S, basis, floor_s(run, model, target, single))]
    if p.queue_ttft_s is not None and p.queue_prompt_tokens is not None:
        measured = p.queue_prompts * _chunks(p.queue_prompt_tokens, p.chunk_tokens)
        wanted = 8 * _chunks(REPORT_QUEUE_PROMPT_TOKENS, p.chunk_tokens)
        queue_basis = basis.replace(p.ttft_basis, p.queue_basis)
        out.append(_whole(p.queue_ttft_s, measured, wanted, 8 * REPORT_QUEUE_PROMPT_TOKENS,
                          f"queue of {p.queue_prompts} x {p.queue_prompt_tokens:,}-token prompts", ratio, chunk_coll,
                          (REPORT_QUEUE_8X227K_S,) * 2,
                          queue_basis + f"; the last of 8 prompts of {REPORT_QUEUE_PROMPT_TOKENS:,} tokens",
                          8 * floor_s(run, model, target, REPORT_QUEUE_PROMPT_TOKENS)))
    return out


def floor_s(run: MeasuredRun, model: ModelSpec, target: DeviceFigures, prompt: int) -> float:
    """Seconds the target needs at least for one prompt's chunks: every modelled kind's FLOPs or
    bytes at that chunk's context, whichever takes longer, summed (nothing overlapped)."""
    total = 0.0
    for start in range(0, prompt, run.prefill.chunk_tokens):
        work = chunk_work(model, start, run.prefill.chunk_tokens, variant=run.experts, tp=run.tp)
        total += sum(roofline_us(0.0, nbytes, target, flops=flops, compute=ROOFLINE_COMPUTE.get(kind, "compute_bf16"))[1]
                     for kind, (flops, nbytes) in work.items())
    return total * 1e-6


def _whole(measured_s: float, measured_chunks: int, wanted_chunks: int, wanted_tokens: int, measured_what: str,
           ratio: float, chunk_coll: float, report: tuple[float, float], basis: str,
           floor: float) -> PrefillPrediction:
    """A whole measured prefill of `measured_chunks` chunks, extrapolated to `wanted_chunks` when they
    differ (linear in chunks, said in the label): the longer of it and the target's `floor`, range up
    to it x `ratio` (all compute-bound)."""
    stand_in_s = measured_s * wanted_chunks / measured_chunks
    label = basis if measured_chunks == wanted_chunks else (
        basis + f"; extrapolated linearly in chunks from the measured {measured_what} ({measured_s:g} s, "
                f"{measured_chunks} chunks -> {wanted_chunks}; assumed: a chunk costs the same at any context)")
    coll = wanted_chunks * chunk_coll
    label += f"; the {floor:.1f} s floor"
    predicted = max(stand_in_s, floor) + coll
    return PrefillPrediction(prompt_tokens=wanted_tokens, predicted_ttft_s=round(predicted, 1),
                             collectives_s=round(coll, 1), report_s=report, label=label + ")",
                             range_s=(round(predicted, 1), round(max(stand_in_s * ratio, floor) + coll, 1)))


def _from_chunk(run: MeasuredRun, model: ModelSpec, target: DeviceFigures, chunk_coll: float,
                collectives_from: str) -> list[PrefillPrediction]:
    """Each chunk of the prompt: the measured chunk's kinds, a roofline kind at the larger of its
    FLOPs and bytes at that chunk's context (`prefill_work.chunk_work`) on the target and its
    stand-in time (the indexer's grown with the context), the others by their bound."""
    p = run.prefill
    bounds = {**PREFILL_BOUNDS, **run.bounds}

    def ttft(prompt: int) -> tuple[float, float]:
        total = coll = 0.0
        for start in range(0, prompt, p.chunk_tokens):
            grow = (start + p.chunk_tokens / 2) / (p.context_tokens + p.chunk_tokens / 2)
            work = chunk_work(model, start, p.chunk_tokens, variant=run.experts, tp=run.tp)
            kinds = scaled_kinds(p.breakdown_us, bounds, run.device, target,
                                 lambda kind, grow=grow: grow if kind in PREFILL_CONTEXT_LINEAR else 1.0, work=work)
            total += sum(k.predicted_us for k in kinds) * 1e-6 + chunk_coll
            coll += chunk_coll
        return total, coll

    basis = (f"predicted (from one {p.chunk_tokens}-token {run.device.name} chunk at {p.context_tokens:,} context; "
             f"roofline per kind: its FLOPs and bytes at each chunk's context (glmctl.plan.prediction.prefill_work) "
             f"at {TARGET_COMPUTE_EFFICIENCY:.0%} of the {target.name}'s tensor rate and {TARGET_COPY_EFFICIENCY:.0%} "
             f"of its bandwidth, or its {run.device.name} time (the indexer's grown with the context) where that is "
             f"longer; {p.allreduce_dtype} collectives from {collectives_from})")
    one, one_coll = ttft(262_144)
    queue, queue_coll = ttft(REPORT_QUEUE_PROMPT_TOKENS)
    return [
        PrefillPrediction(prompt_tokens=262_144, predicted_ttft_s=round(one, 1), collectives_s=round(one_coll, 1),
                          report_s=REPORT_PREFILL_256K_S, label=basis),
        PrefillPrediction(prompt_tokens=8 * REPORT_QUEUE_PROMPT_TOKENS, predicted_ttft_s=round(8 * queue, 1),
                          collectives_s=round(8 * queue_coll, 1), report_s=(REPORT_QUEUE_8X227K_S,) * 2,
                          label=basis + "; eight ~227k prompts prefilled one after another"),
    ]
