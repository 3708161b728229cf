"""`glmctl serve --profile NAME`: preflight, launch vLLM, follow start-up, hold the server."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from glmctl._cli.completion import profile_names
from glmctl._cli.options import JsonOpt, QuietOpt, examples


def serve(
    profile: Annotated[str, typer.Option("--profile", "-p", autocompletion=profile_names, help="Serving profile name (glmctl profile ls) or YAML file.")],
    model: Annotated[Path | None, typer.Option("--model", "-m", help="Checkpoint directory (overrides the profile's).")] = None,
    drafter: Annotated[Path | None, typer.Option("--drafter", help="Drafter checkpoint directory (DFlash2 profiles).")] = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on (0.0.0.0: every interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="Port to listen on.")] = 8000,
    accept_license: Annotated[
        list[str] | None,
        typer.Option("--accept-license", help="Accept this licence id (repeatable); recorded for later runs."),
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Run every preflight check a real start runs, print the "
                                          "command, config and environment; start, write and record nothing.")] = False,
    startup_timeout: Annotated[
        float, typer.Option("--startup-timeout", min=0, help="Seconds to wait for /health (0: no limit).")
    ] = 3600,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Start vLLM with a serving profile after checking everything it needs; Ctrl-C stops it.

    The preflight, the same for --dry-run: licences, checkpoint files and format, the port, vLLM and glmctl's plugin importable and vLLM's parser accepting the config, the GPUs, and the planned KV capacity. Exit 2 when the command or profile must change, 1 when the node lacks something, else vLLM's own exit status.
    """
    from glmctl._cli.output import Output
    from glmctl.serving import launch_licenses
    from glmctl.serving import server as srv

    out = Output.from_flags(json_, quiet)
    accept = accept_license or []
    launch_licenses.check_accept_ids(accept)
    confirm = _terminal_confirm(out) if sys.stdin.isatty() and out.human and not dry_run else None
    out.note(f"preflight for profile '{profile}' ...")
    held: list = []  # the server, once prepared: the log echo asks whether it is up and not stopping
    server = srv.prepare(profile, model=model, drafter=drafter, host=host, port=port, accept=accept,
                         confirm=confirm, on_line=_error_echo(out, held), record=not dry_run)
    held.append(server)
    for line in server.report.passed:
        out.note(f"  ok  {line}")
    for line in server.report.warnings:
        out.warn(line)
    for lic in server.report.gate.recorded if server.report.gate else []:
        if lic.id in getattr(confirm, "shown", ()):
            out.note(f"licence {lic.id} accepted and recorded")
        else:  # accepted by flag or environment: the operator still sees what was agreed to
            _print_notice(out, lic, "accepted and recorded")
    if dry_run:
        _dry_run(out, server)
        return
    out.note(f"starting vLLM (log: {server.run_dir / srv.LOG_NAME})")
    with _progress(out) as progress:

        def ready(info) -> None:
            progress.stop()
            _ready(out, server, info)

        code = srv.run_foreground(
            server, timeout_s=startup_timeout or None, on_progress=progress.update, on_ready=ready
        )
    if code != 0 and server.info is not None and server.process is not None:
        out.warn(f"vLLM exited with status {code}; last log lines:")
        for line in server.process.last_lines(20):
            out.err.print(f"  | {line}", markup=False, highlight=False)
    elif server.info is not None:
        out.note(f"vLLM stopped (exit status {code})")
    raise typer.Exit(code)


serve.epilog = examples(
    "glmctl serve --profile commercial --model /models/glm-5.3-flash-exl3 --accept-license shapleymcg-1.0",
    "glmctl serve --profile noncommercial --model /models/glm-5.3-flash-exl3 --drafter /models/dflash2 "
    "--accept-license dflash2-cc-by-nc-nd-4.0",
    "glmctl serve --profile tiny-cpu --model out/tiny-glm --port 8001",
    "glmctl serve --profile latency --model /models/glm-5.3-flash --dry-run",
)


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def _dry_run(out, server) -> None:
    from glmctl.hub.licenses import describe
    from glmctl.serving import launch_files

    launch, run_dir = server.launch, server.run_dir
    config, env = run_dir / launch_files.CONFIG_NAME, run_dir / launch_files.ENV_NAME
    result = {
        "profile": launch.profile.name,
        "command": launch.command(config, env),
        "argv": launch.argv(config),
        "config": launch_files.masked(launch.config),
        "env": launch_files.masked(launch.env),
        "licenses": [describe(lic) for lic in launch.notices],
        "advisories": launch.profile.advisories(),
        "preflight": {"passed": server.report.passed, "warnings": server.report.warnings},
    }

    def draw(console) -> None:
        console.print(f"# dry run: every preflight check passed; nothing was started, written or recorded; "
                      f"glmctl would write {run_dir}/", markup=False, soft_wrap=True)
        console.print(launch.listing(config, env), markup=False, soft_wrap=True)

    out.result(result, draw)


