"""Turn `bench/rank_sim.py` records (one JSON per served variant) into a `MeasuredRun`'s cells.

A record holds, per sessions x context cell, the step time from vLLM's counters (`step_ms`: one
verify step per rank, drafts included) and, for the profiled cell, kernel time per kind per engine
iteration (`breakdown.us_per_iteration`, GPU idle inside the span included). The measured step
beyond that span is CPU-side time between engine iterations; it is kept as its own kind,
`host_between_steps`, which is not scaled. Records without a profiled cell give cells measured
whole (`glmctl.plan.prediction.node_whole_step` scales them). TTFTs: `prefill_ttft_256k_s` (one prompt on an
idle server) and the largest TTFT of an eight-session long-context cell (the report's queue);
without the 256k prompt, the longest-context multi-session cell whose every session got a first
token: the median gap between consecutive first tokens is one prompt's prefill (vLLM prefills
the queued prompts one at a time, each chunk beside the running sessions' decode), and its last
first token is the queue. Records carry no GPU figures: the measured run that lists them states
its `device`.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from glmctl.errors import ConfigError
from glmctl.plan.prediction.node_records import MeasuredRun, PrefillMeasurement, StepCell

QUEUE_MIN_CONTEXT = 200_000
SINGLE_PROMPT_TOKENS = 256_000  # rank_sim.py's --prefill-256k prompt


def _record(entry: str | dict, base: Path) -> dict:
    if isinstance(entry, dict):
        return entry
    path = base / entry
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read the rank-sim record {path}: {exc}") from exc


def cells_of(record: dict) -> list[StepCell]:
    mtp = int((record.get("settings") or {}).get("mtp") or 0)
    spec = f"mtp:{mtp}" if mtp else "none"
    cells = []
    for c in record.get("cells", []):
        if not c.get("step_ms"):
            continue  # skipped, failed, or no steady window
        step_us = float(c["step_ms"]) * 1e3
        kinds = (c.get("breakdown") or {}).get("us_per_iteration")
        breakdown = None
        if kinds:
            breakdown = {k: float(v) for k, v in kinds.items()}
            beyond = step_us - sum(breakdown.values())
            if beyond > 0:
                breakdown["host_between_steps"] = beyond
        cells.append(StepCell(sessions=int(c["sessions"]), context_tokens=int(c["context"]), speculative=spec,
                              step_us=step_us, breakdown_us=breakdown))
    return cells


def prefill_of(record: dict) -> PrefillMeasurement | None:
    chunk = int((record.get("settings") or {}).get("chunk") or 2048)
    single = record.get("prefill_ttft_256k_s")
    if not single:
        return _queue_gaps(record, chunk)
    queue = [c for c in record.get("cells", []) if c.get("sessions") == 8
             and int(c.get("context") or 0) >= QUEUE_MIN_CONTEXT and any(c.get("ttft_s") or [])]
    form = dict(chunk_tokens=chunk, ttft_s=float(single), prompt_tokens=SINGLE_PROMPT_TOKENS,
                ttft_basis="measured TTFT of one 256,000-token prompt on an idle server")
    if queue:
        form.update(queue_ttft_s=max(t for t in queue[0]["ttft_s"] if t), queue_prompts=8,
                    queue_prompt_tokens=int(queue[0]["context"]))
    return PrefillMeasurement(**form)


def _queue_gaps(record: dict, chunk: int) -> PrefillMeasurement | None:
    """Prefill from the longest-context cell of several sessions that all got a first token."""
    queued = [c for c in record.get("cells", []) if int(c.get("sessions") or 0) >= 2 and c.get("ttft_s")
              and all(t is not None for t in c["ttft_s"]) and not c.get("errors")]
    if not queued:
        return None
    cell = max(queued, key=lambda c: (int(c["context"]), int(c["sessions"])))
    ttfts = sorted(float(t) for t in cell["ttft_s"])
    gap = statistics.median(b - a for a, b in zip(ttfts, ttfts[1:], strict=False))
    where = f"{cell['sessions']} x {int(cell['context']):,} cell ({record.get('name', 'record')})"
    return PrefillMeasurement(
        chunk_tokens=chunk, ttft_s=round(gap, 2), prompt_tokens=int(cell["context"]),
        ttft_basis=f"median gap between consecutive first tokens of the {where}: one prompt's prefill",
        queue_ttft_s=ttfts[-1], queue_prompts=int(cell["sessions"]), queue_prompt_tokens=int(cell["context"]),
        queue_basis=f"last first token of the {where}")


def _reference_rank(cell: StepCell) -> tuple:
    """The report's breakdown cell first: 8 sessions, MTP-3, the longest context."""
    return (cell.sessions == 8, cell.speculative == "mtp:3", cell.context_tokens)


def with_rank_sim_records(run: MeasuredRun, base: Path) -> MeasuredRun:
    records = [_record(entry, base) for entry in run.rank_sim]
    cells = [cell for record in records for cell in cells_of(record)]
    profiled = [c for c in cells if c.breakdown_us]
    # without a profiled cell every cell is measured whole (no reference: scaled by the stated assumption)
    reference = run.reference or (max(profiled, key=_reference_rank) if profiled else None)
    if not cells and reference is None:
        names = ", ".join(str(r.get("name")) for r in records)
        raise ConfigError(f"no measured step in the rank-sim records ({names})",
                          hint="every cell was skipped, failed or had no steady window")
    prefill = run.prefill or _longest(p for p in map(prefill_of, records) if p is not None)
    return run.model_copy(update={"reference": reference, "cells": [*run.cells, *(c for c in cells if c is not reference)],
                                  "prefill": prefill, "rank_sim": []})


def _longest(found) -> PrefillMeasurement | None:
    """The measurement nearest the report's prompts: a measured 256k prompt first, else the longest."""
    found = list(found)
    return max(found, key=lambda p: (p.prompt_tokens == SINGLE_PROMPT_TOKENS, p.prompt_tokens), default=None)
