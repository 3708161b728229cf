"""Rank bodies for the collectives' gpu-lane tests (run by glmctl.collectives.harness in spawned
processes that share one GPU). Each returns plain data; the tests assert on it in the parent."""

from __future__ import annotations

import os
import signal
import time

MiB = 1 << 20
DTYPES = ("bfloat16", "float16", "float32")
# relative rounding allowance of the output dtype (one ulp), and of fp32 accumulation
ULP = {"bfloat16": 2.0**-8, "float16": 2.0**-10, "float32": 2.0**-22}


_DEVICE: int | None = None


def _torch(rank: int | None = None):
    """torch with this process's GPU chosen once: GPU 0 (the ranks share one GPU), or with
    GLMCTL_COLLECTIVES_SPREAD=1 GPU `rank % device_count` (one process per GPU: bench/multigpu.sh)."""
    global _DEVICE
    import torch

    if _DEVICE is None or rank is not None:
        spread = os.environ.get("GLMCTL_COLLECTIVES_SPREAD") == "1" and rank is not None
        _DEVICE = rank % torch.cuda.device_count() if spread else (_DEVICE or 0)
        torch.cuda.set_device(_DEVICE)
    return torch


def gen(seed: int, numel: int, dtype):
    """Fresh standard-normal data, the same in every process for the same seed."""
    torch = _torch()
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    return torch.randn(numel, generator=g, device="cuda", dtype=torch.float32).to(dtype)


def checksum(t) -> int:
    """A position-weighted sum of the output's raw bits: equal on two ranks iff (almost surely)
    their bytes are equal."""
    torch = _torch()
    flat = t.contiguous().view(-1)
    words = flat.view(torch.int16) if flat.element_size() == 2 else flat.view(torch.int32)
    w = words.to(torch.int64)
    idx = torch.arange(w.numel(), device=w.device, dtype=torch.int64) % 65521 + 1
    return int((w * idx).sum().item()) ^ (int(w.sum().item()) << 1)


def _communicator(rank, world, session, max_bytes, **kw):
    _torch(rank)
    from glmctl.collectives import HostStagedCommunicator

    return HostStagedCommunicator(rank, world, session, max_bytes, **kw)


