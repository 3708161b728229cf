"""`glmctl plan`: KV capacity and per-GPU memory for a model, node and serving setup."""

from __future__ import annotations

import typer

from glmctl._cli.options import JsonOpt, examples


def plan(json_: JsonOpt = False) -> None:
    """Plan KV capacity and memory per GPU (stub: the planner lands with issue 2)."""
    from glmctl.errors import GlmctlError

    raise GlmctlError("the planner is not built yet")


plan.epilog = examples("glmctl plan --gpus 8xL40 --tp 8")
_ = typer
