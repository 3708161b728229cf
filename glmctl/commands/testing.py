"""`glmctl testing ...`: helpers for the project's own tests and demo (the tiny checkpoint)."""

from __future__ import annotations

import typer

app = typer.Typer(help="Test fixtures: the tiny GLM-5.3-Flash checkpoint.", no_args_is_help=True)
