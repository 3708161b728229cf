#!/usr/bin/env python3
"""Host-staged collectives with the ranks as threads of one process on one GPU: the thread rig.

    python bench/gpu/collectives_threads.py --out DIR [--budget-s 100] [--worlds 2 4 8]
                                            [--phases small sweep] [--max-mb 256]

What each rig measures. Here (threads): N ranks are N threads of one process, each with its own
CUDA stream in the one context, each with its own `HostStagedCommunicator` on one shared pinned
segment (mapped and registered once), running the production data paths and flag protocol:
stream memory operations in the stream front end, or the direct path's kernels polling host
memory. No context switches, so this is the protocol's own cost: flag writes and polls through
pinned host memory, copy-engine or SM copies, the reduction, the barriers. All N ranks' bytes
cross this GPU's one PCIe link (the node gives each rank its own). `bench/collectives.py` (N
processes time-slicing the GPU) measures what the processes pay on top: the context switches.

Timing: each case is captured as a CUDA graph of `calls` back-to-back collectives per rank; every
rank's stream waits on a host word before its start event, released once every rank has enqueued
its replays, so the ranks start together; time = the slowest rank's event time / calls. Eager
rows time the same calls launched one by one (GPU events; N Python threads share one GIL, so
small eager messages mostly measure launching). #wrong counts, over every rank and every call of
the last replay: native payloads, elements not bitwise equal to the fp32 sum in rank order (what
the kernels compute); all-gathers, elements not equal to the concatenation; INT8, all elements of
a result whose relative RMS error to the exact sum exceeds 1%; and elements that differ from rank
0's result. Sizes: nccl-tests' convention (all-reduce: the input; all-gather: the output), with
`rank_bytes` each rank's input. busbw = algbw * 2(n-1)/n (all-reduce) or (n-1)/n (all-gather).

Phases, in priority order (each case starts only if the budget allows): `small` compares the
small-message paths at 2, 4, 8 ranks, all-reduce 4-256 KiB and the logits gathers (the barrier
path with SM copies; the direct path as LL words, one native shot, two native shots), and times
their parts alone (a barrier pair, a fence, a kernel launch); `decode` runs the default (auto)
paths at the sizes vLLM's decode issues (all-reduce of 1, 4, 8, 32, 48 tokens x 4096 bf16, and
4-64 KiB; INT8 payloads requested at the decode sizes, with their error: the plan sends those the
direct path reaches as INT8 records in its two shots, `direct_2s_int8`, the rest on the barrier
paths; the logits gathers);
`sweep` (not by default) is the nccl-tests-style sweep 4 KiB-256 MiB plus the prefill sizes.
Results go to DIR/collectives-h200-threads.json after every phase; last, the decode step's
collectives on the node predicted with this run's fitted terms (`decode_step_prediction`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

# one hardware queue per stream: ranks whose streams shared a queue could block each other's waits
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from collectives_threads_report import (  # noqa: E402
    KiB,
    MiB,
    compact_table,
    decode_prediction,
    derive,
    markdown,
    targets,
)

SIZES = [4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB, 8 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
SMALL = [4 * KiB, 8 * KiB, 16 * KiB, 32 * KiB, 64 * KiB, 128 * KiB, 256 * KiB]  # all-reduce bytes
HIDDEN, VOCAB_RANK, PREFILL_CHUNK = 4096, 19_360, 2048  # vocab / 8 ranks (64-aligned): logits
DECODE_TOKENS = (1, 4, 8, 32, 48)
SMALL_PATHS = ("memops-sm", "direct-ll", "direct-1s", "direct-2s")
GO_OFFSET = 192  # a free header word: the start gate of every timed replay
DIRECT_CAP = 512 * KiB


class NullSync:
    """A Sync that waits for nobody: a rank's solo dry run."""

    def barrier(self, b, stream):
        pass

    def fence(self, stream):
        pass


