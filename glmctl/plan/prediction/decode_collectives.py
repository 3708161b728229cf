"""The collectives of one decode step on the tensor-parallel node: which calls the model makes
(`decode_step_collectives`, from its layer structure), and what they cost by the host-staged
protocol's own model (`decode_step_prediction`, `decode_levers`; `glmctl.collectives.cost_model`,
imported when called so that a control-plane install without the collectives package still plans).

    from glmctl.plan.prediction.decode_collectives import decode_step_prediction
    decode_step_prediction()   # [{"cell": "8x22k", "calls": 104, "ms": ..., "bound": ...}, ...]

Every figure here is *predicted*: the protocol's terms fitted on one H200 (the thread rig), the
node's links as stated inputs (`cost_model.L40_NODE`: 25 GB/s PCIe per GPU, 100 GB/s host memory,
the report's). A cell's context length does not change its collectives, only its sessions do.
"""

from __future__ import annotations

from collections import Counter

from glmctl.plan.model import ModelSpec, load_model_spec
from glmctl.plan.prediction.node_records import Collective

# The report's decode cells that the per-rank simulation measures: name -> sessions
DECODE_CELLS = (("8x22k", 8), ("1x64k", 1))


def decode_step_collectives(model: ModelSpec, tp: int, sessions: int, num_spec: int, *,
                            draft_argmax: bool = True) -> list[Collective]:
    """The collectives one decode (verify) step makes on each rank of a TP-`tp` node, bf16 payloads:
    per layer the attention o_proj and the MLP/MoE output all-reduce (row-parallel), one for the
    vocab-parallel embedding, the logits all-gather; each MTP draft pass repeats embedding, its
    layer's two, and picks its draft tokens (first pass over every verified token, later ones one
    per sequence). `draft_argmax` (what `glmctl serve` configures: vLLM's
    use_local_argmax_reduction) gathers each rank's (max, index) pair per token as fp32 instead of
    the pass's logits."""
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
                calls.append(Collective(op="all_reduce", bytes=n * row, count=3 * passes, what=f"MTP {label}"))
                calls.append(Collective(op="all_gather", bytes=n * 2 * 4, count=passes, dtype="fp32",
                                        what=f"MTP {label} top tokens") if draft_argmax else
                             Collective(op="all_gather", bytes=n * vocab_rank * 2, count=passes,
                                        what=f"MTP {label} logits"))
    return calls


def _priced(calls: list[Collective], tp: int, node, costs, int8: bool = False, direct=None) -> list[dict]:
    """Each call kind's terms; `int8`: all-reduces as INT8 payloads (GLMCTL_COLLECTIVES_INT8=all:
    the decode sizes on the direct path's two shots, priced by their records' bytes and codec);
    `direct`: the direct path's limits (`call_plan.DirectLimits`; None: the measured defaults)."""
    from glmctl.collectives import cost_model
    from glmctl.collectives.call_plan import PathOptions

    options = PathOptions(direct=direct)
    out = []
    for c in calls:
        dtype = "int8" if int8 and c.op == "all_reduce" else c.dtype
        b = cost_model.breakdown(c.op, tp, c.bytes, dtype, node=node or cost_model.L40_NODE,
                                 costs=costs or cost_model.PROTOCOL_COSTS, options=options)
        out.append({"what": c.what, "op": c.op, "bytes": c.bytes, "count": c.count, "path": b.path,
                    "latency_us": b.latency_s * 1e6, "link_us": b.link_s * 1e6,
                    "host_us": b.host_s * 1e6, "us": b.seconds * 1e6, "bound": b.bound})
    return out


def _step(cell: str, priced: list[dict], **extra) -> dict:
    """One cell's row: total, and the bound that takes most of it."""
    parts = Counter()
    for p in priced:
        parts["latency"] += p["count"] * p["latency_us"]
        data = max(p["link_us"], p["host_us"])
        parts["host memory" if p["host_us"] >= p["link_us"] else "PCIe link"] += p["count"] * data
    total = sum(p["count"] * p["us"] for p in priced)
    links_only = sum(p["count"] * (p["latency_us"] + p["link_us"]) for p in priced)
    paths = Counter()
    for p in priced:
        paths[p["path"]] += p["count"]
    return {"cell": cell, "calls": sum(p["count"] for p in priced), "ms": round(total / 1e3, 3),
            "bound": max(parts, key=parts.get),
            "latency_ms": round(parts["latency"] / 1e3, 3),
            "data_ms": round((parts["host memory"] + parts["PCIe link"]) / 1e3, 3),
            "ms_if_host_caches_hold_it": round(links_only / 1e3, 3), "paths": dict(paths),
            "calls_by_kind": [{k: (round(v, 2) if isinstance(v, float) else v) for k, v in p.items()}
                              for p in priced], **extra}


