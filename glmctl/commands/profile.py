"""`glmctl profile ls|show|validate|render`: the serving profiles, inspected and taken away."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from glmctl._cli.completion import profile_names
from glmctl._cli.options import JsonOpt, QuietOpt, examples

app = typer.Typer(
    help="Serving profiles: list, show, validate, and render to vLLM's own config and env files.",
    no_args_is_help=True,
)

NameArg = Annotated[str, typer.Argument(autocompletion=profile_names, help="A profile name (glmctl profile ls) or a YAML file.")]
ModelPathOpt = Annotated[
    Path | None, typer.Option("--model", "-m", help="Checkpoint directory (overrides the profile's).")
]
DrafterOpt = Annotated[
    Path | None, typer.Option("--drafter", help="Drafter checkpoint directory (DFlash2 profiles).")
]
HostOpt = Annotated[str, typer.Option("--host", help="Address vLLM listens on.")]
PortOpt = Annotated[int, typer.Option("--port", min=1, max=65535, help="Port vLLM listens on.")]


@app.command("ls", epilog=examples("glmctl profile ls", "glmctl profile ls --json"))
def ls(json_: JsonOpt = False, quiet: QuietOpt = False) -> None:
    """List the shipped and user profiles (a user profile shadows a shipped one of the same name)."""
    from glmctl import paths
    from glmctl._cli.output import Output
    from glmctl.serving import profiles

    out = Output.from_flags(json_, quiet)
    rows = profiles.summaries()

    def draw(console) -> None:
        from rich.markup import escape
        from rich.table import Table

        table = Table(title="serving profiles", caption=f"user profiles: {paths.user_profiles()}")
        for col in ("name", "from", "usage", "platform", "description"):
            table.add_column(col)
        for r in rows:
            desc = escape(r.description) if r.error is None else f"[red]invalid:[/red] {escape(r.error.splitlines()[0])}"
            table.add_row(r.name, r.origin, r.usage or "-", r.platform or "-", desc)
        console.print(table)

    out.result(rows, draw)


@app.command("show", epilog=examples("glmctl profile show commercial", "glmctl profile show noncommercial --json"))
def show(name: NameArg, json_: JsonOpt = False) -> None:
    """Print a profile as glmctl resolves it (`extends` applied, defaults filled in; secrets as ***)."""
    from glmctl._cli.output import Output
    from glmctl.serving import profiles
    from glmctl.serving.launch_files import masked

    out = Output.from_flags(json_)
    prof = profiles.load(name)
    data = masked(prof.model_dump(mode="json"))  # env and vllm_args secrets as ***

    def draw(console) -> None:
        import yaml

        console.print(yaml.safe_dump(data, sort_keys=False), markup=False, end="", soft_wrap=True)
        for note in prof.advisories():
            out.warn(note)

    out.result(data, draw)


@app.command(
    "validate",
    epilog=examples("glmctl profile validate commercial", "glmctl profile validate ./my-profile.yaml"),
)
def validate(
    name: NameArg,
    no_vllm: Annotated[bool, typer.Option("--no-vllm", help="Skip vLLM's own parser (schema, licences and "
                                                             "vLLM 0.30's shipped flag list only).")] = False,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Check a profile: schema, licence policy, and vLLM's own parser on the rendered config."""
    from glmctl._cli.output import Output
    from glmctl.serving.validation import validate as run_validation

    out = Output.from_flags(json_, quiet)
    report = run_validation(name, use_vllm=False if no_vllm else None)

    def draw(console) -> None:
        from rich.markup import escape

        for w in report.warnings:
            out.warn(escape(w))
        if report.valid:
            console.print(f"[green]valid[/green]: profile '{report.profile}' ({', '.join(report.checked_by)})")
            if report.needs_acceptance:
                flags = " ".join(f"--accept-license {i}" for i in report.needs_acceptance)
                console.print(f"serving it needs licence acceptance: {flags}")
        else:
            console.print(f"[red]invalid[/red]: profile '{escape(report.profile)}'")
            for e in report.errors:
                console.print(f"  {escape(e)}")

    out.result(report, draw)
    if not report.valid:
        raise typer.Exit(2)


@app.command(
    "render",
    epilog=examples(
        "glmctl profile render commercial --model /models/glm-5.3-flash-exl3 --out deploy/",
        "cd deploy && ./command.sh     # the same server, without glmctl's CLI",
    ),
)
def render_cmd(
    name: NameArg,
    out_dir: Annotated[Path | None, typer.Option("--out", "-o", help="Write vllm.yaml, vllm.env, command.sh here.")] = None,
    model: ModelPathOpt = None,
    drafter: DrafterOpt = None,
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 8000,
    json_: JsonOpt = False,
) -> None:
    """Render a profile to what vLLM reads: a `vllm serve --config` YAML, an env file, one command.

    The files in --out stand alone: command.sh runs `vllm serve --config vllm.yaml` from its own directory, so the directory can be copied to another machine (with glmctl installed there, its plugin loads through vLLM's entry point). Printed without --out, secrets show as ***; in --out, vllm.env (and vllm.yaml when it holds a key) is readable by its owner only.
    """
    from glmctl._cli.output import Output
    from glmctl.serving import launch_files, profiles

    out = Output.from_flags(json_)
    prof = launch_files.with_paths(profiles.load(name), model=model, drafter=drafter)
    launch = launch_files.render(prof, host=host, port=port)
    if out_dir is not None:
        files = launch_files.write(launch, out_dir)
        result = {"config": files.config, "env": files.env, "command_file": files.command,
                  "notices": files.notices, "command": files.command_line}

        def draw(console) -> None:
            for label, path in (("config", files.config), ("env", files.env), ("command", files.command),
                                ("notices", files.notices)):
                if path is not None:
                    console.print(f"{label:8} {path}", markup=False, soft_wrap=True)
            console.print(f"\nrun:     {files.command_line}", markup=False, soft_wrap=True)

        out.result(result, draw)
        return
    config, env = Path(launch_files.CONFIG_NAME), Path(launch_files.ENV_NAME)
    result = {"config": launch_files.masked(launch.config), "env": launch_files.masked(launch.env),
              "command": launch.command(config, env)}

    def draw_inline(console) -> None:
        console.print(launch.listing(config, env), markup=False, soft_wrap=True)

    out.result(result, draw_inline)
