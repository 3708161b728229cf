"""Option types shared by several commands, declared once (the `hf` CLI's habit)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from glmctl._cli.completion import profile_names

JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print one JSON document on stdout instead of tables.")
]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors.")]
ModelOpt = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        help="Checkpoint directory, a config.json, or the preset 'glm-5.3-flash'.",
    ),
]
ProfileOpt = Annotated[
    str | None, typer.Option("--profile", "-p", autocompletion=profile_names,
                             help="A shipped or user serving profile name.")
]
UrlOpt = Annotated[
    str | None,
    typer.Option("--url", help="Base URL of a running OpenAI-compatible server, e.g. http://127.0.0.1:8000."),
]
ApiKeyOpt = Annotated[
    str | None,
    typer.Option("--api-key", show_default=False, metavar="KEY",
                 help="API key the server was started with (default: $VLLM_API_KEY, else $OPENAI_API_KEY). "
                      "Sent as a bearer token, never printed."),
]
RequestTimeoutOpt = Annotated[
    float, typer.Option("--timeout", min=1, metavar="SECONDS",
                        help="Seconds one request may take in all: connecting, the server's work and every "
                             "byte of the answer.")
]
DeadlineOpt = Annotated[
    float, typer.Option("--deadline", min=0, metavar="SECONDS",
                        help="Seconds the whole command may take, a --profile server's start-up included "
                             "(0: no limit).")
]

ServedModelOpt = Annotated[
    str | None, typer.Option("--model", "-m", help="Served model name to check (default: the only one served).")
]
TokenizerOpt = Annotated[
    Path | None,
    typer.Option("--tokenizer", help="Use the HF tokenizer in this checkpoint directory instead of the "
                                     "server's /tokenize (for servers without it)."),
]
BaselineOpt = Annotated[
    Path | None, typer.Option("--baseline", help="A result file of an earlier run to compare against.")
]
CheckpointOpt = Annotated[
    Path | None, typer.Option("--checkpoint", help="With --profile: the checkpoint directory to serve.")
]
AcceptLicenseOpt = Annotated[
    list[str] | None, typer.Option("--accept-license", help="With --profile: accept this licence id (repeatable).")
]


def examples(*lines: str) -> str:
    """Render a command's examples into its help epilog."""
    body = "\n\n".join(f"  $ {line}" for line in lines)
    return f"Examples:\n\n{body}"
