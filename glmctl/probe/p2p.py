"""Peer-to-peer: what the driver reports, and whether a real cross-process P2P write works.

Drivers inside VMs can report P2P that silently drops writes (ACS + IOMMU translation), which is
how vLLM's custom all-reduce hangs on such nodes. So each ordered pair (src, dst) is tested the way
a tensor-parallel all-reduce would use it: a process owning GPU `dst` allocates a buffer and
shares it through CUDA IPC; a second process on GPU `src` maps it and writes a pattern with a
kernel running on `src` (SM stores across the bus, not a copy-engine copy, which works even without
P2P). The owner checks every element. Each pair runs in its own subprocess with a deadline, so a
hanging P2P path becomes "timeout", not a hung doctor.

    python -m glmctl.probe.p2p SRC DST     # one pair; prints one JSON line
"""

from __future__ import annotations

import json
import subprocess
import sys

from glmctl.probe.doctor_report import P2PPair

PAIR_TIMEOUT_S = 30.0
N_ELEMENTS = 1 << 20  # 4 MiB of int32: many pages, several 2 MiB mappings


def classify(cuda_can_access: bool | None, write: str) -> str:
    """The pair's state from the driver's claim and the write test."""
    if write == "skipped":
        return "untested"
    if cuda_can_access:
        return "ok" if write == "pass" else "reported-but-broken"
    return "not-reported-but-works" if write == "pass" else "not-supported"


def test_pair(src: int, dst: int, nvml_status: str | None, timeout_s: float = PAIR_TIMEOUT_S) -> P2PPair:
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "glmctl.probe.p2p", str(src), str(dst)],
            capture_output=True, text=True, timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return P2PPair(src=src, dst=dst, nvml=nvml_status, write_test="timeout",
                       state="reported-but-broken", detail=f"no answer within {timeout_s:.0f} s (hung P2P write)")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return P2PPair(src=src, dst=dst, nvml=nvml_status, write_test="error", state="error", detail=tail)
    r = json.loads(lines[-1])
    return P2PPair(src=src, dst=dst, nvml=nvml_status, cuda_can_access=r["can_access"],
                   write_test=r["write"], state=classify(r["can_access"], r["write"]), detail=r.get("detail", ""))


def probe_p2p(n_gpus: int, nvml: dict[tuple[int, int], str] | None) -> list[P2PPair]:
    nvml = nvml or {}
    return [test_pair(i, j, nvml.get((i, j))) for i in range(n_gpus) for j in range(n_gpus) if i != j]


# ----------------------------------------------------------------------------------------------
# The worker: runs in its own process (python -m glmctl.probe.p2p SRC DST).


def _pattern(n: int, device):
    import torch

    return (torch.arange(n, dtype=torch.int32, device=device) * 3 + 7)


def _writer(buf, src: int, results) -> None:
    """Child process: `buf` arrives through CUDA IPC (memory of GPU dst); write it from GPU src."""
    try:
        import torch
        import triton
        import triton.language as tl

        @triton.jit
        def write_pattern(ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(ptr + offs, offs * 3 + 7, mask=offs < n)

        dst = buf.device.index
        torch.cuda.set_device(src)
        can = torch.cuda.can_device_access_peer(src, dst)
        # A cross-device copy makes torch enable peer access src -> dst when the driver allows it.
        torch.empty(1, device=f"cuda:{dst}").copy_(torch.ones(1, device=f"cuda:{src}"))
        with torch.cuda.device(src):
            write_pattern[(triton.cdiv(buf.numel(), 1024),)](buf, buf.numel(), BLOCK=1024)
            torch.cuda.synchronize(src)
        results.put(("done", can, ""))
    except Exception as exc:  # noqa: BLE001 - reported to the owner, which classifies it
        results.put(("error", None, f"{type(exc).__name__}: {exc}"))


def _main(src: int, dst: int) -> None:
    import torch
    import torch.multiprocessing as mp

    can = torch.cuda.can_device_access_peer(src, dst)
    buf = torch.zeros(N_ELEMENTS, dtype=torch.int32, device=f"cuda:{dst}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_writer, args=(buf, src, results))
    child.start()
    status, child_can, detail = results.get(timeout=PAIR_TIMEOUT_S - 5)
    child.join(timeout=5)
    torch.cuda.synchronize(dst)
    if status == "error":
        write = "error"
    else:
        wrong = int((buf != _pattern(N_ELEMENTS, buf.device)).sum())
        write = "pass" if wrong == 0 else "fail"
        detail = "" if wrong == 0 else f"{wrong} of {N_ELEMENTS} elements not written (writes dropped)"
    print(json.dumps({"can_access": bool(can if child_can is None else child_can), "write": write, "detail": detail}))


if __name__ == "__main__":
    _main(int(sys.argv[1]), int(sys.argv[2]))
