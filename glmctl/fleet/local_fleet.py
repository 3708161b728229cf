"""`glmctl fleet up`: K servers of one profile on this machine and vllm-router in front, one tree.

For tests and demos, with a CPU profile (K GPU nodes need K machines: `glmctl fleet render`).
Each node is a server as `glmctl serve` runs it (`glmctl.serving.server`: its own process group
and run directory, stopped with every child). The nodes start together; the router starts once
every node answers /health, and the fleet is ready when the router's own /health answers 200,
which it does only while every node is healthy. The whole wait is bounded by one timeout. Then
the fleet is held until SIGINT or SIGTERM, which stops the router and every node (a second one
kills them all at once). A node that dies is reported and the router routes around it; the fleet
runs on while a node is left. When the router or the last node dies, everything is stopped.

    $GLMCTL_CACHE/fleet/PROFILE-PORT/
      fleet.yaml   router/{command.sh, router.env, router.log}   nodes/node-N/{vllm.yaml, vllm.env, command.sh, vllm.log}
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from glmctl import paths
from glmctl.errors import GlmctlError, UsageError
from glmctl.fleet.fleet_render import (
    ROUTER_DIR,
    FleetLaunch,
    NodeAddress,
    write_router_files,
)
from glmctl.fleet.router import RouterSettings, supervised_command
from glmctl.hub.licenses import License
from glmctl.serving import launch_files, profiles
from glmctl.serving import server as srv
from glmctl.serving.launch import VllmProcess
from glmctl.serving.preflight import port_problem
from glmctl.serving.schema import Profile

ROUTER_LOG = "router.log"
# Locally the nodes are up before the router starts: it need not wait long, and may watch closely.
LOCAL_ROUTER = dict(health_check_interval_s=1, health_failure_threshold=2, health_success_threshold=1,
                    health_check_timeout_s=2, worker_startup_timeout_s=60, worker_startup_check_interval_s=1)


class FleetError(GlmctlError):
    """A node or the router failed to start, or the fleet lost what it cannot run without."""


@dataclass
class FleetInfo:
    profile: str
    model: str
    router_url: str
    router_metrics: str
    router_pid: int
    router_log: Path
    run_dir: Path
    startup_s: float
    nodes: list[srv.ServerInfo] = field(default_factory=list)


def _distinct_free_ports(n: int, taken: set[int]) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        port = srv.free_port()
        if port not in taken and port not in ports:
            ports.append(port)
    return ports


class LocalFleet:
    """K prepared servers and the router's settings; `start()`, then `hold()` or `stop()`."""

    def __init__(self, profile: Profile, servers: list[srv.Server], router: RouterSettings, run_dir: Path) -> None:
        self.profile = profile
        self.servers = servers
        self.router = router
        self.run_dir = run_dir
        self.router_process: VllmProcess | None = None
        self.info: FleetInfo | None = None
        self.lost: dict[int, int] = {}
        """Nodes (index) that exited while the fleet was held, with their exit status."""

    @property
    def node_urls(self) -> list[str]:
        return [s.launch.base_url for s in self.servers]

    def start(self, timeout_s: float | None, should_stop: Callable[[], bool] | None = None) -> FleetInfo | None:
        """Start every node, then the router; None if `should_stop` fired first. The wait for all
        of it is bounded by `timeout_s`; on any failure everything started is stopped."""
        started = time.monotonic()
        end = None if timeout_s is None else started + timeout_s

        def left() -> float | None:
            return None if end is None else max(1.0, end - time.monotonic())

        stop_asked = should_stop or (lambda: False)
        errors: list[BaseException] = []

        def wait_node(server: srv.Server) -> None:
            try:
                server.wait_ready(timeout_s=left(), should_stop=lambda: stop_asked() or bool(errors))
            except BaseException as exc:  # noqa: BLE001 - reported below, the others stopped
                errors.append(exc)

        # Spawned from this thread (a server is stopped when the thread that started it ends),
        # waited for together.
        threads = [threading.Thread(target=wait_node, args=(s,), name=f"node-{i + 1}", daemon=True)
                   for i, s in enumerate(self.servers)]
        try:
            for server in self.servers:
                server.spawn()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise errors[0]
            if stop_asked():
                return None
            self._start_router(left(), stop_asked)
            if stop_asked():
                return None
        except BaseException:
            self.stop(grace_s=10)
            raise
        assert self.router_process is not None
        self.info = FleetInfo(
            profile=self.profile.name, model=self.servers[0].info.model, router_url=self.router.url,
            router_metrics=self.router.metrics_url, router_pid=self.router_process.pid,
            router_log=self.router_process.log_path, run_dir=self.run_dir,
            startup_s=time.monotonic() - started, nodes=[s.info for s in self.servers])
        return self.info

    def _start_router(self, timeout_s: float | None, should_stop: Callable[[], bool]) -> None:
        nodes = [NodeAddress(s.launch.host, s.launch.port) for s in self.servers]
        fleet = FleetLaunch(profile=self.profile, router=self.router, nodes=nodes,
                            launches=[s.launch for s in self.servers])
        write_router_files(fleet, self.run_dir)
        argv = self.router.argv(fleet.node_urls, command=supervised_command())
        self.router_process = VllmProcess(argv, self.router.env(), self.run_dir / ROUTER_DIR / ROUTER_LOG,
                                          name="vllm-router")
        self.router_process.start()
        self.router_process.wait_healthy(self.router.url, timeout_s, should_stop=should_stop)

    def dead_nodes(self) -> list[tuple[int, int]]:
        """(index, exit status) of each node whose server has exited and was not reported yet; what
        the server process left of its group (an engine core, workers) is stopped too."""
        out = []
        for i, server in enumerate(self.servers):
            if i in self.lost or server.process is None:
                continue
            if server.process.poll() is not None:
                self.lost[i] = server.stop(grace_s=0) or 0
                out.append((i, self.lost[i]))
        return out

    def stop(self, sig: int = signal.SIGTERM, grace_s: float = 30.0) -> None:
        """Stop the router, then every node at once (each with its whole process group)."""
        if self.router_process is not None:
            self.router_process.stop(signal.SIGTERM, grace_s=min(grace_s, 10.0))
        threads = [threading.Thread(target=s.stop, args=(sig, grace_s), daemon=True) for s in self.servers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def kill(self) -> None:
        if self.router_process is not None:
            self.router_process.kill()
        for server in self.servers:
            if server.process is not None:
                server.process.kill()


def prepare_fleet(
    profile: str | Path | Profile,
    *,
    model: Path | None,
    nodes: int,
    port: int | None = None,
    metrics_port: int | None = None,
    drafter: Path | None = None,
    accept: list[str] = (),
    confirm: Callable[[License], bool] | None = None,
    run_dir: Path | None = None,
    on_line: Callable[[int, str], None] | None = None,
) -> LocalFleet:
    """Load and check the profile and every dependency; nothing is started yet. The first node
    runs `glmctl serve`'s whole preflight (licences, checkpoint, port, vLLM's parser, capacity);
    the others serve the same files on other ports."""
    if nodes < 1:
        raise UsageError(f"--nodes {nodes}: a fleet has at least one node")
    prof = profile if isinstance(profile, Profile) else profiles.load(profile)
    if prof.platform != "cpu":
        raise UsageError(
            f"glmctl fleet up runs every node on this machine, for tests and demos; profile '{prof.name}' is for "
            f"{prof.platform} nodes, which need one machine each",
            hint="glmctl fleet render --profile ... --nodes host1:8000,host2:8000 --out DIR writes each node's and "
                 "the router's files; or use a CPU profile (tiny-cpu)")
    supervised_command()  # vllm-router installed? (a DependencyError naming the extra)
    host = launch_files.DEFAULT_HOST
    router_port = port or srv.free_port(host)
    for flag, wanted in (("--port", router_port), ("--metrics-port", metrics_port)):
        if wanted and (problem := port_problem(host, wanted)):
            raise UsageError(f"the router cannot listen: {problem}", hint=f"pass another {flag}")
    [metrics] = [metrics_port] if metrics_port else _distinct_free_ports(1, {router_port})
    node_ports = _distinct_free_ports(nodes, {router_port, metrics})
    prof = launch_files.with_paths(prof, model=model, drafter=drafter)
    run_dir = Path(run_dir or paths.cache() / "fleet" / f"{prof.name}-{router_port}")
    servers = []
    for i, node_port in enumerate(node_ports):
        echo = (lambda line, i=i: on_line(i, line)) if on_line else None
        servers.append(srv.prepare(prof, host=host, port=node_port, accept=accept, confirm=confirm,
                                   run_dir=run_dir / "nodes" / f"node-{i + 1}", check=i == 0, on_line=echo))
    router = RouterSettings(host=host, port=router_port, metrics_host=host, metrics_port=metrics, **LOCAL_ROUTER)
    return LocalFleet(prof, servers, router, run_dir)


def run_fleet(
    fleet: LocalFleet,
    *,
    timeout_s: float | None,
    on_ready: Callable[[FleetInfo], None] | None = None,
    on_lost: Callable[[int, int, bool], None] | None = None,
    grace_s: float = 30.0,
) -> int:
    """Start `fleet` and hold it until SIGINT/SIGTERM, the router's death or the last node's.

    Returns 0 when it was stopped by a signal with every node still serving, 1 when a node was lost,
    130 when the signal came before the fleet was ready; raises FleetError (or the start-up's
    error) when it cannot run. `on_lost(index, status, fleet_goes_on)` reports a node that exited.
    """
    received: list[int] = []

    def handler(signum: int, _frame: object) -> None:
        if received:
            fleet.kill()
        received.append(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        info = fleet.start(timeout_s, should_stop=lambda: bool(received))
        if info is not None and on_ready is not None:
            on_ready(info)
        router = fleet.router_process
        while info is not None and not received:
            for index, status in fleet.dead_nodes():
                if on_lost is not None:
                    on_lost(index, status, len(fleet.lost) < len(fleet.servers))
            if len(fleet.lost) == len(fleet.servers):
                break
            if router is not None and router.poll() is not None:
                raise FleetError(f"vllm-router exited with status {router.wait()}; the fleet is stopped. Last "
                                 "log lines:\n" + "\n".join(f"  | {ln}" for ln in router.last_lines(20)),
                                 hint=f"the whole log is in {router.log_path}")
            time.sleep(0.2)
        fleet.stop(received[0] if received else signal.SIGTERM, grace_s)
        if info is not None and len(fleet.lost) == len(fleet.servers):
            raise FleetError(f"every node of the fleet exited ({len(fleet.servers)}); the router is stopped",
                             hint=f"each node's vllm.log is under {fleet.run_dir / 'nodes'}")
        if info is None:
            return 130  # interrupted before the fleet was ready
        return 0 if not fleet.lost else 1
    finally:
        fleet.stop(signal.SIGTERM, grace_s=5)  # idempotent: nothing outlives the supervisor
        for sig, old in previous.items():
            signal.signal(sig, old)
