"""`glmctl testing ...`: helpers for the project's own tests and demo (the tiny checkpoint)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from glmctl._cli.options import JsonOpt, QuietOpt, examples

app = typer.Typer(help="Test fixtures: the tiny GLM-5.3-Flash checkpoint.", no_args_is_help=True)


@app.command(
    "tiny-checkpoint",
    epilog=examples(
        "glmctl testing tiny-checkpoint out/tiny-glm",
        "glmctl testing tiny-checkpoint out/tiny-glm --seed 1 --layers 8 --force",
        "glmctl testing tiny-checkpoint out/tiny-glm --index-topk 256 --json",
    ),
)
def tiny_checkpoint(
    directory: Annotated[Path, typer.Argument(metavar="DIR", help="Where to write the checkpoint.")],
    seed: Annotated[int, typer.Option("--seed", help="Weight seed; the same seed gives identical files.")] = 0,
    layers: Annotated[
        int,
        typer.Option("--layers", help="Decoder layers (>= 2), in the repeating pattern KDA, MLA, MLA (shared indexer), KDA."),
    ] = 4,
    index_topk: Annotated[
        int, typer.Option("--index-topk", help="Tokens the DSA indexer keeps per query (a multiple of --index-kpool).")
    ] = 128,
    index_kpool: Annotated[int, typer.Option("--index-kpool", help="Indexer keys pooled per group (> 1).")] = 16,
    max_position_embeddings: Annotated[
        int, typer.Option("--max-position-embeddings", help="Context length the config declares (tokens).")
    ] = 8192,
    mtp_layers: Annotated[int, typer.Option("--mtp-layers", help="MTP (next-token prediction) layers.")] = 1,
    force: Annotated[bool, typer.Option("--force", help="Replace DIR if it is not empty.")] = False,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Write a small random-weight checkpoint of the real GLM-5.3-Flash architecture.

    KDA and indexed-MLA layers (full and shared indexers), MoE with a shared expert, mHC streams,
    an MTP layer, a BPE tokenizer trained on Python's standard library, and sharded safetensors with
    an index: what vLLM 0.30 and transformers 5.24 load. Builds in seconds on a CPU; written to a
    temporary directory beside DIR and renamed when complete.
    """
    from glmctl._cli.output import Output
    from glmctl.errors import require_module

    out = Output.from_flags(json_, quiet)
    require_module("torch", "cpu", "building the tiny checkpoint")
    require_module("tokenizers", "cpu", "training the tiny checkpoint's tokenizer")
    from glmctl.testing.tiny_checkpoint import build

    with out.progress() as bar:
        task = bar.add_task("drawing weights", total=None)
        info = build(
            directory, seed=seed, force=force,
            on_progress=lambda done, total: bar.update(task, completed=done, total=total),
            layers=layers, index_topk=index_topk, index_kpool=index_kpool,
            max_position_embeddings=max_position_embeddings, mtp_layers=mtp_layers,
        )
    out.result(info.summary(), render=lambda console: _render(console, info.summary()))


def _render(console, s: dict) -> None:
    from rich.table import Table

    table = Table(title=f"tiny GLM-5.3-Flash checkpoint: {s['path']}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    kinds = ", ".join(
        "KDA" if t == "linear_attention" else f"MLA/{ix}"
        for t, ix in zip(s["layer_types"], s["indexer_types"], strict=True)
    )
    rows = [
        ("architecture", f"{s['architecture']} (model_type {s['model_type']})"),
        ("parameters", f"{s['params'] / 1e6:.1f} M in {s['tensors']} tensors"),
        ("layers", f"{kinds}; MLP {', '.join(s['mlp_layer_types'])}; + {s['mtp_layers']} MTP"),
        ("hidden / vocab", f"{s['hidden_size']} / {s['vocab_size']} (tokenizer {s['tokenizer_vocab']})"),
        ("MoE", s["experts"]),
        ("sparse attention", f"top {s['index_topk']} tokens in pools of {s['index_kpool']}; "
                             f"KV block size must be a multiple of {s['kv_block_size_multiple']} tokens"),
        ("MLA latent", f"{s['kv_lora_rank']} (NoPE)"),
        ("context", f"{s['max_position_embeddings']} tokens"),
        ("files", ", ".join(f"{n} ({b / 2**20:.1f} MiB)" if b > 2**20 else n for n, b in s["files"].items())),
        ("size", f"{s['bytes'] / 2**20:.1f} MiB, built in {s['build_seconds']} s (seed {s['seed']})"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)
