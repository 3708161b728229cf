"""`glmctl testing ...`: helpers for the project's own tests and demo (the tiny checkpoint, the rank model)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from glmctl._cli.options import JsonOpt, QuietOpt, examples

app = typer.Typer(help="Test fixtures: the tiny GLM-5.3-Flash checkpoint, its DFlash2 drafter, one TP rank of the real one.",
                  no_args_is_help=True)


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


@app.command(
    "rank-config",
    epilog=examples(
        "glmctl testing rank-config out/rank-tp8 --tp 8",
        "glmctl testing rank-config out/rank-tp8-exl3 --tp 8 --experts exl3",
        "glmctl testing rank-config out/rank-cut --num-layers 4 --mtp-layers 0 --dense-mlps --json",
    ),
)
def rank_config(
    directory: Annotated[Path, typer.Argument(metavar="DIR", help="Where to write the rank model's directory.")],
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel size the rank belongs to.")] = 8,
    experts: Annotated[str, typer.Option("--experts", help="bf16, fp8 (block-FP8 quantization_config) or exl3 "
                                         "(glmctl_exl3: EXL3 routed experts, FP8 rest).")] = "bf16",
    exl3_bits: Annotated[int, typer.Option("--exl3-bits", help="EXL3 bits per expert weight.")] = 4,
    num_layers: Annotated[int | None, typer.Option("--num-layers", help="Keep the first N layers (default all 45).")]
    = None,
    mtp_layers: Annotated[int | None, typer.Option("--mtp-layers", help="MTP layers (default the preset's 1).")] = None,
    dense_mlps: Annotated[bool, typer.Option("--dense-mlps", help="Every MLP dense: no MoE weights (KV-layout tests).")]
    = False,
    force: Annotated[bool, typer.Option("--force", help="Replace DIR if it is not empty.")] = False,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Write ONE tensor-parallel rank of GLM-5.3-Flash as a TP1 model: config.json, generation config
    and a tokenizer, no weights (serve it with `--load-format dummy`).

    Heads, KDA heads, expert / shared / dense intermediate sizes and the vocabulary are split as vLLM
    0.30 splits them; the indexer, latent, top-k, kpool, layers and MTP module are replicated and
    kept. Also prints the weight bytes per GPU `glmctl plan` predicts for the node and for this model.
    """
    from glmctl._cli.output import Output
    from glmctl.errors import require_module

    out = Output.from_flags(json_, quiet)
    require_module("tokenizers", "cpu", "training the rank model's tokenizer")
    from glmctl.plan.prediction.rank import rank_weights
    from glmctl.testing.rank_config import build_rank_config

    info = build_rank_config(directory, tp=tp, experts=experts, exl3_bits=exl3_bits, num_layers=num_layers,
                             mtp_layers=mtp_layers, dense_mlps=dense_mlps, force=force)
    summary = info.summary()
    if num_layers is None and not dense_mlps:
        weights = [rank_weights(experts, tp, mtp, exl3_bits).model_dump() for mtp in (False, True)]
        summary["predicted_weights"] = weights
    out.result(summary, render=lambda console: _render_rank(console, summary))


def _render_rank(console, s: dict) -> None:
    from rich.table import Table

    table = Table(title=f"rank model (one rank of TP{s['tp']}): {s['path']}", show_header=False,
                  title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("MLA / KDA heads", f"{s['num_attention_heads']} / {s['linear_num_heads']}"),
        ("experts", f"{s['n_routed_experts']} x intermediate {s['moe_intermediate_size']} ({s['experts']}, "
                    f"quant_method {s['quant_method']})"),
        ("dense MLP / vocab", f"{s['intermediate_size']} / {s['vocab_size']:,} (tokenizer {s['tokenizer_vocab']:,})"),
        ("indexer heads (replicated)", str(s["index_n_heads"])),
        ("layers", f"{s['num_hidden_layers']} + {s['mtp_layers']} MTP"),
        ("files", ", ".join(s["files"]) + "; no weights: serve with --load-format dummy"),
    ]
    for w in s.get("predicted_weights", []):
        gib = 1 << 30
        rows.append((f"weights per GPU{' + MTP' if w['mtp_layers'] else ''}",
                     f"{w['node_gpu_bytes'] / gib:.3f} GiB on a TP{w['tp']} GPU, {w['rank_model_bytes'] / gib:.3f} "
                     "GiB for this model (glmctl plan, predicted)"))
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)


@app.command(
    "tiny-drafter",
    epilog=examples(
        "glmctl testing tiny-drafter out/tiny-dflash2 --target out/tiny-glm",
        "glmctl testing tiny-drafter out/tiny-dflash2 --target out/tiny-glm --layers 1 --target-layers 0,1,2",
    ),
)
def tiny_drafter(
    directory: Annotated[Path, typer.Argument(metavar="DIR", help="Where to write the drafter.")],
    target: Annotated[Path, typer.Option("--target", metavar="TINY_DIR", help="The target checkpoint (its hidden size, vocabulary and tokenizer).")],
    seed: Annotated[int, typer.Option("--seed", help="Weight seed; the same seed gives identical files.")] = 0,
    layers: Annotated[int, typer.Option("--layers", help="Draft decoder layers.")] = 2,
    target_layers: Annotated[
        str | None, typer.Option("--target-layers", help="Target layers whose hidden states the drafter reads, e.g. 0,2.")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace DIR if it is not empty.")] = False,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Write a small random-weight DFlash2 drafter (vLLM's DFlash2DraftModel) for a tiny checkpoint.

    Qwen3-style draft layers with DFlash2's block convolutions and candidate selector, sized to the
    target (hidden size, vocabulary, mask token); shares the target's embedding and LM head, as
    vLLM loads DFlash drafters. Written to a temporary directory beside DIR and renamed.
    """
    from glmctl._cli.output import Output
    from glmctl.errors import UsageError, require_module

    out = Output.from_flags(json_, quiet)
    require_module("torch", "cpu", "building the tiny drafter")
    from glmctl.testing.tiny_drafter import build

    ids = None
    if target_layers is not None:
        try:
            ids = [int(part) for part in target_layers.split(",") if part.strip()]
        except ValueError as exc:
            raise UsageError(f"--target-layers '{target_layers}' is not a comma-separated list of layer numbers") from exc
    with out.progress() as bar:
        task = bar.add_task("drawing weights", total=None)
        info = build(directory, target, seed=seed, force=force, layers=layers, target_layer_ids=ids,
                     on_progress=lambda done, total: bar.update(task, completed=done, total=total))
    out.result(info.summary(), render=lambda console: _render_drafter(console, info.summary()))


def _render_drafter(console, s: dict) -> None:
    from rich.table import Table

    table = Table(title=f"tiny DFlash2 drafter: {s['path']}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    d = s["dflash_config"]
    for k, v in [
        ("architecture", f"{s['architecture']} (model_type {s['model_type']})"),
        ("target", s["target"]),
        ("parameters", f"{s['params'] / 1e6:.2f} M in {s['tensors']} tensors (+ the target's embedding and head)"),
        ("layers", f"{s['layers']}; {s['attention']}; hidden {s['hidden_size']}, vocab {s['vocab_size']}"),
        ("reads target layers", ", ".join(map(str, d["target_layer_ids"]))),
        ("selector", f"top {d['selector_top_k']}, rank {d['selector_rank']}; conv {d['conv_kernel_size']} taps"),
        ("draft KV", f"{s['kv_bytes_per_token']} bytes per token (bf16 K and V, all layers)"),
        ("built", f"{s['build_seconds']} s (seed {s['seed']})"),
    ]:
        table.add_row(k, v)
    console.print(table)
