"""`glmctl fleet render|up|status`: N nodes of a profile behind vllm-router, sessions kept on one node."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from glmctl._cli.completion import profile_names
from glmctl._cli.options import AcceptLicenseOpt, ApiKeyOpt, JsonOpt, QuietOpt, examples

app = typer.Typer(
    help="A fleet of nodes behind vllm-router: a session's turns stay on one node (X-Session-ID), a dead node "
         "is routed around.",
    no_args_is_help=True,
)

ProfileArg = Annotated[str, typer.Option("--profile", "-p", autocompletion=profile_names,
                                         help="Serving profile every node runs (glmctl profile ls) or a YAML file.")]
ModelPathOpt = Annotated[Path | None, typer.Option("--model", "-m", help="Checkpoint directory (overrides the profile's).")]
DrafterOpt = Annotated[Path | None, typer.Option("--drafter", help="Drafter checkpoint directory (DFlash2 profiles).")]


@app.command("render", epilog=examples(
    "glmctl fleet render --profile commercial --model /models/glm-5.3-flash-exl3 --nodes gpu1:8000,gpu2:8000 --out fleet/",
    "# on gpu1 and gpu2: fleet/nodes/HOST-8000/command.sh; then, on the router's host: fleet/router/command.sh",
))
def render(
    profile: ProfileArg,
    nodes: Annotated[str, typer.Option("--nodes", help="The nodes as HOST:PORT,HOST:PORT (the router reaches each there).")],
    out_dir: Annotated[Path, typer.Option("--out", "-o", help="Write fleet.yaml, router/ and nodes/HOST-PORT/ here.")],
    model: ModelPathOpt = None,
    drafter: DrafterOpt = None,
    router_host: Annotated[str, typer.Option("--router-host", help="Address the router listens on.")] = "0.0.0.0",
    router_port: Annotated[int, typer.Option("--router-port", min=1, max=65535, help="Port the router listens on.")] = 8000,
    metrics_port: Annotated[int, typer.Option("--metrics-port", min=1, max=65535,
                                              help="Port of the router's own Prometheus metrics (on 127.0.0.1).")] = 29000,
    health_interval: Annotated[int, typer.Option("--health-interval", min=1, help="Seconds between the router's health "
                                                 "checks of each node (two failed in a row take a node out).")] = 5,
    session_ttl: Annotated[int, typer.Option("--session-ttl", min=1, help="Seconds the router remembers an idle "
                                             "session's node.")] = 7200,
    json_: JsonOpt = False,
) -> None:
    """Write the fleet as files: vllm-router's command and environment, each node's `vllm serve` files, fleet.yaml.

    Each nodes/HOST-PORT/ holds what `glmctl profile render` writes (vllm.yaml, vllm.env, command.sh; the node listens on 0.0.0.0 at its port); router/command.sh runs vllm-router with policy sticky_least_loaded, which keys a session on its X-Session-ID header. Env files, and a config holding a key, are readable by their owner only; nothing secret is written elsewhere.
    """
    from glmctl._cli.output import Output
    from glmctl.fleet.fleet_render import parse_nodes, render_fleet, write_fleet
    from glmctl.fleet.router import RouterSettings
    from glmctl.serving import launch_files, profiles

    out = Output.from_flags(json_)
    addresses = parse_nodes(nodes)
    prof = launch_files.with_paths(profiles.load(profile), model=model, drafter=drafter)
    settings = RouterSettings(host=router_host, port=router_port, metrics_port=metrics_port,
                              health_check_interval_s=health_interval, session_ttl_s=session_ttl)
    fleet = render_fleet(prof, addresses, settings)
    files = write_fleet(fleet, out_dir)
    result = {**fleet.document(), "files": {
        "fleet": files.fleet, "router_command": files.router_command, "router_env": files.router_env,
        "nodes": [{"config": f.config, "env": f.env, "command": f.command} for f in files.nodes]}}

    def draw(console) -> None:
        from rich.markup import escape

        doc = fleet.document()
        console.print(f"[bold]fleet of {len(addresses)} node(s)[/bold] of profile '{escape(prof.name)}' behind "
                      f"vllm-router {doc['router']['version']} listening on {escape(doc['router']['listen'])}")
        console.print(f"sessions: policy {doc['router']['policy']}, keyed on the {doc['router']['session_header']} "
                      "request header (a new session goes to the node with the fewest, its later turns to the same)")
        for node, f in zip(addresses, files.nodes, strict=True):
            console.print(f"node     {node.url}  {f.command}", markup=False, soft_wrap=True)
        console.print(f"router   {files.router_command}  (env {files.router_env})", markup=False, soft_wrap=True)
        console.print(f"fleet    {files.fleet}", markup=False, soft_wrap=True)
        console.print("\nstart each node's command.sh on its host, then the router's", markup=False)

    out.result(result, draw)


@app.command("up", epilog=examples(
    "glmctl fleet up --profile tiny-cpu --model out/tiny-glm --nodes 2 --port 8000",
    "glmctl bench --url http://127.0.0.1:8000 --sessions 4 --context 1k --turns 3 --output-tokens 32   # another shell",
))
def up(
    profile: ProfileArg,
    nodes: Annotated[int, typer.Option("--nodes", min=1, help="How many servers to start on this machine.")] = 2,
    model: ModelPathOpt = None,
    drafter: DrafterOpt = None,
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="Port the router listens on (127.0.0.1); the "
                                      "nodes take free ports.")] = 8000,
    metrics_port: Annotated[int | None, typer.Option("--metrics-port", min=1, max=65535,
                                                     help="Port of the router's Prometheus metrics (default: a free one).")] = None,
    accept_license: AcceptLicenseOpt = None,
    startup_timeout: Annotated[float, typer.Option("--startup-timeout", min=0, help="Seconds the whole start may take: "
                                                   "every node healthy and the router answering (0: no limit).")] = 3600,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Start K servers of a CPU profile and vllm-router in front of them, on this machine; Ctrl-C stops them all.

    For tests and demos. Ready when every node and the router answer /health; then prints the router's endpoint. A node that dies is reported and routed around while another is left. Exit 0 when stopped by Ctrl-C/SIGTERM with every node serving, 1 when a node or the router was lost or did not start, 2 for a profile or option to change, 130 when stopped before the fleet was ready.
    """
    from glmctl._cli.output import Output
    from glmctl.fleet.local_fleet import prepare_fleet, run_fleet
    from glmctl.serving import launch_licenses

    out = Output.from_flags(json_, quiet)
    accept = accept_license or []
    launch_licenses.check_accept_ids(accept)
    out.note(f"preflight for profile '{profile}' ...")
    fleet = prepare_fleet(profile, model=model, nodes=nodes, port=port, metrics_port=metrics_port,
                          drafter=drafter, accept=accept)
    out.note(f"starting {nodes} node(s) and vllm-router (files and logs: {fleet.run_dir})")

    def on_lost(index: int, status: int, goes_on: bool) -> None:
        server = fleet.servers[index]
        tail = ("; the router takes it out of rotation and places its sessions on the other node(s)" if goes_on
                else "; it was the last node")
        out.warn(f"node {index + 1} ({server.launch.base_url}) exited with status {status}{tail} "
                 f"(log: {server.run_dir / 'vllm.log'})")

    code = run_fleet(fleet, timeout_s=startup_timeout or None, on_ready=lambda info: _ready(out, info),
                     on_lost=on_lost)
    out.note(f"fleet stopped (exit status {code})")
    raise typer.Exit(code)


