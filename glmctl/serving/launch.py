"""Run vLLM as a supervised child: its own process group, its log captured, its start-up followed.

vLLM's API server spawns an engine core, which spawns the workers; all of them stay in the process
group of the server process, which is started as the leader of a new session. Stopping forwards
the signal to the leader (vLLM shuts its children down in order), then, after a grace period,
terminates and finally kills whatever is left in the group, so nothing outlives the supervisor.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from glmctl import switches
from glmctl.errors import GlmctlError

# Start-up milestones in vLLM 0.30's log, in order, with the phase each one begins.
_PHASES = [
    (re.compile(r"non-default args|vLLM API server version|version \d"), "parsing arguments"),
    (re.compile(r"Resolved architecture"), "reading the model config"),
    (re.compile(r"Initializing a V1 LLM engine"), "starting the engine"),
    (re.compile(r"Starting to load model|Loading safetensors checkpoint shards"), "loading weights"),
    (re.compile(r"Loading weights took|Model loading took"), "profiling memory"),
    (re.compile(r"KV cache size:"), "allocating the KV cache"),
    (re.compile(r"Capturing CUDA graphs"), "capturing CUDA graphs"),
    (re.compile(r"init engine .* took"), "starting the API server"),
    (re.compile(r"Application startup complete"), "waiting for /health"),
]
_SHARDS = re.compile(r"Loading safetensors checkpoint shards:\s+(\d+)% Completed \| (\d+)/(\d+)")
_KV = re.compile(
    r"(\w+) KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per "
    r"request: ([\d.]+)x"
)


@dataclass(frozen=True)
class KvCapacity:
    """The KV cache vLLM allocated, as its start-up log states it (measured, not predicted)."""

    tokens: int
    max_model_len: int
    max_concurrency: float
    device: str


def parse_kv_capacity(line: str) -> KvCapacity | None:
    m = _KV.search(line)
    if m is None:
        return None
    return KvCapacity(
        tokens=int(m.group(2).replace(",", "")),
        max_model_len=int(m.group(3).replace(",", "")),
        max_concurrency=float(m.group(4)),
        device=m.group(1).lower(),
    )


class ServerStartError(GlmctlError):
    """vLLM exited, or never became healthy, during start-up."""

    def __init__(self, message: str, hint: str | None, exit_code: int) -> None:
        super().__init__(message, hint)
        self.exit_code = exit_code or 1


def exit_status(returncode: int) -> int:
    """A child's return code as a shell would report it (killed by signal N -> 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


