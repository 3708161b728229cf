"""How long a host-staged collective takes on a node, predicted from measured per-call costs and
the node's links (pure Python: no torch). `glmctl doctor`'s verdict and the per-rank
simulation's node prediction call it.

    from glmctl.collectives.cost_model import L40_NODE, time
    time("all_reduce", 8, 16 << 20, "bf16")            # seconds: one 16 MiB all-reduce, 8x L40
    time("all_gather", 8, 32 * 19_360 * 4, "fp32")    # the logits gather of a 32-token step

The model, for one call of `nbytes` per rank over `ranks` ranks (plans exactly as the
communicator plans it: `plan.plan_call` with the default `PathOptions`; messages above
`max_bytes` go in several calls, `call_plan.message_pieces`):

    t = latency(path, ranks) + max(t_link, t_host)
    t_link = D2H / link_d2h + H2D / link_h2d      (the directions one after the other)
    t_host = ranks * (D2H + H2D) / host           (every byte crosses host memory once, shared)

D2H and H2D are the bytes one rank moves each way (`CollectivePlan.bytes_moved()`: INT8 payloads
are about half). `latency(path, ranks) = base + per_peer * (ranks - 1)` is the fixed cost of the
path (barriers, kernel launches, flag polls), measured on one GPU with the ranks as threads of one
process (`bench/gpu/collectives_threads.sh`; `costs_from_rows` fits it from that run's rows;
`PROTOCOL_COSTS` are the fit of the recorded run). The
node's links are each GPU's own PCIe link (the report's L40s: Gen4 x16, about 25 GB/s each way)
and the host memory every rank's bytes pass through (about 100 GB/s, as the report measured).
What it leaves out: contention between a rank's two directions beyond the host-memory term, the
NUMA placement of the segment, and any compute the collective overlaps with.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from glmctl.collectives.call_plan import PathOptions, message_pieces, plan_call, slot_capacity

MiB = 1 << 20
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "int8": 2}  # int8: bf16 messages, INT8 payloads
DEFAULT_MAX_BYTES = 32 * MiB  # the plugin's largest call (plugin.distributed.tp_communicator.MAX_BYTES_CAP)

# GLM-5.3-Flash shapes that set the collectives' traffic (transformers 5.24 glm5_next defaults)
GLM53_HIDDEN = 4096
GLM53_LAYERS = 45
GLM53_VOCAB = 154_880
ALL_REDUCES_PER_LAYER = 2  # after attention's o_proj and after the MoE's down projection
PREFILL_TOKENS = 262_144
PREFILL_CHUNK = 2048


@dataclass(frozen=True)
class NodeLinks:
    """The links a host-staged collective crosses on a node, GB/s (1e9 B/s)."""

    name: str
    link_d2h_gbps: float  # each GPU's own link, GPU -> host
    link_h2d_gbps: float  # host -> GPU
    host_gbps: float  # host memory, shared by every rank's transfers


L40_NODE = NodeLinks("8x L40 (PCIe Gen4 x16 each, no P2P; the report's node)", 25.0, 25.0, 100.0)


@dataclass(frozen=True)
class ProtocolCosts:
    """Fixed cost of one call by path, microseconds: base + per_peer * (ranks - 1)."""

    source: str
    paths: dict[str, tuple[float, float]] = field(default_factory=dict)

    def latency_us(self, path: str, ranks: int) -> float:
        base, per_peer = self.paths.get(path) or self.paths[path.removesuffix("_int8")]
        return base + per_peer * (ranks - 1)


# Measured on one H200 with 2, 4 and 8 ranks as threads of one process (the thread rig, run of
# 2026-12-01T22:58Z, bench/results/collectives-h200-threads.json), fitted by `costs_from_rows`.
# Every rank ran on that one GPU, so a per-peer term also holds the other ranks' memory operations
# and polls queueing on the same device and link (a barrier pair took 12.9 / 53 / 211 us at 2 / 4
# / 8 ranks: about 0.6 us per memory operation of all ranks together); with a GPU per rank those
# do not queue behind each other, so for 8 L40s these costs are likely pessimistic. INT8
# all-gathers were not measured: they take the native gather's cost (`latency_us`'s fallback).
PROTOCOL_COSTS = ProtocolCosts(
    source="measured on 1x H200, thread rig (ranks as threads of one process), 2026-12-01",
    paths={"one_shot": (0.0, 34.63), "two_shot": (0.0, 84.41), "gather": (0.0, 33.18),
           "one_shot_int8": (0.0, 33.78), "two_shot_int8": (0.0, 86.81),
           "direct": (31.79, 6.72), "direct_ll": (0.0, 3.82)})


@dataclass(frozen=True)
class CollectiveTime:
    """One prediction and its parts (seconds); `bound` names the larger data term."""

    seconds: float
    latency_s: float
    link_s: float
    host_s: float
    calls: int
    path: str
    d2h_bytes: int  # per rank, all calls
    h2d_bytes: int

    @property
    def bound(self) -> str:
        if self.latency_s >= max(self.link_s, self.host_s):
            return "latency"
        return "host memory" if self.host_s >= self.link_s else "PCIe link"


def breakdown(op: str, ranks: int, nbytes: int, dtype: str = "bf16", *,
              node: NodeLinks = L40_NODE, costs: ProtocolCosts = PROTOCOL_COSTS,
              options: PathOptions = PathOptions(), max_bytes: int = DEFAULT_MAX_BYTES,
              ) -> CollectiveTime:
    """`time`, with its parts."""
    if op not in ("all_reduce", "all_gather"):
        raise ValueError(f"op must be all_reduce or all_gather, not {op!r}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, not {dtype!r}")
    if ranks < 2 or nbytes <= 0:
        raise ValueError("a collective needs at least 2 ranks and a non-empty message")
    eb = DTYPE_BYTES[dtype]
    numel = -(-nbytes // eb)
    capacity = slot_capacity(max_bytes, ranks, options.int8_group)
    lat = link = host = 0.0
    d2h_all = h2d_all = 0
    pieces = message_pieces(numel, eb, max_bytes)
    path = ""
    for _, count in pieces:
        plan = plan_call(op, count, eb, ranks, dtype == "int8", options, capacity)
        if plan is None:
            raise ValueError(f"no plan for {count} elements with max_bytes={max_bytes}")
        path = plan.algorithm + ("_int8" if plan.int8 else "")
        d2h, h2d = plan.bytes_moved()
        d2h_all, h2d_all = d2h_all + d2h, h2d_all + h2d
        lat += costs.latency_us(path, ranks) * 1e-6
        t_d2h, t_h2d = d2h / (node.link_d2h_gbps * 1e9), h2d / (node.link_h2d_gbps * 1e9)
        link += t_d2h + t_h2d
        host += ranks * (d2h + h2d) / (node.host_gbps * 1e9)
    return CollectiveTime(seconds=lat + max(link, host), latency_s=lat, link_s=link, host_s=host,
                          calls=len(pieces), path=path, d2h_bytes=d2h_all, h2d_bytes=h2d_all)


def time(op: str, ranks: int, nbytes: int, dtype: str = "bf16", *,
         node: NodeLinks = L40_NODE, costs: ProtocolCosts = PROTOCOL_COSTS,
         options: PathOptions = PathOptions(), max_bytes: int = DEFAULT_MAX_BYTES) -> float:
    """Predicted seconds for one host-staged `op` ("all_reduce" | "all_gather") over `ranks`
    ranks of `node`, for a message of `nbytes` per rank (all-reduce: the tensor each rank holds;
    all-gather: each rank's contribution), of `dtype` "bf16" | "fp16" | "fp32", or "int8" for a
    bf16 message sent as INT8 payloads. Keywords: the node's links, the measured protocol costs,
    the communicator's path options and its largest call. Raises ValueError for an unknown op or
    dtype, fewer than 2 ranks or an empty message."""
    return breakdown(op, ranks, nbytes, dtype, node=node, costs=costs, options=options,
                     max_bytes=max_bytes).seconds


def costs_from_rows(rows: list[dict], ceiling: dict, source: str) -> ProtocolCosts:
    """Fit `ProtocolCosts` from the thread rig's rows (`bench/results/collectives-h200-threads.json`):
    per path and rank count, the captured time of its smallest message less the time its bytes
    take on the rig's one link (`ceiling`: the pinned copy GB/s of that run), then base +
    per_peer * (ranks - 1) by least squares over the rank counts (per_peer 0 with one count)."""
    best: dict[tuple[str, int], float] = {}
    smallest: dict[tuple[str, int], int] = {}
    for r in rows:
        if r.get("graph") != "captured" or r.get("wrong") or "algorithm" not in r:
            continue
        key = (r["algorithm"] + ("_int8" if r["dtype"] == "int8" else ""), r["ranks"])
        n = r["ranks"]
        data = n * (r["payload_bytes_d2h"] / (ceiling["d2h"] * 1e9)
                    + r["payload_bytes_h2d"] / (ceiling["h2d"] * 1e9))
        lat = max(0.0, r["time_us"] - data * 1e6)
        if key not in smallest or r["rank_bytes"] < smallest[key] or (
                r["rank_bytes"] == smallest[key] and lat < best[key]):
            smallest[key], best[key] = r["rank_bytes"], lat
    paths = {}
    for path in sorted({p for p, _ in best}):
        pts = sorted((n - 1, lat) for (p, n), lat in best.items() if p == path)
        if len(pts) == 1:
            paths[path] = (round(pts[0][1], 2), 0.0)
            continue
        mx = sum(x for x, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        slope = max(0.0, slope)
        paths[path] = (round(max(0.0, my - slope * mx), 2), round(slope, 2))
    return ProtocolCosts(source=source, paths=paths)


def nccl_time(op: str, ranks: int, nbytes: int, busbw_gbps: float) -> float:
    """Seconds at a measured NCCL bus bandwidth (nccl-tests' busbw: all-reduce moves
    2(n-1)/n of the message per rank, all-gather (n-1)/n of the output)."""
    if op == "all_reduce":
        return nbytes * 2 * (ranks - 1) / ranks / (busbw_gbps * 1e9)
    return nbytes * ranks * (ranks - 1) / ranks / (busbw_gbps * 1e9)


def prefill_all_reduce_s(ranks: int = 8, dtype: str = "bf16", *, tokens: int = PREFILL_TOKENS,
                         chunk: int = PREFILL_CHUNK, hidden: int = GLM53_HIDDEN,
                         layers: int = GLM53_LAYERS, node: NodeLinks = L40_NODE,
                         costs: ProtocolCosts = PROTOCOL_COSTS, nccl_busbw_gbps: float | None = None,
                         ) -> float:
    """Seconds of tensor-parallel all-reduce in one prefill of `tokens`, in chunks of `chunk`
    tokens (each an all-reduce of [chunk, hidden] after attention and after the MoE, per layer):
    host-staged, or at an NCCL bus bandwidth when `nccl_busbw_gbps` is given."""
    total = 0.0
    for lo in range(0, tokens, chunk):
        nbytes = min(chunk, tokens - lo) * hidden * 2
        one = (nccl_time("all_reduce", ranks, nbytes, nccl_busbw_gbps) if nccl_busbw_gbps else
               time("all_reduce", ranks, nbytes, dtype, node=node, costs=costs))
        total += one * layers * ALL_REDUCES_PER_LAYER
    return total


def decode_step_s(sessions: int = 8, tokens_per_session: int = 4, ranks: int = 8, *,
                  node: NodeLinks = L40_NODE, costs: ProtocolCosts = PROTOCOL_COSTS) -> float:
    """Seconds of collectives in one decode step of the target model: two all-reduces per layer
    of [tokens, hidden] bf16 and the logits gather (vocab / ranks fp32 logits per token per rank);
    `tokens_per_session` 4 = one token plus MTP-3's three drafts. The drafter's own passes are
    not counted."""
    tokens = sessions * tokens_per_session
    ar = time("all_reduce", ranks, tokens * GLM53_HIDDEN * 2, "bf16", node=node, costs=costs)
    gather = time("all_gather", ranks, tokens * (GLM53_VOCAB // ranks) * 4, "fp32", node=node,
                  costs=costs)
    return GLM53_LAYERS * ALL_REDUCES_PER_LAYER * ar + gather


def report_cases(node: NodeLinks = L40_NODE, costs: ProtocolCosts = PROTOCOL_COSTS) -> list[dict]:
    """The report's collectives figures beside this model's predictions for its node. The report
    gives end-to-end times (collectives and compute); the model predicts the collectives alone,
    so compare the differences between its steps."""
    nccl = prefill_all_reduce_s(nccl_busbw_gbps=1.0, node=node)
    staged = prefill_all_reduce_s(node=node, costs=costs)
    int8 = prefill_all_reduce_s(dtype="int8", node=node, costs=costs)
    step = decode_step_s(node=node, costs=costs)
    return [
        {"case": "256k prefill, all-reduce time, NCCL at 1 GB/s busbw", "predicted_s": nccl,
         "report": "298 s end to end"},
        {"case": "256k prefill, all-reduce time, host-staged bf16", "predicted_s": staged,
         "report": "77.7 s end to end"},
        {"case": "256k prefill, all-reduce time, host-staged INT8", "predicted_s": int8,
         "report": "56.1 s end to end"},
        {"case": "saved by host staging (NCCL - bf16)", "predicted_s": nccl - staged,
         "report": "298 - 77.7 = 220.3 s"},
        {"case": "saved by INT8 (bf16 - INT8)", "predicted_s": staged - int8,
         "report": "77.7 - 56.1 = 21.6 s"},
        {"case": "decode step at 8 sessions (32 tokens), collectives", "predicted_s": step,
         "report": "704 tok/s = 88 tok/s per session: a step takes (tokens accepted per step) "
                   "/ 88 s, e.g. 26 ms at 2.3 (assumed: MTP-3's 2.3x gain at one session)"},
    ]


def report_lines(node: NodeLinks = L40_NODE, costs: ProtocolCosts = PROTOCOL_COSTS) -> list[str]:
    lines = [f"node: {node.name}; links {node.link_d2h_gbps:g}/{node.link_h2d_gbps:g} GB/s, host "
             f"memory {node.host_gbps:g} GB/s; protocol costs: {costs.source}"]
    for row in report_cases(node, costs):
        lines.append(f"{row['case']:<52} predicted {row['predicted_s']:8.3f} s | report: "
                     f"{row['report']}")
    return lines


def main() -> int:
    print("\n".join(report_lines()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
