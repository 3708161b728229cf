"""How long the gpu lane's processes may take and when each starts, from what the first H200 run
measured; the subprocess jobs themselves, their phase markers and their clean-up.

The first run (2026-12-01, H200, 16 CPU cores, every cache empty; the eager engine's log is
tests/unit/fixtures/gpu-lane/eager-first-run.log) gave the eager engine 150 s and killed it in its
first request. Its phases, from vLLM's own timestamps:

  start       <= 24 s   interpreter, torch and vLLM imports before vLLM's first line (not logged;
                        bounded by the kill at 150 s and the last line at 22:30:47)
  inspect       25 s    "non-default args" -> "Resolved architecture": vLLM inspects the model
                        class in a fresh interpreter when its model-info cache is empty
  init        65.2 s    vLLM's "init engine ... took": load 1.3 s, KV + profile run 13 s, warm-up
                        50 s (Triton JIT of the warm-up shapes)
  requests    >= 32 s   the first prompt-log-prob batch: ten kernels JIT-compiled for the real
                        prompt lengths (jit_monitor), still compiling when killed

Stage A was four processes on 16 cores (the eager engine, the transformers reference, two
quantisers), so this was one engine's cold start, not contention. Everything slow here is a cache
the first engine fills (Triton's kernels, vLLM's model info, Inductor's graphs) and later engines
read, so the lane runs the eager engine first as the warm-up, points every process at one cache
(`CACHE_ENV`), and starts the other engines once the eager engine's first requests are done.

Limits are the expected time with a 1.5x margin; what was not measured is estimated and says so.
Every limit is also cut to the lane's deadline, so the whole run ends within its budget.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

MARGIN = 1.5
FIRST_RUN_EAGER_S = {"start": 24.0, "inspect": 25.0, "init": 65.2, "requests_seen": 32.0}
# not measured: the decode-path kernels' JIT (as many as the prefill's, estimated at the same
# 32 s) and the greedy runs themselves (~430 decode steps at <= 50 ms)
UNMEASURED_EAGER_S = {"decode_jit": 32.0, "greedy": 20.0}
COLD_ENGINE_S = round(MARGIN * (sum(FIRST_RUN_EAGER_S.values()) + sum(UNMEASURED_EAGER_S.values())))
# with the caches filled: start + cached model info + load and profile without JIT, then (not
# measured on the tiny model) torch.compile and graph capture, and the requests
WARM_EAGER_S = round(MARGIN * (24 + 3 + 15 + 25))
WARM_GRAPHS_S = round(MARGIN * (24 + 3 + 15 + 60 + 25))
WARM_MTP_S = round(MARGIN * (24 + 3 + 15 + 60 + 45))  # natural + steered + sampled runs
SERVE_S = round(MARGIN * (24 + 3 + 15 + 60 + 45))  # server start, bench, perplexity, plan, Ctrl-C
REFERENCE_S = 150.0  # the first run's reference finished inside stage A's 150 s (four dtypes x prompts)
PROBES_S = 60.0
GATE_PHASE = "requests"  # later engines start once the warm-up engine's first requests are done

CACHE_ENV = ("TRITON_CACHE_DIR", "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR")
PHASE_PREFIX = "##phase "
PGID_DIR_ENV = "GLMCTL_LANE_PGID_DIR"  # helpers that start their own sessions record them here


def cache_env(root: Path) -> dict[str, str]:
    """One on-disk cache per kind for every process of the lane (and the DFlash2 cases)."""
    return {"TRITON_CACHE_DIR": str(root / "triton"), "VLLM_CACHE_ROOT": str(root / "vllm"),
            "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor")}


def triton_cached_kernels(env: dict) -> int:
    root = env.get("TRITON_CACHE_DIR")
    return sum(1 for _ in Path(root).rglob("*.cubin")) if root and Path(root).is_dir() else 0


def mark_phase(name: str, started: float) -> None:
    """Print a phase marker on stdout (the job's log), flushed, for the scheduler and the record."""
    print(f"{PHASE_PREFIX}{name} {time.perf_counter() - started:.1f}", flush=True)


def read_phases(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(PHASE_PREFIX):
            parts = line[len(PHASE_PREFIX):].split()
            if len(parts) == 2:
                out[parts[0]] = float(parts[1])
    return out


_VLLM_TIME = re.compile(r"^(?:\(\w+ pid=\d+\) )?(?:INFO|WARNING|ERROR|DEBUG) (\d\d-\d\d \d\d:\d\d:\d\d) ")
_JIT = re.compile(r"JIT compilation during inference: ([\w.]*\w)")


def vllm_log_phases(text: str) -> dict:
    """What an engine was doing, from vLLM's own log lines: seconds from its first line to model
    resolution, to the end of init, and the kernels JIT-compiled during requests (with the last
    line's time), for a job that was killed or failed."""
    stamps: list[tuple[float, str]] = []
    for line in text.splitlines():
        m = _VLLM_TIME.match(line)
        if m:
            t = time.strptime("2000-" + m.group(1), "%Y-%m-%d %H:%M:%S")
            stamps.append((time.mktime(t), line))
    if not stamps:
        return {}
    t0 = stamps[0][0]

    def first(pattern: str) -> float | None:
        return next((round(t - t0, 1) for t, ln in stamps if pattern in ln), None)

    jit = [(round(t - t0, 1), _JIT.search(ln).group(1)) for t, ln in stamps if _JIT.search(ln)]
    init = re.search(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s", text)
    return {"resolved_s": first("Resolved architecture"), "model_loaded_s": first("Model loading took"),
            "init_done_s": first("init engine"), "init_reported_s": float(init.group(1)) if init else None,
            "request_jit": jit, "last_line_s": round(stamps[-1][0] - t0, 1), "last_line": stamps[-1][1][:200]}


@dataclass
class Job:
    """One subprocess that prints a "@@<json>" report line; its output goes to `log`."""

    label: str
    argv: list[str]
    log: Path
    timeout: float
    env: dict = field(default_factory=lambda: dict(os.environ))
    proc: subprocess.Popen | None = None
    started: float = 0.0
    cwd: Path | None = None

    def start(self) -> Job:
        self.started = time.monotonic()
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd,
                                         start_new_session=True)
        record_group(self.env, self.proc.pid)
        return self

    def phases(self) -> dict[str, float]:
        return read_phases(self.log.read_text(errors="replace")) if self.log.exists() else {}

    def wait_phase(self, phase: str, until: float, poll_s: float = 0.5) -> str:
        """Block until the job prints `phase`, exits, or `until` (monotonic): which of the three."""
        assert self.proc is not None
        while time.monotonic() < until:
            if phase in self.phases():
                return "phase"
            if self.proc.poll() is not None:
                return "exited"
            time.sleep(poll_s)
        return "deadline"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            kill_group(self.proc.pid)
            self.proc.wait(30)
        if self.proc is not None:
            _forget_group(self.env, self.proc.pid)

    def collect(self) -> dict:
        assert self.proc is not None
        try:
            self.proc.wait(max(1.0, self.started + self.timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()
            text = self.log.read_text(errors="replace")
            phases = {"markers": read_phases(text), "vllm": vllm_log_phases(text)}
            return {"error": f"{self.label}: killed after {self.timeout:.0f} s ({_doing(phases)}); log tail:\n"
                             f"{self._tail()}", "phases": phases}
        _forget_group(self.env, self.proc.pid)
        text = self.log.read_text(errors="replace")
        lines = [ln for ln in text.splitlines() if ln.startswith("@@")]
        if self.proc.returncode != 0 or not lines:
            return {"error": f"{self.label}: exit {self.proc.returncode}; log tail:\n{self._tail()}",
                    "phases": {"markers": read_phases(text), "vllm": vllm_log_phases(text)}}
        report = json.loads(lines[-1][2:])
        report["wall_s"] = round(time.monotonic() - self.started, 1)
        report["phases"] = read_phases(text)
        return report

    def _tail(self, n: int = 3000) -> str:
        text = self.log.read_text(errors="replace")
        errors = [ln for ln in text.splitlines() if "Error" in ln or "error:" in ln]
        return ("\n".join(errors[-6:]) + "\n---\n" if errors else "") + text[-n:]


def _doing(phases: dict) -> str:
    """One line: the last phase marker reached and vLLM's last activity."""
    markers, v = phases.get("markers") or {}, phases.get("vllm") or {}
    last = max(markers.items(), key=lambda kv: kv[1]) if markers else None
    parts = [f"last phase {last[0]} at {last[1]:.0f} s" if last else "no phase marker"]
    if v.get("init_reported_s") is not None:
        parts.append(f"vLLM init {v['init_reported_s']:.0f} s")
    if v.get("request_jit"):
        parts.append(f"{len(v['request_jit'])} kernels JIT-compiled during requests, the last "
                     f"{v['request_jit'][-1][1]}")
    return "; ".join(parts)


def engine_limit(label: str) -> float:
    """The limit of one engine (or the server) of the lane, by what it does."""
    return {"eager": COLD_ENGINE_S, "exl3_eager": WARM_EAGER_S, "mtp3": WARM_MTP_S, "serve": SERVE_S}.get(
        label, WARM_GRAPHS_S)


def run_pool(jobs: list[Job], max_parallel: int, until: float, also: list[Job] = ()) -> dict[str, dict]:
    """Run `jobs` at most `max_parallel` at a time (counting the already started `also`), in the
    given order (longest first is best), and collect them and `also`: each is stopped at its own
    limit, and none of `jobs` runs past `until`."""
    waiting, running, results = list(jobs), list(also), {}
    try:
        while waiting or running:
            while waiting and len(running) < max_parallel and time.monotonic() < until:
                job = waiting.pop(0)
                job.timeout = max(5.0, min(job.timeout, until - time.monotonic()))
                running.append(job.start())
            if waiting and time.monotonic() >= until:
                results.update({j.label: {"error": f"not run: the lane's deadline came before {j.label} could start"}
                                for j in waiting})
                waiting = []
            done = [j for j in running if j.proc.poll() is not None or time.monotonic() >= j.started + j.timeout]
            for job in done:
                results[job.label] = job.collect()
                running.remove(job)
            if not done:
                time.sleep(0.5)
    finally:
        for job in running:
            job.stop()
    return results


def max_parallel() -> int:
    """Engines at once: every core but three (pytest, a reference, the DFlash2 cases)."""
    return max(2, (os.cpu_count() or 4) - 3)


def record_group(env: dict, pgid: int) -> None:
    """Note a process group the lane started (a session of its own), for `stop_recorded_groups`."""
    folder = env.get(PGID_DIR_ENV)
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"{pgid}.pgid").write_text(str(pgid))


def _forget_group(env: dict, pgid: int) -> None:
    """Drop the record of a group that has no process left (its id may be reused later)."""
    folder = env.get(PGID_DIR_ENV)
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        if folder:
            (Path(folder) / f"{pgid}.pgid").unlink(missing_ok=True)
    except PermissionError:
        pass


def record_own_group(pgid: int) -> None:
    """For a helper that starts a process in its own session (the serve case's `glmctl serve`)."""
    record_group(dict(os.environ), pgid)


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stop_recorded_groups(folder: Path) -> list[int]:
    """SIGKILL every process group the lane recorded that still exists (after a timeout killed
    pytest, say): each by its id, never by name. Returns the ids that were still alive."""
    alive = []
    for f in sorted(Path(folder).glob("*.pgid")) if Path(folder).is_dir() else []:
        pgid = int(f.read_text())
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            f.unlink(missing_ok=True)
            continue
        alive.append(pgid)
        kill_group(pgid)
        f.unlink(missing_ok=True)
    return alive


if __name__ == "__main__":  # python tests/gpu/vllm_lane_schedule.py stop PGID_DIR   (the lane script's clean-up)
    import sys

    if len(sys.argv) == 3 and sys.argv[1] == "stop":
        left = stop_recorded_groups(Path(sys.argv[2]))
        print(f"stopped {len(left)} leftover process group(s) of the lane: {left}" if left
              else "no leftover process groups")
