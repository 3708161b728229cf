#!/usr/bin/env python3
"""Smoke check of the host-staged collectives on a GPU before the long tests: 2 and 4 processes,
one call of each kind (the direct path as LL words, one and two native shots too), results checked,
eager and graph timings printed. Exits non-zero on any failure."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def rank_body(rank: int, world: int, session: str) -> dict:
    import torch

    torch.cuda.set_device(0)
    from glmctl.collectives import HostStagedCommunicator

    t0 = time.perf_counter()
    comm = HostStagedCommunicator(rank, world, session, 16 << 20, timeout_s=20)
    info = {"init_s": time.perf_counter() - t0, "engines": str(comm.copy_engines),
            "memops": comm._drv.memop_mode, "options": str(comm.options),
            "calibration": comm.calibration.model_dump() if comm.calibration else None}
    from dataclasses import replace

    from glmctl.collectives.call_plan import DirectLimits

    try:
        base = comm.options
        cap = base.direct.capacity
        for kind, limits in (("ll", DirectLimits(ll_max_bytes=cap // 2, capacity=cap)),
                             ("1s", DirectLimits(one_shot_max_bytes=cap, capacity=cap)),
                             ("2s", DirectLimits(two_shot_max_bytes=cap, capacity=cap))):
            comm.options = replace(base, direct=limits)
            for numel in (4096, 3 << 15):
                x = torch.full((numel,), float(rank + 1), dtype=torch.bfloat16, device="cuda")
                comm.all_reduce(x)
                info[f"ar_direct_{kind}_{numel}_False"] = float((x.float() - sum(range(1, world + 1))).abs().max())
                g = comm.all_gather(torch.full((numel // 4,), float(rank), device="cuda"), 0)
                ref = torch.arange(world, device="cuda").repeat_interleave(numel // 4).float()
                info[f"ag_direct_{kind}_{numel}_False"] = float((g - ref).abs().max())
        comm.options = base
        for int8 in (False, True):
            for numel in (4096, 3 << 20):
                x = torch.full((numel,), float(rank + 1), dtype=torch.bfloat16, device="cuda")
                comm.all_reduce(x, int8=int8)
                want = sum(range(1, world + 1))
                info[f"ar_{numel}_{int8}"] = float((x.float() - want).abs().max())
                g = comm.all_gather(torch.full((numel // 4,), float(rank), device="cuda",
                                               dtype=torch.bfloat16), 0, int8=int8)
                ref = torch.arange(world, device="cuda").repeat_interleave(numel // 4).to(g.dtype)
                info[f"ag_{numel}_{int8}"] = float((g.float() - ref.float()).abs().max())
        x = torch.randn(8192, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            comm.all_reduce(x)
        torch.cuda.synchronize()
        info["eager_us"] = (time.perf_counter() - t0) / 50 * 1e6
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            comm.all_reduce(x)
        torch.cuda.current_stream().wait_stream(side)
        with comm.capture():
            with torch.cuda.graph(graph):
                for _ in range(20):
                    comm.all_reduce(x)
        graph.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
        info["graph_us"] = (time.perf_counter() - t0) / 200 * 1e6
        comm.check()
    finally:
        comm.close()
    return info


def main() -> int:
    from glmctl.collectives.harness import run_ranks

    ok = True
    for world in (2, 4):
        res = run_ranks(rank_body, world, timeout_s=90)
        for r in res:
            print(f"world {world} rank {r.rank}: ok={r.ok} exit={r.exitcode} "
                  f"{r.value if r.ok else r.error}", flush=True)
            ok &= r.ok and all(v == 0.0 for k, v in r.value.items() if k.startswith(("ar_", "ag_"))
                               and not k.endswith("True")) if r.ok else False
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
