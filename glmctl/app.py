"""The glmctl command line: a table of registrations and `main()`, nothing else.

Command modules are imported here, so they must stay light at import time: typer, rich and the
standard library only. Anything heavier (torch, vllm, transformers, pydantic models of a library)
is imported inside the command function that needs it.
"""

from __future__ import annotations

from typing import Annotated

import typer

from glmctl import __version__
from glmctl.commands import bench, doctor, fetch, plan, profile, quantize, serve, testing
from glmctl.commands import eval as eval_commands

app = typer.Typer(
    name="glmctl",
    help="Serve GLM-5.3-Flash with stock vLLM 0.30 on Ada/Ampere nodes without GPU peer-to-peer.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,  # errors are mapped once in main(); locals may hold tokens
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)

# (name, function) for leaf commands; (name, Typer) for command groups.
COMMANDS = [
    ("plan", plan.plan),
    ("fetch", fetch.fetch),
    ("doctor", doctor.doctor),
    ("bench", bench.bench),
    ("serve", serve.serve),
]
GROUPS = [
    ("quantize", quantize.app),
    ("testing", testing.app),
    ("eval", eval_commands.app),
    ("profile", profile.app),
]

for _name, _func in COMMANDS:
    app.command(name=_name, epilog=getattr(_func, "epilog", None))(_func)
for _name, _group in GROUPS:
    app.add_typer(_group, name=_name)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"glmctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """glmctl: plan, launch and check GLM-5.3-Flash on vLLM 0.30 for sm_8x nodes."""


def main() -> None:
    from glmctl._cli.errors import run_guarded

    raise SystemExit(run_guarded(lambda: app(prog_name="glmctl")))
