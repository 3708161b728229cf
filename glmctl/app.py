"""The glmctl command line: a table of registrations and `main()`, nothing else.

Command modules are imported here, so they must stay light at import time: typer, rich and the
standard library only. Anything heavier (torch, vllm, transformers, pydantic models of a library)
is imported inside the command function that needs it.
"""

from __future__ import annotations

from typing import Annotated

import typer

from glmctl import __version__
from glmctl.commands import bench, doctor, fetch, fleet, plan, profile, quantize, serve, testing
from glmctl.commands import eval as eval_commands

app = typer.Typer(
    name="glmctl",
    help="Serve GLM-5.3-Flash with stock vLLM 0.30 on Ada/Ampere nodes without GPU peer-to-peer.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,  # errors are mapped once in main(); locals may hold tokens
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)

# The table, in the order an operator meets the commands: probe the node, get and convert the
# weights, plan, serve, check quality and speed (Typer lists the single commands before the
# groups). A function is a command, a Typer a command group.
REGISTRY = [
    ("doctor", doctor.doctor),
    ("fetch", fetch.fetch),
    ("quantize", quantize.app),
    ("plan", plan.plan),
    ("profile", profile.app),
    ("serve", serve.serve),
    ("fleet", fleet.app),
    ("eval", eval_commands.app),
    ("bench", bench.bench),
    ("testing", testing.app),
]

for _name, _entry in REGISTRY:
    if isinstance(_entry, typer.Typer):
        app.add_typer(_entry, name=_name)
    else:
        app.command(name=_name, epilog=getattr(_entry, "epilog", None))(_entry)


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
    from glmctl._cli.error_map import run_guarded

    raise SystemExit(run_guarded(lambda: app(prog_name="glmctl")))