def _ready(out, info) -> None:
    from glmctl.fleet.router import POLICY, SESSION_HEADER

    data = {
        "profile": info.profile, "model": info.model, "endpoint": f"{info.router_url}/v1",
        "router": {"url": info.router_url, "metrics": info.router_metrics, "pid": info.router_pid,
                   "log": info.router_log, "policy": POLICY, "session_header": SESSION_HEADER},
        "nodes": [{"url": n.base_url, "pid": n.pid, "log": n.log_path, "run_dir": n.run_dir,
                   "startup_s": round(n.startup_s, 1), "kv_cache_tokens": n.kv.tokens if n.kv else None}
                  for n in info.nodes],
        "run_dir": info.run_dir, "startup_s": round(info.startup_s, 1),
    }

    def draw(console) -> None:
        console.print(f"[green]fleet of {len(info.nodes)} node(s) serving profile '{info.profile}'[/green] after "
                      f"{info.startup_s:.0f} s")
        console.print(f"endpoint  {info.router_url}/v1  (vllm-router, {POLICY} on the {SESSION_HEADER} header; "
                      f"its metrics {info.router_metrics})", markup=False, soft_wrap=True)
        for i, n in enumerate(info.nodes):
            kv = f", KV cache {n.kv.tokens:,} tokens" if n.kv else ""
            console.print(f"node {i + 1}    {n.base_url}{kv}  (log {n.log_path})", markup=False, soft_wrap=True)
        console.print("\nCtrl-C stops the router and every node.")

    out.result(data, draw)
    sys.stdout.flush()


