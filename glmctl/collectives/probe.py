"""What `glmctl doctor` and `bench/collectives.py` ask of the collectives: timings of host-staged
all-reduce / all-gather across real processes, and the cached copy-engine calibration.

`time_collectives` is one rank's loop: for each (op, payload) and message size it warms the call up,
captures a CUDA graph of back-to-back calls and times its replays with CUDA events (median), which is
how a captured decode step sees the collective. `measure` runs it with one process per GPU and
returns rows shaped like `glmctl.probe.doctor_report.CollectivePoint` (plain dicts: this package sits below
the probe in the layering).
"""

from __future__ import annotations

from glmctl.collectives.calibration import CollectivesCalibration, calibration_status, graph_time_us

MiB = 1 << 20
VARIANTS = (("all_reduce", False), ("all_reduce", True), ("all_gather", False), ("all_gather", True))


def time_collectives(rank: int, world: int, session: str, sizes: list[int],
                     shared_gpu: bool = False) -> list[dict]:
    """One rank's timings. Sizes are messages: the all-reduce input, the all-gather output (bf16)."""
    import torch

    torch.cuda.set_device(0 if shared_gpu else rank)
    from glmctl.collectives.host_staged_communicator import HostStagedCommunicator

    comm = HostStagedCommunicator(rank, world, session, max(sizes), timeout_s=60)
    rows = []
    try:
        for op, int8 in VARIANTS:
            for size in sizes:
                rows.append(_time_case(comm, rank, op, int8, size, world))
                torch.cuda.empty_cache()  # the case's tensors are gone with its frame
    finally:
        comm.close()
    return rows


def _time_case(comm, rank: int, op: str, int8: bool, size: int, world: int) -> dict:
    import torch

    per_rank = size if op == "all_reduce" else size // world
    numel = per_rank // 2
    g = torch.Generator(device="cuda")
    g.manual_seed(rank * 7919 + size)
    x = torch.randn(numel, generator=g, device="cuda").to(torch.bfloat16)
    out = torch.empty_like(x)
    if op == "all_reduce":
        def call():
            comm.all_reduce(x, out=out, int8=int8)
    else:
        def call():
            comm.all_gather(x, 0, int8=int8)
    plan = comm.plan(op, x, int8)
    calls, replays = (20, 5) if size <= MiB else (4, 3) if size <= 16 * MiB else (1, 3)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
        call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    comm.host_barrier("timing case start")
    with comm.capture():
        us = graph_time_us(call, calls, replays)
    row = {"op": op, "int8": int8, "size": size, "us": us, "algorithm": plan.algorithm,
           "d2h": plan.d2h, "h2d": plan.h2d,
           "payload_bytes_d2h": plan.bytes_moved()[0], "payload_bytes_h2d": plan.bytes_moved()[1]}
    return row


def measure(ranks: int, sizes: list[int], timeout_s: float = 600) -> list[dict]:
    """Host-staged collectives across `ranks` GPUs of this node, one process each (doctor)."""
    from glmctl.collectives.collective_errors import CollectiveError
    from glmctl.collectives.harness import run_ranks

    results = run_ranks(time_collectives, ranks, sizes, False, timeout_s=timeout_s)
    bad = [r for r in results if not r.ok]
    if bad:
        raise CollectiveError(f"rank {bad[0].rank} failed: {(bad[0].error or '').splitlines()[0]}")
    points = []
    for cells in zip(*(r.value for r in results), strict=True):
        row = cells[0]
        us = max(c["us"] for c in cells)  # the slowest rank
        n = ranks
        factor = 2 * (n - 1) / n if row["op"] == "all_reduce" else (n - 1) / n
        algbw = row["size"] / (us * 1e-6) / 1e9
        per_rank = row["size"] if row["op"] == "all_reduce" else row["size"] // n
        points.append({"op": row["op"], "backend": "host-staged",
                       "dtype": "int8" if row["int8"] else "bf16", "ranks": n, "bytes": per_rank,
                       "latency_us": round(us, 2), "algbw_gbps": round(algbw, 3),
                       "busbw_gbps": round(algbw * factor, 3)})
    return points


def cached_calibration(device_name: str | None = None) -> CollectivesCalibration | None:
    """The cached copy-engine/SM choice for `device_name`, else the most recent one cached."""
    entries = calibration_status().entries
    if device_name is not None:
        entries = [e for e in entries if e.device == device_name]
    return max(entries, key=lambda e: e.measured_at) if entries else None