def correctness(rank: int, world: int, session: str, cases: list[dict], max_bytes: int) -> list[dict]:
    """Run every case (op, dtype, numel, int8, engines, one_shot_max_bytes, direct, dim) and
    report, per case, the error against an fp64 sum (or exact concatenation) and a checksum."""
    torch = _torch(rank)
    from dataclasses import replace

    from glmctl.collectives import CopyEngines
    from glmctl.collectives.call_plan import DirectLimits

    comm = _communicator(rank, world, session, max_bytes, timeout_s=30)
    defaults = comm.options
    cap = defaults.direct.capacity
    direct_kinds = {"ll": DirectLimits(ll_max_bytes=256 * 1024, capacity=cap),
                    "1s": DirectLimits(one_shot_max_bytes=512 * 1024, capacity=cap),
                    "2s": DirectLimits(two_shot_max_bytes=448 * 1024, capacity=cap),
                    "default": defaults.direct,
                    None: DirectLimits(capacity=cap)}
    rows = []
    try:
        for i, case in enumerate(cases):
            dtype = getattr(torch, case["dtype"])
            numel, int8 = case["numel"], case["int8"]
            eng = case["engines"]
            comm.options = replace(
                defaults, engines=defaults.engines if eng == "auto" else CopyEngines.uniform(eng),
                one_shot_max_bytes=case.get("one_shot_max_bytes", 256 * 1024),
                direct=direct_kinds[case.get("direct")])
            seeds = [1_000_003 * (i + 1) + j for j in range(world)]
            inputs = [gen(s, numel, dtype) for s in seeds]
            x = inputs[rank].clone()
            if case["op"] == "all_reduce":
                plan = comm.plan("all_reduce", x, int8)
                out = comm.all_reduce(x, int8=int8)
                ref = torch.zeros(numel, dtype=torch.float64, device="cuda")
                for t in inputs:
                    ref += t.double()
                in_place = out.data_ptr() == x.data_ptr()
            else:
                shape, dim = case["shape"], case["dim"]
                x = x.view(shape)
                plan = comm.plan("all_gather", x, int8)
                out = comm.all_gather(x, dim, int8=int8)
                ref = torch.cat([t.view(shape) for t in inputs], dim=dim).double()
                in_place = False
            diff = (out.double() - ref).reshape(-1)
            if int8:
                err = (diff.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
                ok = err <= 0.01
            elif case["op"] == "all_gather":
                err = diff.abs().max().item()
                ok = err == 0.0
            else:
                scale = max(t.abs().max().item() for t in inputs)
                tol = ULP[case["dtype"]] * ref.abs().reshape(-1) + world * 2.0**-23 * scale
                err = (diff.abs() / tol).max().item()
                ok = err <= 1.0
            rows.append({"i": i, "ok": ok, "err": err, "algorithm": plan.algorithm,
                         "d2h": plan.d2h, "h2d": plan.h2d, "in_place": in_place,
                         "shape": list(out.shape), "checksum": checksum(out)})
            del inputs, x, out, ref, diff
    finally:
        comm.close()
    return rows


def graph_replays(rank: int, world: int, session: str, replays: int) -> dict:
    """Capture one graph holding six collectives (bf16 all-reduces on the direct path, one native
    shot at 32 KiB, one (2 ranks) or two (4 ranks) at 256 KiB, and on a barrier path at 2 MiB;
    INT8 all-reduce; fp16 all-gather along the last dim (LL words); INT8 all-gather), then replay
    it `replays` times with fresh inputs written into the static buffers before every replay."""
    torch = _torch(rank)
    comm = _communicator(rank, world, session, 4 * MiB, timeout_s=30)
    specs = {  # name: (numel, dtype)
        "ar_small": (16384, torch.bfloat16),
        "ar_mid": (128 * 1024, torch.bfloat16),
        "ar_large": (MiB + 77, torch.bfloat16),
        "ar_int8": (MiB, torch.bfloat16),
        "ag": (32 * 96, torch.float16),
        "ag_int8": (4096 + 5, torch.bfloat16),
    }
    bufs = {k: torch.zeros(n, dtype=dt, device="cuda") for k, (n, dt) in specs.items()}
    ars = ("ar_small", "ar_mid", "ar_large", "ar_int8")
    outs = {k: torch.empty_like(bufs[k]) for k in ars}

    def body():
        comm.all_reduce(bufs["ar_small"], out=outs["ar_small"], int8=False)
        comm.all_reduce(bufs["ar_mid"], out=outs["ar_mid"], int8=False)
        comm.all_reduce(bufs["ar_large"], out=outs["ar_large"], int8=False)
        comm.all_reduce(bufs["ar_int8"], out=outs["ar_int8"], int8=True)
        ag = comm.all_gather(bufs["ag"].view(32, 96), -1, int8=False)
        ag8 = comm.all_gather(bufs["ag_int8"], 0, int8=True)
        return ag, ag8

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()  # eager warm-up compiles every kernel outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with comm.capture():
        with torch.cuda.graph(graph):
            ag, ag8 = body()
    worst = torch.zeros(6, dtype=torch.float64, device="cuda")
    sums = torch.zeros(6, dtype=torch.int64, device="cuda")
    t0 = time.monotonic()
    for it in range(replays):
        inputs = {k: [gen(7919 * it + 131 * j + idx, n, dt) for j in range(world)]
                  for idx, (k, (n, dt)) in enumerate(specs.items())}
        for k in specs:
            bufs[k].copy_(inputs[k][rank])
        graph.replay()
        for idx, k in enumerate(ars):
            ref = sum(t.double() for t in inputs[k])
            if k == "ar_int8":
                e = (outs[k].double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt() / 0.01
            else:
                e = ((outs[k].double() - ref).abs() / (2.0**-8 * ref.abs() + 1e-6)).max()
            worst[idx] = torch.maximum(worst[idx], e)
        ref_ag = torch.cat([t.view(32, 96) for t in inputs["ag"]], dim=-1).double()
        worst[4] = torch.maximum(worst[4], (ag.double() - ref_ag).abs().max())
        ref8 = torch.cat(inputs["ag_int8"]).double()
        e8 = (ag8.double() - ref8).pow(2).mean().sqrt() / ref8.pow(2).mean().sqrt() / 0.01
        worst[5] = torch.maximum(worst[5], e8)
        for idx, t in enumerate((*(outs[k] for k in ars), ag, ag8)):
            w = t.reshape(-1).view(torch.int16).to(torch.int64)
            sums[idx] += (w * (torch.arange(w.numel(), device="cuda") % 251 + 1)).sum()
    torch.cuda.synchronize()
    elapsed = time.monotonic() - t0
    comm.check()
    comm.close()
    return {"worst": worst.tolist(), "checksums": sums.tolist(), "replays": replays,
            "seconds": elapsed}


def lose_a_rank(rank: int, world: int, session: str, victim: int, mode: str,
                timeout_s: float, numel: int = 4096) -> dict:
    """All ranks run a few all-reduces of `numel` bf16 elements (4096: the direct path by default;
    262144: a barrier path); then the victim dies (mode "kill": SIGKILL) or goes silent ("stall":
    sleeps past the timeout). The others keep calling all_reduce until one raises."""
    torch = _torch(rank)
    from glmctl.collectives import CollectiveError

    comm = _communicator(rank, world, session, MiB, timeout_s=timeout_s)
    x = torch.ones(numel, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        comm.all_reduce(x)
    torch.cuda.synchronize()
    comm.host_barrier("the fault test's start", 30)
    if rank == victim:
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(timeout_s * 3)
        try:
            comm.all_reduce(x)
            torch.cuda.synchronize()
            seen = "no error"
        except CollectiveError as exc:
            seen = str(exc)
        comm.close()
        return {"victim": True, "error": seen}
    t0 = time.monotonic()
    err = None
    try:
        while time.monotonic() - t0 < 60:
            comm.all_reduce(x)
            torch.cuda.synchronize()
    except CollectiveError as exc:
        err = exc
    elapsed = time.monotonic() - t0
    t1 = time.monotonic()
    comm.close()
    return {"victim": False, "error": str(err) if err else None,
            "culprit": getattr(err, "rank", None), "elapsed": elapsed,
            "close_s": time.monotonic() - t1}
