"""A fleet as files (`glmctl fleet render`): the router's command and environment, every node's
`vllm serve` files as `glmctl profile render` writes them, and `fleet.yaml` saying what is where.

    DIR/fleet.yaml                 nodes, router URL, policy, session header, which file starts what
    DIR/router/command.sh          exec vllm-router --worker-urls ... --policy sticky_least_loaded ...
    DIR/router/router.env          the router's environment (owner-only, as every env file)
    DIR/nodes/HOST-PORT/           vllm.yaml, vllm.env, command.sh (and licence notices) for that node

Every file is written through a temporary name and a rename. Nothing secret goes into a file
others may read: the router needs no key (it forwards each client's Authorization header), a
node's key stays in its owner-only files.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from glmctl.errors import ConfigError, UsageError
from glmctl.fleet.router import POLICY, SESSION_HEADER, VERSION, RouterSettings
from glmctl.serving import launch_files
from glmctl.serving.schema import Profile

FLEET_NAME = "fleet.yaml"
ROUTER_DIR = "router"
ROUTER_COMMAND = "command.sh"
ROUTER_ENV = "router.env"
NODES_DIR = "nodes"
NODE_LISTEN_HOST = "0.0.0.0"  # the router reaches each node from another machine


@dataclass(frozen=True)
class NodeAddress:
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def dir_name(self) -> str:
        return re.sub(r"[^A-Za-z0-9._-]", "_", self.host) + f"-{self.port}"


def parse_nodes(spec: str) -> list[NodeAddress]:
    """'host1:8000,host2:8000' (or http:// URLs; the port defaults to 8000) -> the nodes, in order."""
    out: list[NodeAddress] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        text = part if "://" in part else "http://" + part
        try:
            parsed = urlsplit(text)
            port = parsed.port or 8000
        except ValueError as exc:
            raise UsageError(f"--nodes: cannot read {part!r} ({exc})", hint="e.g. --nodes node1:8000,node2:8000") from exc
        if parsed.scheme != "http" or not parsed.hostname or parsed.path not in ("", "/"):
            raise UsageError(f"--nodes: {part!r} is not HOST:PORT", hint="e.g. --nodes node1:8000,node2:8000")
        node = NodeAddress(parsed.hostname, port)
        if node in out:
            raise UsageError(f"--nodes names {node.host}:{node.port} twice")
        out.append(node)
    if not out:
        raise UsageError("--nodes names no node", hint="e.g. --nodes node1:8000,node2:8000")
    return out


@dataclass
class FleetLaunch:
    """Everything the fleet runs, as data: the router and one rendered launch per node."""

    profile: Profile
    router: RouterSettings
    nodes: list[NodeAddress]
    launches: list[launch_files.RenderedLaunch] = field(default_factory=list)

    @property
    def node_urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    def router_script(self) -> str:
        from glmctl import __version__

        argv = self.router.argv(self.node_urls)
        lines = [
            "#!/usr/bin/env bash",
            f"# Rendered by glmctl {__version__}: vllm-router {VERSION} in front of {len(self.nodes)} node(s) of "
            f"serving profile '{self.profile.name}'.",
            f"# Policy {POLICY}: a session's requests carry the {SESSION_HEADER} header; its first goes to the node",
            "# with the fewest sessions, the later ones to the same node (its KV cache is there).",
            "# Start the nodes first (nodes/*/command.sh, each on its host): the router waits up to",
            f"# {self.router.worker_startup_timeout_s} s for all of them to answer /health.",
            "# Install: pip install 'glmctl[fleet]' (or pip install vllm-router==" + VERSION + ").",
            "set -euo pipefail",
            'cd "$(dirname "$0")"',
            f"set -a && . ./{ROUTER_ENV} && set +a",
            "exec " + " \\\n  ".join(_argv_lines(argv)),
        ]
        return "\n".join(lines) + "\n"

    def router_env_file(self) -> str:
        from glmctl import __version__

        body = "".join(f"{k}={shlex.quote(v)}\n" for k, v in self.router.env().items())
        return f"# Rendered by glmctl {__version__}: vllm-router's environment.\n{body}"

    def document(self) -> dict:
        """fleet.yaml: what the fleet is, for people and for `glmctl fleet status`."""
        return {
            "profile": self.profile.name,
            "router": {
                "listen": f"{self.router.host}:{self.router.port}",
                "url": self.router.url,
                "version": VERSION,
                "policy": POLICY,
                "session_header": SESSION_HEADER,
                "metrics": self.router.metrics_url,
                "health_check_interval_s": self.router.health_check_interval_s,
                "health_failure_threshold": self.router.health_failure_threshold,
                "command": f"{ROUTER_DIR}/{ROUTER_COMMAND}",
            },
            "nodes": [{"url": n.url, "files": f"{NODES_DIR}/{n.dir_name}"} for n in self.nodes],
        }


def _argv_lines(argv: list[str]) -> list[str]:
    """The command one option per line: the executable, then each flag with its values."""
    lines: list[list[str]] = [[argv[0]]]
    for word in argv[1:]:
        if word.startswith("--"):
            lines.append([word])
        else:
            lines[-1].append(word)
    return [shlex.join(words) for words in lines]


def render_fleet(profile: Profile, nodes: list[NodeAddress], router: RouterSettings,
                 listen_host: str = NODE_LISTEN_HOST) -> FleetLaunch:
    """The router and every node's launch for `profile` (its model path already applied)."""
    launches = [launch_files.render(profile, host=listen_host, port=n.port) for n in nodes]
    return FleetLaunch(profile=profile, router=router, nodes=nodes, launches=launches)


@dataclass
class FleetFiles:
    fleet: Path
    router_command: Path
    router_env: Path
    nodes: list[launch_files.RenderedFiles]


def write_router_files(fleet: FleetLaunch, out_dir: Path) -> FleetFiles:
    """fleet.yaml and the router's files (the nodes' are written by `write_fleet`, or by the
    servers `glmctl fleet up` starts)."""
    import yaml

    out_dir = Path(out_dir).absolute()
    router_dir = out_dir / ROUTER_DIR
    try:
        router_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create {router_dir}: {exc.strerror or exc}", hint="choose another --out") from exc
    files = FleetFiles(fleet=out_dir / FLEET_NAME, router_command=router_dir / ROUTER_COMMAND,
                       router_env=router_dir / ROUTER_ENV, nodes=[])
    header = f"# glmctl fleet: vllm-router {VERSION} in front of {len(fleet.nodes)} node(s).\n"
    launch_files.write_text_files({
        files.router_command: (fleet.router_script(), 0o755),
        files.router_env: (fleet.router_env_file(), 0o600),
        files.fleet: (header + yaml.safe_dump(fleet.document(), sort_keys=False), 0o644),
    })
    return files


def write_fleet(fleet: FleetLaunch, out_dir: Path) -> FleetFiles:
    """Every file of the fleet under `out_dir` (see the module doc)."""
    files = write_router_files(fleet, out_dir)
    files.nodes = [launch_files.write(launch, Path(out_dir).absolute() / NODES_DIR / node.dir_name)
                   for node, launch in zip(fleet.nodes, fleet.launches, strict=True)]
    return files