def decode_step_prediction(model: ModelSpec | None = None, *, tp: int = 8, num_spec: int = 3,
                           cells=DECODE_CELLS, node=None, costs=None,
                           int8_all_reduce: bool = False) -> list[dict]:
    """Per cell (name, sessions): the decode step's collectives on the node, predicted (with
    `int8_all_reduce`, as GLMCTL_COLLECTIVES_INT8=all sends the all-reduces). Row keys:
    cell, calls, ms, bound ("latency", "host memory" or "PCIe link": the term most of the time
    goes to), latency_ms / data_ms (the split), ms_if_host_caches_hold_it (the links alone bound
    the data: decode-size traffic served from the host's last-level cache), paths (calls per
    path the auto rule picks), calls_by_kind (each call kind's per-call terms)."""
    model = model or load_model_spec("glm-5.3-flash")
    rows = []
    for cell, sessions in cells:
        calls = decode_step_collectives(model, tp, sessions, num_spec)
        rows.append(_step(cell, _priced(calls, tp, node, costs, int8_all_reduce),
                          sessions=sessions, tokens=sessions * (1 + num_spec)))
    return rows


def decode_levers(model: ModelSpec | None = None, *, tp: int = 8, num_spec: int = 3,
                  cells=DECODE_CELLS, node=None, costs=None, int8_rel_err: str = "") -> list[dict]:
    """What would take each cell's collectives lower, predicted with the same terms: {lever,
    cell, ms, saved_ms, note}. `int8_rel_err` says what the INT8 all-reduce's error was measured
    to be (the rig's INT8 rows)."""
    from glmctl.collectives.call_plan import PREDICTED_SHOTS_8

    model = model or load_model_spec("glm-5.3-flash")
    out = []
    for cell, sessions in cells:
        calls = decode_step_collectives(model, tp, sessions, num_spec)
        priced = _priced(calls, tp, node, costs)
        int8 = _priced(calls, tp, node, costs, int8=True)
        base = sum(p["count"] * p["us"] for p in priced)
        out += [{"lever": name, "cell": cell, "ms": round(ms / 1e3, 3),
                 "saved_ms": round((base - ms) / 1e3, 3), "note": note}
                for name, ms, note in _levers(model, priced, int8, base, tp, int8_rel_err)]
        shots = sum(p["count"] * p["us"] for p in _priced(calls, tp, node, costs, direct=PREDICTED_SHOTS_8))
        out.append({"lever": "native direct shots as priced", "cell": cell, "ms": round(shots / 1e3, 3),
                    "saved_ms": round((base - shots) / 1e3, 3),
                    "note": "the direct path's native one and two shots (publish, fence, collect) to "
                            "384 KiB after LL words to 4 KiB, as the protocol's fitted terms price them on "
                            "the node; off by default: on the one-GPU thread rig they took 0.26-6 ms per "
                            "call (2026-12-06), the rig's queues or the protocol, not yet known"})
        if sessions >= 2:
            half = decode_step_collectives(model, tp, sessions // 2, num_spec)
            split = 2 * sum(p["count"] * p["us"] for p in _priced(half, tp, node, costs))
            out.append({"lever": "overlap with compute (two micro-batches)", "cell": cell,
                        "ms": round(split / 1e3, 3), "saved_ms": round(base / 1e3, 3),
                        "note": f"ms: the collectives of two {sessions // 2}-session micro-batches"
                                ", each to hide under the other's compute; saved: at most, when "
                                "the compute is at least as long (not measured here)"})
    return out


def _levers(model: ModelSpec, priced: list[dict], int8: list[dict], base: float, n: int,
            int8_rel_err: str):
    """(lever, us, note) for one cell's priced calls (`int8`: the same calls, all-reduces priced
    as INT8 payloads)."""
    ar = [p for p in priced if p["op"] == "all_reduce"]
    data = {id(p): max(p["link_us"], p["host_us"]) for p in priced}
    ar8 = [p for p in int8 if p["op"] == "all_reduce"]
    paths = sorted({p["path"] for p in ar8})
    ratio = sum(p["count"] * max(p["link_us"], p["host_us"]) for p in ar8) / max(
        sum(p["count"] * data[id(p)] for p in ar), 1e-9)
    yield ("INT8 decode all-reduce",
           base - sum(p["count"] * p["us"] for p in ar) + sum(p["count"] * p["us"] for p in ar8),
           f"GLMCTL_COLLECTIVES_INT8=all: every all-reduce as INT8 records on {', '.join(paths)} "
           f"(predicted: data terms x{ratio:.3f}, the records' bytes with their scales; the "
           "direct two shots' extra flag round where bf16 took LL or one shot; the codec's "
           "arithmetic as predicted in `cost_terms`); error "
           + (int8_rel_err or "not measured here"))
    layer = next(p for p in ar if p["what"].startswith("attention"))
    yield ("one all-reduce per layer", base - model.num_hidden_layers * layer["us"],
           f"{model.num_hidden_layers} fewer {layer['bytes'] // 1024} KiB calls at {layer['us']:.1f} "
           "us (attention and MoE outputs reduced once: a model change, not exact)")
    to_one = base
    for p in priced:
        if p["op"] == "all_gather":  # rank 0 receives n-1 parts; n parts written, n-1 read once
            one = max(p["link_us"] * (n - 1) / n, p["host_us"] * (2 * n - 1) / (n * n))
            to_one += p["count"] * (one - data[id(p)])
    yield ("logits gathered to one rank", to_one,
           "vLLM's gather path (rank 0 samples; the token ids go out in one small call, not "
           "counted): a logits gather moves 2n-1 parts through host memory instead of n^2")
    yield ("host caches hold decode traffic",
           sum(p["count"] * (p["latency_us"] + p["link_us"]) for p in priced),
           "the host-memory term at cache speed: the links bound the data")