@app.command("status", epilog=examples("glmctl fleet status --url http://127.0.0.1:8000",
                                       "glmctl fleet status --url http://router:8000 --json"))
def status(
    url: Annotated[str, typer.Option("--url", help="The router's base URL, e.g. http://127.0.0.1:8000.")],
    timeout: Annotated[float, typer.Option("--timeout", min=0.1, metavar="SECONDS",
                                           help="Seconds each request (to the router, to each node) may take.")] = 10.0,
    api_key: ApiKeyOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Each node's health (the router's view and its own /health), sessions in its engine and KV use, from its /metrics.

    Exit 0 when every node is healthy, 1 when one is not (or the router does not answer), 2 when the URL is not a vllm-router.
    """
    from glmctl._cli.output import Output
    from glmctl.evals.transport import resolve_api_key, validate_url
    from glmctl.fleet.fleet_status import fleet_status

    out = Output.from_flags(json_)
    key = resolve_api_key(api_key)
    headers = {"Authorization": f"Bearer {key.value}"} if key else {}
    result = fleet_status(validate_url(url), headers=headers, timeout=timeout)

    def draw(console) -> None:
        from rich.markup import escape
        from rich.table import Table

        table = Table(title=f"vllm-router {escape(result.router)}: {result.healthy_nodes} of {len(result.nodes)} "
                            f"node(s) healthy, {result.sessions} session(s) in their engines", title_justify="left")
        table.add_column("node", no_wrap=True)
        for col in ("router", "/health", "sessions", "KV used", "finished"):
            table.add_column(col, justify="right", no_wrap=True)
        table.add_column("note", overflow="fold")
        for n in result.nodes:
            sessions = "—" if n.sessions is None else f"{n.sessions} ({n.running} running)"
            table.add_row(escape(n.url), "routed" if n.routed else "[red]out[/red]",
                          "ok" if n.healthy else "[red]down[/red]", sessions,
                          "—" if n.kv_usage is None else f"{100 * n.kv_usage:.1f}%",
                          _num(n.requests_finished), escape(n.error or ""))
        console.print(table)
        console.print(f"[dim]sessions: requests running or waiting in the node's engine (vLLM's gauges); a session "
                      f"is there while one of its turns is. Policy {result.policy}, keyed on "
                      f"{result.session_header}.[/dim]")

    out.result(result, draw)
    if not result.all_healthy:
        out.warn(f"{len(result.nodes) - result.healthy_nodes} of {len(result.nodes)} node(s) not healthy")
        raise typer.Exit(1)


def _num(value: int | None) -> str:
    return "—" if value is None else f"{value:,}"
