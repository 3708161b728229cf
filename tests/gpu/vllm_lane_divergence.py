"""Reading a gpu-lane run (`vllm_lane_runs.LaneRun`), and where two greedy runs of one request part.

Pairs compared (`divergence_pairs`): CUDA graphs (FULL, PIECEWISE) against eager, each prompt
alone and the eager-vs-graphs question's two prompts batched; graphs alone against graphs batched
(a plan or workspace chosen per captured batch size would show there); eager alone against
batched (the same question without graphs); every prompt alone against all eight in one batch,
eager and FULL graphs (`batch_invariance`); the EXL3 checkpoint graphed against eager; MTP-3's
natural and steered runs against plain decoding of four copies. Where a pair parts off
transformers' own fp32 greedy path, its top-2 at the shared prefix is asked for in stage C
(`probe_requests`); `classify` then applies the noise-floor rule (tests/vllm/noise_floor.py).
"""

from __future__ import annotations

from tests.gpu.vllm_lane_runs import ISSUE_PAIR, LaneRun
from tests.vllm import noise_floor as nf

GRAPH_RUNS = ("graphs_full", "graphs_piecewise")


class NotRun(Exception):
    pass


# -- access -------------------------------------------------------------------------------


def engine(run: LaneRun, label: str) -> dict:
    report = run.engines.get(label)
    if report is None:
        raise NotRun(f"not run: no {label} engine")
    if "error" in report:
        msg = report["error"]
        raise NotRun(msg if msg.startswith("not run") else f"{label} engine failed: {msg}")
    return report["engines"][label]


def reference(run: LaneRun, label: str = "bf16") -> dict:
    report = run.references.get(label)
    if report is None or "error" in (report or {}):
        raise NotRun(f"not run: transformers reference {label}: {(report or {}).get('error', 'missing')}")
    return report["checkpoints"][label] if "checkpoints" in report else report


def steps_tokens(steps: list[dict]) -> list[int]:
    return [s["token"] for s in steps]


def margins(ref_steps: list[dict]) -> list[tuple]:
    """(token, top-1 margin, routing gap) per reference step (the gap None in older records)."""
    return [(s["token"], s["top"][0][1] - s["top"][1][1], s.get("routing_gap")) for s in ref_steps]


def floor(run: LaneRun) -> float:
    ref = reference(run)
    return nf.greedy_floor(ref["float32"], ref["bfloat16"])


# -- divergences between two greedy runs ---------------------------------------------------

def prefix_key(name: str, tokens: list[int]) -> str:
    return f"{name}|{','.join(map(str, tokens))}"


def _reference_step(run: LaneRun, checkpoint: str, name: str, shared: list[int]):
    """transformers fp32 after prompt + `shared`: (top-2, routing gap or None), from its greedy
    path when `shared` is on it, else from the probes of stage C; None when neither has it."""
    if checkpoint == "bf16":
        ref_steps = reference(run).get("greedy", {}).get(name, [])
        i = len(shared)
        if i < len(ref_steps) and steps_tokens(ref_steps[:i]) == shared:
            return tuple(tuple(x) for x in ref_steps[i]["top"]), ref_steps[i].get("routing_gap")
    probes = run.probes.get(checkpoint)
    if isinstance(probes, dict) and "error" not in probes:
        probe = probes.get(prefix_key(name, shared))
        if isinstance(probe, dict):
            return tuple(tuple(x) for x in probe["top"]), probe.get("routing_gap")
        if probe is not None:  # a record of the top-2 alone
            return tuple(tuple(x) for x in probe), None
    return None


def _reference_top2(run: LaneRun, checkpoint: str, name: str, shared: list[int]):
    step = _reference_step(run, checkpoint, name, shared)
    return None if step is None else step[0]