def _print_notice(out, lic, what: str) -> None:
    out.note(f"licence {lic.id} {what}: {lic.name}")
    out.note(lic.notice.strip())
    if lic.url:
        out.note(f"licence text: {lic.url}")
    out.note("obligations: " + "; ".join(lic.obligations))


def _terminal_confirm(out):
    """Ask on the terminal (only ever called when stdin is one): the operator types the id."""

    def confirm(lic) -> bool:
        _print_notice(out, lic, "needs your acceptance")
        confirm.shown.add(lic.id)
        answer = input(f"Type the licence id ({lic.id}) to accept it, anything else to stop: ")
        return answer.strip() == lic.id

    confirm.shown = set()
    return confirm


def _error_echo(out, held: list):
    """While it serves, vLLM's errors reach the operator's terminal too (the full log is on disk)."""

    def on_line(line: str) -> None:
        serving = held and held[0].info is not None and not held[0].stopping
        if serving and (" ERROR " in line or "Traceback" in line):
            out.err.print(line, markup=False, highlight=False)

    return on_line


class _progress:
    """A spinner with vLLM's start-up phase on a terminal; one line per phase otherwise."""

    def __init__(self, out) -> None:
        self.out = out
        self.status = None
        self.last_phase = None

    def __enter__(self):
        if self.out.human and self.out.err.is_terminal:
            self.status = self.out.err.status("starting vLLM")
            self.status.start()
        return self

    def update(self, proc) -> None:
        phase = proc.phase + (f" {proc.shards[0]}/{proc.shards[1]} shards" if proc.shards and
                              proc.phase == "loading weights" else "")
        if self.status is not None:
            self.status.update(f"starting vLLM: {phase} ({proc.elapsed_s:.0f} s)")
        elif proc.phase != self.last_phase:
            self.out.note(f"  vLLM: {proc.phase} ({proc.elapsed_s:.0f} s)")
        self.last_phase = proc.phase

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None


def _ready(out, server, info) -> None:
    from glmctl.hub.licenses import describe

    kv = info.kv
    plan = info.capacity
    data = {
        "profile": info.profile,
        "endpoint": f"{info.base_url}/v1",
        "model": info.model,
        "pid": info.pid,
        "startup_s": round(info.startup_s, 1),
        "kv_cache_tokens": kv.tokens if kv else None,
        "kv_cache_source": "vLLM start-up log (measured)" if kv else None,
        "max_concurrency_at_max_model_len": kv.max_concurrency if kv else None,
        "planned_kv_cache_tokens": plan.kv_tokens if plan and plan.available else None,
        "plan_note": plan.note if plan else None,
        "log": info.log_path,
        "run_dir": info.run_dir,
        "licenses": [describe(lic) for lic in info.notices],
    }

    def draw(console) -> None:
        from rich.table import Table

        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold")
        table.add_column()
        table.add_row("endpoint", f"{info.base_url}/v1  (health {info.base_url}/health, metrics {info.base_url}/metrics)")
        table.add_row("model", info.model)
        if kv:
            table.add_row("KV cache", f"{kv.tokens:,} tokens: {kv.max_concurrency:.2f} sessions of {kv.max_model_len:,} "
                                      "tokens (measured: vLLM's start-up log)")
        if plan is not None:
            predicted = f"{plan.kv_tokens:,} tokens (predicted by glmctl plan)" if plan.available else plan.note
            table.add_row("plan", predicted)
        table.add_row("started in", f"{info.startup_s:.0f} s")
        table.add_row("log", str(info.log_path))
        console.print(f"[green]vLLM is serving profile '{info.profile}'[/green]")
        console.print(table)
        for lic in info.notices:
            console.print(f"\n[bold]{_escape(lic.name)}[/bold]\n{_escape(lic.notice.strip())}")
        console.print("\nCtrl-C stops the server.")

    out.result(data, draw)
    sys.stdout.flush()