@dataclass(frozen=True)
class Case:
    op: str  # all_reduce | all_gather | barrier | fence | launch
    dtype: str  # bf16 | int8 | fp32
    rank_numel: int
    variant: str = "default"
    graph: bool = True
    label: str = ""

    def rank_bytes(self) -> int:
        return self.rank_numel * (4 if self.dtype == "fp32" else 2)


@dataclass
class Phase:
    name: str
    world: int
    max_bytes: int
    cases: list[Case] = field(default_factory=list)


def variants(engines, world: int):
    """Option overrides by name, applied to each communicator's PathOptions."""
    from glmctl.collectives.call_plan import DirectLimits, default_direct

    off = DirectLimits(capacity=DIRECT_CAP)
    return {
        "default": dict(direct=default_direct(world, DIRECT_CAP)),
        "memops-sm": dict(direct=off, engines=replace(engines, d2h_small="sm", h2d_small="sm")),
        "direct-ll": dict(direct=DirectLimits(ll_max_bytes=DIRECT_CAP // 2, capacity=DIRECT_CAP)),
        "direct-1s": dict(direct=DirectLimits(one_shot_max_bytes=DIRECT_CAP, capacity=DIRECT_CAP)),
        "direct-2s": dict(direct=DirectLimits(two_shot_max_bytes=DIRECT_CAP, capacity=DIRECT_CAP)),
    }


def plan_phases(worlds: list[int], phases: list[str], max_mb: int,
                skip: tuple[str, ...] = (), only: tuple[str, ...] = ()) -> list[Phase]:
    """The phases' cases, without variants in `skip` (only those in `only`, if given)."""
    out = _all_phases(worlds, phases, max_mb)
    for ph in out:
        ph.cases = [c for c in ph.cases if c.variant not in skip and (not only or c.variant in only)]
    return [ph for ph in out if any(c.op in ("all_reduce", "all_gather") for c in ph.cases)]


def _all_phases(worlds: list[int], phases: list[str], max_mb: int) -> list[Phase]:
    sizes = [s for s in SIZES if s <= max_mb * MiB]
    decode_ar = [HIDDEN * t for t in DECODE_TOKENS]  # elements per rank
    logits = [VOCAB_RANK * t for t in DECODE_TOKENS[:4]]  # bf16 elements per rank
    out = []
    for w in worlds:
        if "small" in phases:
            ph = Phase("small", w, 4 * MiB)
            ph.cases += [Case(op, "bf16", 0, "memops-sm") for op in ("barrier", "fence", "launch")]
            for v in SMALL_PATHS:
                ph.cases += [Case("all_reduce", "bf16", b // 2, v) for b in SMALL]
                if v != "direct-2s":  # a gather has one shot
                    ph.cases += [Case("all_gather", "bf16", n, v, label=f"logits x{t} tokens")
                                 for n, t in zip(logits[:2], DECODE_TOKENS[:2], strict=True)]
            out.append(ph)
        if "decode" in phases:  # the auto paths at the sizes decode issues
            ph = Phase("decode", w, 4 * MiB)
            sizes_ar = sorted({*(b // 2 for b in SMALL[:5]), *decode_ar})
            label = {n: f"decode x{t} tokens" for n, t in zip(decode_ar, DECODE_TOKENS, strict=True)}
            ph.cases += [Case("all_reduce", "bf16", n, label=label.get(n, "")) for n in sizes_ar]
            ph.cases += [Case("all_reduce", "int8", n, label=label[n] + ", INT8 requested")
                         for n in decode_ar]
            ph.cases += [Case("all_gather", "bf16", n, label=f"logits x{t} tokens")
                         for n, t in zip(logits, DECODE_TOKENS, strict=False)]
            out.append(ph)
        if "sweep" in phases:
            big = Phase("sweep", w, max(sizes))
            for s in sizes:  # the largest messages last
                label = "prefill chunk (2048 tokens)" if s == PREFILL_CHUNK * HIDDEN * 2 else ""
                for graph in (True, False):
                    big.cases += [Case("all_reduce", "bf16", s // 2, graph=graph, label=label),
                                  Case("all_reduce", "int8", s // 2, graph=graph, label=label),
                                  Case("all_gather", "bf16", s // 2 // w, graph=graph)]
            out.append(big)
    order = {"decode": 0, "small": 1, "sweep": 2}
    return sorted(out, key=lambda p: (order[p.name], p.world))


def calls_for(nbytes: int) -> tuple[int, int]:
    """(collectives per graph, timed replays)."""
    if nbytes <= MiB:
        return 20, 5
    return (4, 3) if nbytes <= 16 * MiB else (1, 2)


class Rig:
    """N rank threads around one pinned segment; `run(case)` runs it on every rank."""

    def __init__(self, world: int, max_bytes: int, engines, timeout_s: float = 5.0):
        import torch

        from glmctl.collectives.call_plan import slot_capacity
        from glmctl.collectives.cuda_driver import driver
        from glmctl.collectives.host_staged_communicator import PinnedSegment
        from glmctl.collectives.segment import SharedSegment

        torch.cuda.set_device(0)
        torch.zeros(1, device="cuda")
        self.world, self.drv = world, driver()
        t0 = time.perf_counter()
        self.seg = SharedSegment.create(f"threads{os.getpid()}w{world}", world,
                                        slot_capacity(max_bytes, world), DIRECT_CAP)
        self.drv.host_register(self.seg.address, self.seg.size)
        self.base = self.drv.device_pointer(self.seg.address)
        self.setup_s = time.perf_counter() - t0
        self.pinned = PinnedSegment(self.seg, self.base)
        self.variants = variants(engines, world)
        self.barrier = threading.Barrier(world + 1, timeout=300)  # main thread and ranks
        self.rank_barrier = threading.Barrier(world, timeout=30)  # the ranks within a case
        self.lock = threading.Lock()  # Triton compiles and graph captures, one rank at a time
        self.case: Case | None = None
        self.results: list = [None] * world
        self.shared: dict = {}
        self.comms: list = [None] * world
        self.base_options: list = [None] * world
        self.graphs_run = [0] * world
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._rank, args=(r, max_bytes, engines, timeout_s),
                                         name=f"rank{r}", daemon=True) for r in range(world)]
        for t in self.threads:
            t.start()
        self._sync_main()  # communicators built
        if self.errors:
            raise RuntimeError(self.errors[0])

    def _sync_main(self):
        self.barrier.wait()

    def _rank(self, r: int, max_bytes: int, engines, timeout_s: float) -> None:
        import torch

        from glmctl.collectives.host_staged_communicator import HostStagedCommunicator

        torch.cuda.set_device(0)
        stream = torch.cuda.Stream()
        torch.cuda.set_stream(stream)
        try:
            self.comms[r] = HostStagedCommunicator(r, self.world, "threads", max_bytes, device=0,
                                                   copy_engines=engines, timeout_s=timeout_s,
                                                   init_timeout_s=20, direct_capacity=DIRECT_CAP,
                                                   pinned=self.pinned)
            self.base_options[r] = self.comms[r].options
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            self.errors.append(f"rank {r}: {exc!r}")
        self.barrier.wait()
        while True:
            try:
                self.barrier.wait()  # a case (or None: stop) was posted
            except threading.BrokenBarrierError:
                return
            case = self.case
            if case is None or self.comms[r] is None:
                return
            try:
                self.results[r] = self._run_rank(r, case, stream)
                self.barrier.wait()  # case done
            except BaseException as exc:  # noqa: BLE001 - the case fails, the rig is done
                self.results[r] = {"error": f"{type(exc).__name__}: {exc}"}
                self.rank_barrier.abort()
                self.barrier.abort()
                return

    def run(self, case: Case) -> list[dict]:
        self.case = case
        self.results = [None] * self.world
        self.shared = {}
        try:
            self.barrier.wait()
            self.barrier.wait()
        except threading.BrokenBarrierError:
            time.sleep(0.5)  # let every rank record its error
        return self.results

    def close(self) -> None:
        import torch

        self.case = None
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            pass
        for t in self.threads:
            t.join(timeout=30)
        for c in self.comms:
            if c is not None:
                try:
                    c.close()
                except Exception:  # noqa: BLE001
                    pass
        torch.cuda.synchronize()
        self.drv.host_unregister(self.seg.address)
        self.seg.unlink()
        self.seg.close()

    # ---- one rank's part of one case ----------------------------------------------------------
    def _run_rank(self, r: int, case: Case, stream) -> dict:
        import torch

        from glmctl.collectives import datapath, kernels

        comm = self.comms[r]
        comm.options = replace(self.base_options[r], **self.variants[case.variant])
        calls, replays = calls_for(max(case.rank_bytes(), 1) * (self.world if case.op ==
                                                                "all_gather" else 1))
        dtype = torch.float32 if case.dtype == "fp32" else torch.bfloat16
        int8 = case.dtype == "int8"
        x = None
        outs: list = []
        if case.op in ("all_reduce", "all_gather"):
            g = torch.Generator(device="cuda")
            g.manual_seed(7919 * r + case.rank_numel)
            x = torch.randn(case.rank_numel, generator=g, device="cuda").to(dtype)
            self.shared[("x", r)] = x
            if case.op == "all_reduce":
                outs = [torch.empty_like(x) for _ in range(calls)]

        def call(i: int):
            if case.op == "all_reduce":
                comm.all_reduce(x, out=outs[i], int8=int8)
                return outs[i]
            if case.op == "all_gather":
                return comm.all_gather(x, 0, int8=False)
            if case.op == "barrier":
                comm.sync.barrier(0, stream.cuda_stream)
                comm.sync.barrier(1, stream.cuda_stream)
            elif case.op == "fence":
                comm.sync.fence(stream.cuda_stream)
            else:
                kernels.bump_progress(comm.staging.progress)
            return None

        plan = comm.plan(case.op, x, int8) if x is not None else None
        with self.lock:
            # First a solo dry run: it compiles and loads every kernel this rank's call launches
            # while no wait on a peer is pending (in one context, loading a kernel may wait for
            # the whole context, and a pending wait needs a peer that cannot run: it holds no
            # lock). Direct-path kernels run it against an abort word that is already set, so
            # their polls give up after `ABORT_EVERY` tries; every rank bumps its epochs by the
            # same one call, and the flags it leaves carry an epoch no later call waits for.
            if case.op == "launch":
                kernels.bump_progress(comm.staging.progress)
            elif plan is not None:
                scratch = torch.empty(x.numel() * (self.world if case.op == "all_gather" else 1),
                                      dtype=x.dtype, device=x.device)
                staging = comm.staging
                if plan.algorithm.startswith("direct"):
                    aborted = torch.ones(1, dtype=torch.int32, device=x.device)
                    self.shared[("aborted", r)] = aborted  # alive until the stream is done
                    staging = replace(staging, direct=replace(staging.direct,
                                                              abort=aborted.data_ptr()))
                datapath.enqueue(plan, staging, NullSync(), x, scratch, stream.cuda_stream)
            stream.synchronize()
        self.rank_barrier.wait()
        with self.lock:  # the real warm-up: compiles whatever the dry run did not
            call(0)
        stream.synchronize()  # never the whole device: another rank may be capturing
        self.rank_barrier.wait()
        t_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if case.graph:
            graph = torch.cuda.CUDAGraph()
            with comm.capture():  # its exit waits for every rank's capture: only then replay
                with self.lock:
                    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                        results = [call(i) for i in range(calls)]
            graph.replay()
            stream.synchronize()
            self.rank_barrier.wait()
            self.graphs_run[r] += 1
            key = self.graphs_run[r]  # the same on every rank: they run the same cases
            self.drv.wait_value(stream.cuda_stream, self.base + GO_OFFSET, key)
            t_ev[0].record(stream)
            for _ in range(replays):
                graph.replay()
            t_ev[1].record(stream)
            self.rank_barrier.wait()
            if r == 0:
                self.seg.set_word_at(GO_OFFSET, key)
            t_ev[1].synchronize()
            us = t_ev[0].elapsed_time(t_ev[1]) * 1000 / (replays * calls)
        else:
            t_ev[0].record(stream)
            results = [call(i) for i in range(calls)]
            t_ev[1].record(stream)
            t_ev[1].synchronize()
            us = t_ev[0].elapsed_time(t_ev[1]) * 1000 / calls
        comm.check()
        self.shared[("out", r)] = [t for t in results if t is not None]
        stream.synchronize()
        self.rank_barrier.wait()
        wrong, rel = self._count_wrong(case) if r == 0 and x is not None else (0, None)
        self.rank_barrier.wait()
        row = {"us": us, "wrong": wrong, "calls": calls, "replays": replays if case.graph else 1}
        if rel is not None:
            row["rel_err"] = rel
        if plan is not None:
            d2h, h2d = plan.bytes_moved()
            row.update(algorithm=plan.algorithm, d2h=plan.d2h, h2d=plan.h2d,
                       payload_bytes_d2h=d2h, payload_bytes_h2d=h2d)
        if case.graph:
            del graph
        return row

    def _count_wrong(self, case: Case) -> tuple[int, float | None]:
        """(#wrong, for INT8 the worst relative RMS error of a result against the exact sum)."""
        import torch

        xs = [self.shared[("x", j)] for j in range(self.world)]
        outs = [self.shared[("out", j)] for j in range(self.world)]
        if case.op == "all_gather":
            ref = torch.cat(xs)
            return sum(int((o.view(-1) != ref).sum()) for per in outs for o in per), None
        wrong, worst = 0, None
        if case.dtype == "int8":
            exact = sum(t.double() for t in xs)
            norm = exact.pow(2).mean().sqrt()
            worst = 0.0
            for per in outs:
                for o in per:
                    rel = float((o.double() - exact).pow(2).mean().sqrt() / norm)
                    worst = max(worst, rel)
                    wrong += o.numel() if not rel <= 0.01 else 0
        else:
            acc = torch.zeros(xs[0].numel(), dtype=torch.float32, device=xs[0].device)
            for t in xs:
                acc += t.float()
            ref = acc.to(xs[0].dtype)
            wrong += sum(int((o != ref).sum()) for per in outs for o in per)
        first = outs[0][0].view(torch.int16 if outs[0][0].element_size() == 2 else torch.int32)
        for per in outs[1:]:
            for o in per:
                wrong += int((o.view(first.dtype) != first).sum())
        return wrong, worst



def measure(args) -> dict:
    import importlib.util

    import torch
    import triton

    from glmctl.collectives.calibration import CollectivesCalibration, calibrate
    from glmctl.collectives.call_plan import DIRECT_BY_WORLD

    t_start = time.monotonic()
    deadline = t_start + args.budget_s
    path = args.out / "collectives-h200-threads.json"
    old = json.loads(path.read_text()) if args.append and path.exists() else None
    if old is not None:  # the same machine a moment ago: its ceiling and calibration
        ceil = old["ceiling"]
        cal = CollectivesCalibration.model_validate(old["meta"]["calibration"])
    else:
        spec = importlib.util.spec_from_file_location("hs_bench", ROOT / "bench" / "collectives.py")
        hs_bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(hs_bench)
        ceil = hs_bench.ceiling(64 * MiB)
        cal = calibrate(save=True)
    engines = cal.engines()
    print(f"ceiling: D2H {ceil['d2h']:.1f} GB/s, H2D {ceil['h2d']:.1f} GB/s, both at once "
          f"{ceil['bidir_each']:.1f} GB/s each (64 MiB copies); copy engines {engines}", flush=True)
    doc = {"meta": {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                    "triton": triton.__version__, "method": __doc__,
                    "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "calibration": cal.model_dump(mode="json"),
                    "default_direct": {n: str(v) for n, v in DIRECT_BY_WORLD.items()},
                    "direct_polls": "per round",  # every peer polled at once (`cost_terms`)
                    "label": "measured on 1x H200, ranks as threads of one process (thread rig)"},
           "ceiling": ceil, "raw": [], "skipped": [], "errors": []}
    if old is not None:
        for k in ("raw", "skipped", "errors"):
            doc[k] = old.get(k, []) + doc[k]
    for phase in plan_phases(args.worlds, args.phases, args.max_mb, tuple(args.skip),
                             tuple(args.only)):
        if time.monotonic() > deadline - 5:
            doc["skipped"] += [f"{phase.name} w{phase.world}: all {len(phase.cases)} cases"]
            continue
        t0 = time.monotonic()
        try:
            rig = Rig(phase.world, phase.max_bytes, engines)
        except Exception as exc:  # noqa: BLE001
            doc["errors"].append(f"{phase.name} w{phase.world}: rig: {exc!r}")
            print(doc["errors"][-1], flush=True)
            continue
        done, failed = 0, set()
        for i, case in enumerate(phase.cases):
            if time.monotonic() > deadline - 3:
                doc["skipped"].append(f"{phase.name} w{phase.world}: {len(phase.cases) - i} cases")
                break
            if case.variant in failed:
                continue
            res = rig.run(case)
            bad = [x for x in res if not x or "error" in x]
            if bad:
                doc["errors"].append(f"{phase.name} w{phase.world} {case}: "
                                     f"{(bad[0] or {}).get('error', 'no result')}")
                print(doc["errors"][-1], flush=True)
                failed.add(case.variant)  # the rig's barriers are broken: a fresh rig goes on
                rig.close()
                rig = Rig(phase.world, phase.max_bytes, engines)
                continue
            doc["raw"].append({"phase": phase.name, "world": phase.world, **case.__dict__,
                               "rank_bytes": case.rank_bytes(), "us": max(x["us"] for x in res),
                               **{k: v for k, v in res[0].items() if k != "us"}})
            done += 1
        rig.close()
        print(f"{phase.name} w{phase.world}: {done}/{len(phase.cases)} cases in "
              f"{time.monotonic() - t0:.0f} s (rig set-up {rig.setup_s:.1f} s)", flush=True)
        write(args.out, doc)
    doc["meta"]["seconds"] = round(time.monotonic() - t_start, 1)
    return doc


def write(out: Path, doc: dict) -> None:
    rows = derive(doc["raw"], doc["ceiling"])
    doc["rows"], doc["targets"] = rows, targets(rows)
    try:  # a prediction that fails never costs the run its record
        doc.update(decode_prediction(doc))
    except Exception as exc:  # noqa: BLE001
        doc["decode_step_prediction_error"] = f"{type(exc).__name__}: {exc}"
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "collectives-h200-threads.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(out / "collectives-h200-threads.json")
    (out / "collectives-h200-threads.md").write_text(markdown(doc))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("out/collectives-threads"))
    ap.add_argument("--budget-s", type=float, default=100.0)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--phases", nargs="+", default=["decode", "small"])
    ap.add_argument("--max-mb", type=int, default=256)
    ap.add_argument("--skip", nargs="*", default=[], help="path variants to leave out")
    ap.add_argument("--only", nargs="*", default=[], help="only these path variants")
    ap.add_argument("--append", action="store_true", help="add to the rows already in --out")
    ap.add_argument("--from-json", type=Path, help="re-derive the report from an earlier run")
    args = ap.parse_args()
    if args.from_json:  # re-derive, and print the compact table
        doc = json.loads(args.from_json.read_text())
        write(args.out, doc)
        print(compact_table(doc))
    else:
        write(args.out, measure(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