class VllmProcess:
    """One vLLM server process tree: start, follow the log, wait until healthy, stop. `name` is what
    messages call it (the same supervision runs vllm-router in front of a fleet)."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        log_path: Path,
        on_line: Callable[[str], None] | None = None,
        keep_lines: int = 200,
        name: str = "vLLM",
    ) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = Path(log_path)
        self.on_line = on_line
        self.phase = "starting Python"
        self.shards: tuple[int, int] | None = None
        self.kv: KvCapacity | None = None
        self._lines: collections.deque[str] = collections.deque(maxlen=keep_lines)
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._started_at = 0.0

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # Hand-over variables are never inherited from whoever started glmctl (a server would
        # activate for a model it was not shown). The supervisor's pid lets
        # glmctl.serving.vllm_entry ask the kernel to stop vLLM if the supervisor is killed outright.
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        for name in switches.names(switches.HAND_OVER):
            env.pop(name, None)
        env["GLMCTL_SUPERVISOR_PID"] = str(os.getpid())
        self._started_at = time.monotonic()
        self._proc = subprocess.Popen(
            self.argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: signals from the terminal go to us
        )
        self._reader = threading.Thread(target=self._read_log, name="vllm-log", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        assert self._proc is not None, "not started"
        return self._proc.pid

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self._started_at

    def poll(self) -> int | None:
        assert self._proc is not None, "not started"
        return self._proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the server process to exit; its shell-style exit status."""
        assert self._proc is not None, "not started"
        code = self._proc.wait(timeout)
        if self._reader is not None:
            self._reader.join(timeout=5)
        return exit_status(code)

    def send(self, sig: int) -> None:
        """Send `sig` to the server process (vLLM forwards shutdown to its children)."""
        if self._proc is not None and self._proc.poll() is None:
            try:
                self._proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def group_alive(self) -> bool:
        """Whether any process of the server's group still exists (zombies count until reaped)."""
        try:
            os.killpg(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, sig: int = signal.SIGTERM, grace_s: float = 30.0) -> int:
        """Stop the whole process tree; returns the server's exit status.

        `sig` goes to the server, which shuts its engine and workers down in order. If it is still
        running after `grace_s`, or leaves processes behind, the group gets SIGTERM and then
        SIGKILL. Returns once the group is empty (or 10 s after SIGKILL).
        """
        assert self._proc is not None, "not started"
        self.send(sig)
        try:
            self._proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGTERM)
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        for next_signal, patience_s in ((signal.SIGTERM, 1.0), (signal.SIGKILL, 2.0), (None, 10.0)):
            deadline = time.monotonic() + patience_s
            while self.group_alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            if not self.group_alive() or next_signal is None:
                break
            self._signal_group(next_signal)
        return self.wait()

    def kill(self) -> None:
        """Kill the whole group at once (a second Ctrl-C)."""
        self._signal_group(signal.SIGKILL)

    # -- log ----------------------------------------------------------------------------------

    def last_lines(self, n: int = 30) -> list[str]:
        return list(self._lines)[-n:]

    def _read_log(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        # vLLM logs its non-default arguments, an --api-key among them: the log is the owner's only
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "ab") as log:
            for raw in iter(self._proc.stdout.readline, b""):
                log.write(raw)
                log.flush()
                # Progress bars redraw with carriage returns; the last frame is the current one.
                frames = [f for f in raw.rstrip(b"\n").split(b"\r") if f.strip()]
                if not frames:
                    continue
                line = frames[-1].decode("utf-8", errors="replace")
                self._lines.append(line)
                self._observe(line)
                if self.on_line is not None:
                    try:
                        self.on_line(line)
                    except Exception:  # noqa: BLE001 - a display problem must not stop the log
                        pass

    def _observe(self, line: str) -> None:
        for pattern, phase in _PHASES:
            if pattern.search(line):
                self.phase = phase
        if (m := _SHARDS.search(line)) is not None:
            self.shards = (int(m.group(2)), int(m.group(3)))
        if self.kv is None and (kv := parse_kv_capacity(line)) is not None:
            self.kv = kv

    # -- readiness ----------------------------------------------------------------------------

    def wait_healthy(
        self,
        base_url: str,
        timeout_s: float | None,
        on_progress: Callable[[VllmProcess], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        """Block until GET /health answers 200; raise ServerStartError if vLLM dies or times out."""
        import httpx

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while True:
                if should_stop is not None and should_stop():
                    return
                code = self.poll()
                if code is not None:
                    status = self.wait()
                    raise ServerStartError(self._died_message(status), self._hint(), status)
                try:
                    if client.get(f"{base_url}/health").status_code == 200:
                        self.phase = "ready"
                        return
                except httpx.HTTPError:
                    pass
                if deadline is not None and time.monotonic() > deadline:
                    raise ServerStartError(
                        f"{self.name} did not become healthy within {timeout_s:.0f} s (last phase: "
                        f"{self.phase})\n" + self._tail(),
                        hint=f"raise --startup-timeout, or read {self.log_path}",
                        exit_code=1,
                    )
                if on_progress is not None:
                    on_progress(self)
                time.sleep(0.5)

    def _tail(self, n: int = 25) -> str:
        return "\n".join(f"  | {ln}" for ln in self.last_lines(n))

    def _died_message(self, status: int) -> str:
        return (
            f"{self.name} exited with status {status} during start-up ({self.phase}); last log lines:\n"
            + self._tail()
        )

    def _hint(self) -> str:
        return f"the whole log is in {self.log_path}"
