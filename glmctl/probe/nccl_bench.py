"""NCCL all-reduce bus bandwidth over message sizes, one process per GPU (nccl-tests' formulas).

algbw = bytes / time; busbw = algbw * 2(n-1)/n for all-reduce (nccl-tests doc/PERFORMANCE.md),
time = median over repetitions of one in-place all-reduce, timed with CUDA events on rank 0 after
a barrier. Runs in a fresh process tree so that NCCL_* variables (e.g. NCCL_P2P_DISABLE=1, the
report's situation) apply at NCCL initialisation.

    python -m glmctl.probe.nccl_bench --ranks 8 --sizes 1048576,268435456 --out result.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from glmctl.probe.doctor_report import CollectivePoint


def busbw_all_reduce(algbw: float, ranks: int) -> float:
    return algbw * 2 * (ranks - 1) / ranks


def run_nccl_all_reduce(ranks: int, sizes: list[int], env: dict[str, str] | None = None,
                        timeout_s: float = 300) -> list[CollectivePoint]:
    """Launch the benchmark in its own process tree and return its points (rank 0's timings)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "nccl.json"
        cmd = [sys.executable, "-m", "glmctl.probe.nccl_bench", "--ranks", str(ranks),
               "--sizes", ",".join(map(str, sizes)), "--out", str(out)]
        proc = subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError((proc.stderr.strip().splitlines() or ["nccl benchmark failed"])[-1])
        rows = json.loads(out.read_text())
    return [CollectivePoint(op="all_reduce", backend="nccl", dtype="bf16", ranks=ranks, env=env or {}, **r) for r in rows]


def _worker(rank: int, ranks: int, port: int, sizes: list[int], out: str, reps: int) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
    rows = []
    for nbytes in sizes:
        x = torch.randn(max(1, nbytes // 2), dtype=torch.bfloat16, device="cuda")
        for _ in range(3):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dist.all_reduce(x)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        t = statistics.median(times)
        algbw = x.numel() * 2 / t / 1e9
        rows.append({"bytes": x.numel() * 2, "latency_us": t * 1e6, "algbw_gbps": algbw,
                     "busbw_gbps": busbw_all_reduce(algbw, ranks)})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("--sizes", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sizes = [int(v) for v in args.sizes.split(",")]
    mp.spawn(_worker, args=(args.ranks, port, sizes, args.out, args.reps), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