def divergence_pairs(run: LaneRun) -> list[tuple[str, str, str, str, list, list]]:
    """(checkpoint, what, prompt, label, first run's steps, second run's steps) of every pair of
    greedy runs the cases compare."""
    pairs = []

    def add(ckpt, what, a_label, a_kind, b_label, b_kind, names):
        try:
            a, b = engine(run, a_label)["greedy"], engine(run, b_label)["greedy"]
        except NotRun:
            return
        for name in names:
            sa, sb = _runs(a, a_kind, name), _runs(b, b_kind, name)
            if sa is not None and sb is not None:
                pairs.append((ckpt, what, name, f"{a_label}:{a_kind} vs {b_label}:{b_kind}", sa, sb))

    names = list(run.prompts)
    for g in GRAPH_RUNS:
        add("bf16", g, "eager", "alone", g, "alone", names)
        add("bf16", g, "eager", "batch", g, "batch", ISSUE_PAIR)
        add("bf16", g, g, "alone", g, "batch", ISSUE_PAIR)
    add("bf16", "eager", "eager", "alone", "eager", "batch", ISSUE_PAIR)
    for label in ("eager", "graphs_full"):
        add("bf16", "batch_invariance", label, "alone", label, "batch8", names)
    add("exl3_deq", "exl3", "exl3_eager", "alone", "exl3_graphs", "alone", names)
    add("exl3_deq", "exl3", "exl3_eager", "batch", "exl3_graphs", "batch", ISSUE_PAIR)
    try:
        plain, mtp = engine(run, "graphs_full")["greedy"]["copies4"], engine(run, "mtp3")["mtp"]
        for kind in ("natural", "oracle"):
            for name, steps in mtp[kind].items():
                if name in plain:
                    pairs.append(("bf16", "mtp3", name, f"graphs_full:copies4 vs mtp3:{kind}", plain[name], steps))
    except NotRun:
        pass
    return pairs


def _runs(greedy: dict, kind: str, name: str):
    if kind == "alone":
        return greedy.get("alone", {}).get(name)
    if kind == "batch":
        return greedy.get("batches", {}).get("+".join(ISSUE_PAIR), {}).get(name)
    if kind == "batch8":  # the batch of every prompt run alone
        every = "+".join(greedy.get("alone", {}))
        return greedy.get("batches", {}).get(every, {}).get(name) if len(greedy.get("alone", {})) > 2 else None
    return greedy.get(kind, {}).get(name)


def first_part(a: list[dict], b: list[dict]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x["token"] != y["token"]), None)


def probe_requests(run: LaneRun) -> dict[str, dict[str, list[int]]]:
    """Stage C: the prefixes (prompt + shared tokens) at which two runs part and transformers'
    top-2 is not known yet, by checkpoint."""
    out: dict[str, dict[str, list[int]]] = {}
    for ckpt, _what, name, _label, a, b in divergence_pairs(run):
        i = first_part(a, b)
        if i is None or ckpt not in run.checkpoints:
            continue
        shared = steps_tokens(a[:i])
        try:
            if _reference_top2(run, ckpt, name, shared) is not None:
                continue
        except NotRun:
            pass
        out.setdefault(ckpt, {})[prefix_key(name, shared)] = list(run.prompts[name]) + shared
    return out


def classify(run: LaneRun, what: str) -> list[tuple[str, nf.Divergence]]:
    fl = floor(run)
    out = []
    for ckpt, kind, name, label, a, b in divergence_pairs(run):
        if kind != what:
            continue
        i = first_part(a, b)
        step = _reference_step(run, ckpt, name, steps_tokens(a[:i])) if i is not None else None
        top2, gap = step if step is not None else (None, None)
        out.append((label, nf.classify_divergence(name, a, b, fl, top2, f"transformers fp32 ({ckpt})",
                                                  routing_gap=gap)))
    return out


def divergence_text(found: list[tuple[str, nf.Divergence]]) -> tuple[list[str], list[str]]:
    """(one line per parting, the defects among them)."""
    lines, defects = [], []
    for label, d in found:
        if d.kind == "same":
            continue
        line = f"{label} {d.prompt}: parts at step {d.step}, {d.kind} ({d.reason})"
        lines.append(line)
        if d.kind == "defect":
            defects.append(line)
    return lines, defects


