"""Start a vLLM server from a serving profile and hold it: the library API behind `glmctl serve`.

    from glmctl.serving.server import start_server
    with start_server("tiny-cpu", model=ckpt, port=None) as server:   # None: any free port
        httpx.post(f"{server.info.base_url}/v1/completions", json={...})
    # leaving the block stops vLLM and every process it started

Each server gets a run directory (default `$GLMCTL_CACHE/serve/<profile>-<port>/`) holding the
rendered `vllm.yaml`, `vllm.env`, `command.sh`, the licence notices and vLLM's whole log.
"""

from __future__ import annotations

import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from glmctl import paths
from glmctl.hub.licenses import License
from glmctl.serving import launch_files, profiles
from glmctl.serving import preflight as preflight_mod
from glmctl.serving.launch import KvCapacity, VllmProcess
from glmctl.serving.profile_fit import CapacityVerdict
from glmctl.serving.schema import Profile

LOG_NAME = "vllm.log"


@dataclass
class ServerInfo:
    profile: str
    base_url: str
    """http://host:port, without /v1."""
    model: str
    """The model name clients send (vLLM's /v1/models)."""
    pid: int
    run_dir: Path
    log_path: Path
    startup_s: float
    kv: KvCapacity | None
    """KV cache as vLLM's start-up log reports it (measured)."""
    capacity: CapacityVerdict | None
    """The planner's prediction for the same setup."""
    notices: list[License] = field(default_factory=list)


def free_port(host: str = launch_files.DEFAULT_HOST) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def run_dir_for(profile: Profile, port: int) -> Path:
    return paths.cache() / "serve" / f"{profile.name}-{port}"


class Server:
    """One vLLM server for one rendered profile. Start it, use `info`, stop it (or `with`)."""

    def __init__(
        self,
        launch: launch_files.RenderedLaunch,
        run_dir: Path,
        report: preflight_mod.PreflightReport | None = None,
        on_line: Callable[[str], None] | None = None,
    ) -> None:
        self.launch = launch
        self.run_dir = Path(run_dir)
        self.report = report
        self.files: launch_files.RenderedFiles | None = None
        self.process: VllmProcess | None = None
        self.info: ServerInfo | None = None
        self.stopping = False
        """Set once a stop was asked for: vLLM's shutdown logs errors that are not news."""
        self._on_line = on_line

    def start(
        self,
        timeout_s: float | None = 600,
        on_progress: Callable[[VllmProcess], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> ServerInfo | None:
        """Render into the run directory, start vLLM, wait for /health. None if `should_stop` fired."""
        self.spawn()
        return self.wait_ready(timeout_s, on_progress, should_stop)

    def spawn(self) -> None:
        """Render into the run directory and start vLLM; `wait_ready` follows. Spawn from the thread
        that holds the server: vLLM is stopped when the thread that started it ends (see
        glmctl.serving.vllm_entry), so several servers are spawned in turn and waited for together."""
        self.files = launch_files.write(self.launch, self.run_dir)
        log = self.run_dir / LOG_NAME
        log.unlink(missing_ok=True)
        self.process = VllmProcess(self.launch.argv(self.files.config), self.launch.env, log,
                                   on_line=self._on_line)
        self.process.start()

    def wait_ready(
        self,
        timeout_s: float | None = 600,
        on_progress: Callable[[VllmProcess], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> ServerInfo | None:
        """Wait for the spawned vLLM's /health (stopping it on failure); None if `should_stop` fired."""
        assert self.process is not None, "spawn() first"
        log = self.process.log_path
        try:
            self.process.wait_healthy(self.launch.base_url, timeout_s, on_progress, should_stop)
        except BaseException:
            self.stop(grace_s=10)
            raise
        if should_stop is not None and should_stop():
            return None
        self.info = ServerInfo(
            profile=self.launch.profile.name,
            base_url=self.launch.base_url,
            model=self._served_model() or self.launch.served_name,
            pid=self.process.pid,
            run_dir=self.run_dir,
            log_path=log,
            startup_s=self.process.elapsed_s,
            kv=self.process.kv,
            capacity=self.report.capacity if self.report else None,
            notices=list(self.launch.notices),
        )
        return self.info

    def _served_model(self) -> str | None:
        import httpx

        try:
            data = httpx.get(f"{self.launch.base_url}/v1/models", timeout=5).json()["data"]
            return data[0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            return None

    def stop(self, sig: int = signal.SIGTERM, grace_s: float = 30.0) -> int | None:
        """Stop vLLM and every process it started; its exit status (None if never started)."""
        self.stopping = True
        if self.process is None:
            return None
        return self.process.stop(sig, grace_s)

    def wait(self) -> int:
        assert self.process is not None, "not started"
        return self.process.wait()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def prepare(
    profile: str | Path | Profile,
    *,
    model: Path | None = None,
    drafter: Path | None = None,
    host: str = launch_files.DEFAULT_HOST,
    port: int | None = launch_files.DEFAULT_PORT,
    accept: list[str] = (),
    confirm: Callable[[License], bool] | None = None,
    run_dir: Path | None = None,
    check: bool = True,
    on_line: Callable[[str], None] | None = None,
    record: bool = True,
) -> Server:
    """Load, render and preflight a profile; the Server is ready to `start()`.

    Raises ConfigError / LicenseError / PreflightError (each with its fix) before anything starts.
    A dry run is this with `record=False`: the same checks, no licence acceptance recorded.
    """
    prof = profile if isinstance(profile, Profile) else profiles.load(profile)
    prof = launch_files.with_paths(prof, model=model, drafter=drafter)
    launch = launch_files.render(prof, host=host, port=free_port(host) if port is None else port)
    report = preflight_mod.run(launch, accept=list(accept), confirm=confirm, record=record) if check else None
    return Server(launch, run_dir or run_dir_for(prof, launch.port), report, on_line=on_line)


def start_server(profile: str | Path | Profile, *, timeout_s: float | None = 600, **kwargs) -> Server:
    """`prepare(...)` then `start()`; the returned Server is healthy (use it with `with`)."""
    server = prepare(profile, **kwargs)
    server.start(timeout_s=timeout_s)
    return server


def run_foreground(
    server: Server,
    *,
    timeout_s: float | None,
    on_progress: Callable[[VllmProcess], None] | None = None,
    on_ready: Callable[[ServerInfo], None] | None = None,
    grace_s: float = 30.0,
) -> int:
    """Start `server` and hold it until vLLM exits or SIGINT/SIGTERM arrives; vLLM's exit status.

    The first SIGINT/SIGTERM is forwarded to vLLM (then the group is stopped, see
    `VllmProcess.stop`); a second one kills the whole group at once.
    """
    import time

    received: list[int] = []

    def handler(signum: int, _frame: object) -> None:
        server.stopping = True
        if received and server.process is not None:
            server.process.kill()
        received.append(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        info = server.start(timeout_s, on_progress, should_stop=lambda: bool(received))
        if info is not None and on_ready is not None:
            on_ready(info)
        assert server.process is not None
        while not received and server.process.poll() is None:
            time.sleep(0.2)
        # Either way the whole group is stopped: children must not outlive a server that died.
        return server.stop(received[0] if received else signal.SIGTERM, grace_s) or 0
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
