"""How long a host-staged collective takes on a node, predicted from the protocol's cost terms
(fitted on the thread rig: `cost_terms`) and the node's links (pure Python: no torch). `glmctl
doctor`'s verdict, the per-rank simulation's node prediction and the decode-step collectives
budget (`glmctl.plan.prediction.decode_collectives`) call it.

    from glmctl.collectives.cost_model import L40_NODE, time
    time("all_reduce", 8, 16 << 20, "bf16")            # seconds: one 16 MiB all-reduce, 8x L40
    time("all_gather", 8, 32 * 19_360 * 2, "bf16")    # the logits gather of a 32-token step

The model, for one call of `nbytes` per rank over `ranks` ranks (planned exactly as the
communicator plans it: `call_plan.plan_call` with the default `PathOptions`; messages above
`max_bytes` go in several calls, `call_plan.message_pieces`):

    t = latency + max(t_link, t_host)
    latency = fixed + per_memop * memops + per_poll * polls     (`ProtocolCosts.latency_us`)
              (+ the INT8 codec where a path's terms are predicted: `ProtocolCosts.codec_us`)
    t_link = (D2H / link_d2h + H2D / link_h2d) / efficiency     (the directions one after the other)
    t_host = ranks * (D2H + H2D) / host                         (every byte crosses host memory once)

D2H and H2D are the bytes one rank moves each way (`CollectivePlan.bytes_moved()`: INT8 payloads
about half, LL words twice). The terms are the protocol's own, with what the rig imposes taken
out (`cost_terms` says how): on the node each rank issues its own memops on its own GPU, moves its
bytes over its own link at the path's measured efficiency, and all ranks share host memory. The
node's figures are inputs (`NodeLinks`): each GPU's PCIe link (the report's L40s: Gen4 x16,
about 25 GB/s each way) and host memory (about 100 GB/s, as the report measured for its VM).
What it leaves out: contention between a rank's two directions beyond the host-memory term,
whether decode-size traffic stays in the host's last-level cache (then the links bound it), the
NUMA placement of the segment, and any compute the collective overlaps with.
"""

from __future__ import annotations

from dataclasses import dataclass

from glmctl.collectives.call_plan import PathOptions, message_pieces, plan_call, slot_capacity
from glmctl.collectives.cost_terms import PathTerms, ProtocolCosts, with_direct_predictions

MiB = 1 << 20
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "int8": 2}  # int8: bf16 messages, INT8 payloads
DEFAULT_MAX_BYTES = 32 * MiB  # the plugin's largest call (plugin.distributed.tp_communicator.MAX_BYTES_CAP)

# GLM-5.3-Flash shapes that set the prefill all-reduces (transformers 5.24 glm5_next defaults)
GLM53_HIDDEN = 4096
GLM53_LAYERS = 45
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


# Fitted by `cost_terms.fit_costs` from the thread rig's run of 2026-12-01T22:58Z (one H200,
# ranks as threads of one process; bench/results/collectives-h200-threads.json, its direct kernels
# polling one peer after the other: `SEQUENTIAL_POLLS`), captured rows; per memory operation
# from its barrier-pair rows (2 / 4 / 8 ranks, residuals -1.4 / -2.5 / +0.7 us). `direct` is the
# flag-line path that record measured (a release atomic per program: 34 us fixed), kept for the
# record; no plan takes it. `direct_1s`, `direct_2s` and `direct_2s_int8` are predicted
# (`with_direct_predictions`, 1.19 us per further kernel: that run's in-graph launch at 2 ranks;
# the INT8 codec from the kernels' arithmetic).
PROTOCOL_COSTS = with_direct_predictions(ProtocolCosts(
    source="fitted on 1x H200, thread rig (ranks as threads of one process), 2026-12-01; "
           "direct_1s/direct_2s predicted",
    per_memop_us=0.5744, rig_ceiling_gbps=54.69, paths={
        "direct": PathTerms(34.12, 5.616, 42.2, "fitted: 18 rows at [2, 4, 8] ranks, 4 KiB..256 "
                            "KiB; residual rms 5.4%, worst +15.2 us (19%) at 2 ranks 256 KiB"),
        "direct_ll": PathTerms(0.62, 3.362, 58.3, "fitted: 18 rows at [2, 4, 8] ranks, 4 KiB..256 "
                               "KiB; residual rms 4.9%, worst -5.2 us (10%) at 8 ranks 16 KiB"),
        "gather": PathTerms(13.5, 0.0, 55.6, "fitted: 84 rows at [2, 4, 8] ranks, 512 B..128 "
                            "MiB; residual rms 10.9%, worst -815.8 us (50%) at 2 ranks 32 MiB"),
        "one_shot": PathTerms(10.63, 0.0, 60.6, "fitted: 58 rows at [2, 4, 8] ranks, 4 KiB..256 "
                              "MiB; residual rms 13.6%, worst -1218.0 us (38%) at 2 ranks 64 MiB"),
        "one_shot_int8": PathTerms(17.86, 0.0, 52.8, "fitted: 18 rows at [2, 4, 8] ranks, 4 KiB.."
                                   "256 MiB; residual rms 5.7%, worst -47.5 us (14%) at 8 ranks "
                                   "256 KiB"),
        "two_shot": PathTerms(91.0, 0.0, 55.0, "fitted: 26 rows at [4, 8] ranks, 384 KiB..256 "
                              "MiB; residual rms 12.1%, worst +1687.5 us (34%) at 4 ranks 16 MiB"),
        "two_shot_int8": PathTerms(94.02, 0.0, 53.6, "fitted: 12 rows at [4, 8] ranks, 1 MiB..256 "
                                   "MiB; residual rms 6.3%, worst +192.2 us (13%) at 8 ranks 4 MiB"),
    }), launch_us=1.19)


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
        lat += (costs.latency_us(path, ranks) + costs.codec_us(path, plan.nbytes)) * 1e-6
        t_d2h, t_h2d = d2h / (node.link_d2h_gbps * 1e9), h2d / (node.link_h2d_gbps * 1e9)
        link += (t_d2h + t_h2d) / costs.efficiency(path)
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


def report_cases(node: NodeLinks = L40_NODE, costs: ProtocolCosts = PROTOCOL_COSTS) -> list[dict]:
    """The report's prefill collectives figures beside this model's predictions for its node. The
    report gives end-to-end times (collectives and compute); the model predicts the collectives
    alone, so compare the differences between its steps. (The decode step's collectives:
    `glmctl.plan.prediction.decode_collectives`.)"""
    nccl = prefill_all_reduce_s(nccl_busbw_gbps=1.0, node=node)
    staged = prefill_all_reduce_s(node=node, costs=costs)
    int8 = prefill_all_reduce_s(dtype="int8", node=node, costs=costs)
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
