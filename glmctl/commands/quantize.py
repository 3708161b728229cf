"""`glmctl quantize ...`: checkpoint conversion. Each converter is one subcommand of this group.

To add one (e.g. `exl3`): write its library module under `quantize/`, then a function here that
parses options, calls it inside `_progress(out, ...)`, and renders its result; register it with
`@app.command("NAME", epilog=examples(...))`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from glmctl._cli.options import JsonOpt, QuietOpt, examples

if TYPE_CHECKING:
    from rich.console import Console

    from glmctl._cli.output import Output
    from glmctl.quantize.exl3_convert import Exl3Result
    from glmctl.quantize.fp8_convert import Fp8Result
    from glmctl.quantize.verify import VerifyResult

app = typer.Typer(help="Convert checkpoints: block-FP8 weights or EXL3 experts for vLLM, and verify the result.",
                  no_args_is_help=True)

SrcArg = Annotated[Path, typer.Argument(help="Source checkpoint directory (config.json + *.safetensors).")]
DstArg = Annotated[Path, typer.Argument(help="Output directory; created by renaming a finished temp dir.")]
EXIT_CODES = ("Exit codes: 0 done; 1 damaged input (missing shard, bad header), disk full or I/O error, "
              "verification failed; 2 bad options or config, DST not empty, resume with other settings; "
              "130 interrupted (rerun with --resume).")


def _progress(out: Output, label: str, run: Callable[[Callable[[int, int], None]], object]):
    """Run `run(on_progress)` under a bytes/s progress bar (human mode on a terminal only)."""
    with out.progress() as bar:
        task = bar.add_task(label, total=None)
        return run(lambda done, total: bar.update(task, completed=done, total=total))


def _convert(out: Output, kind: str, unit: str, dst: Path,
             run: Callable[[Callable[[int, int], None]], object]):
    """A converter under `_progress`; on Ctrl-C, say where the finished work is and how to resume."""
    try:
        return _progress(out, kind, run)
    except KeyboardInterrupt:
        from glmctl.quantize.job import partial_dir_for

        out.warn(f"interrupted; finished {unit} are kept in {partial_dir_for(dst.absolute(), kind)}: "
                 "rerun the same command with --resume")
        raise typer.Exit(130) from None


def _split(values: list[str] | None) -> tuple[str, ...]:
    return tuple(v.strip() for item in values or [] for v in item.split(",") if v.strip())


def fp8(
    src: SrcArg,
    dst: DstArg,
    modules: Annotated[list[str] | None, typer.Option(
        "--modules", metavar="GLOB",
        help="Module-name globs to convert (repeat or comma-separate). Default: the attention "
             "projections of KDA and MLA layers (listed above).")] = None,
    exclude: Annotated[list[str] | None, typer.Option(
        "--exclude", metavar="GLOB", help="Module-name globs to leave unconverted.")] = None,
    block: Annotated[int, typer.Option("--block", min=1, help="Block edge B: one fp32 scale per BxB block.")] = 128,
    embeddings: Annotated[bool, typer.Option(
        "--embeddings", help="Also convert embeddings and LM heads (vLLM 0.30 cannot load those in FP8).")] = False,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Continue an interrupted conversion from its last finished shard.")] = False,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace a non-empty DST (once the new one is complete) or discard a partial run.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would be converted; write nothing.")] = False,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Convert selected linear weights to block-scaled FP8 (e4m3, one fp32 scale per BxB block).

    Streams shard by shard and tensor by tensor into a hidden directory beside DST, renamed to DST when complete, with a new index and a config.json whose quantization_config is the one vLLM 0.30 reads (quant_method fp8, weight_block_size, modules_to_not_convert). Tensors already in FP8 pass through; norms, routers, convs, biases and KDA gate parameters are never touched.

    Default --modules: KDA q/k/v/o_proj, MLA q_a/q_b/kv_a_proj_with_mqa/kv_b/o_proj, indexer wq_b/wk. The table says what stock vLLM 0.30 does with each in FP8: keeps it FP8, dequantises it to BF16 at load, or needs the glmctl plugin.
    """
    from glmctl._cli.output import Output
    from glmctl.quantize.fp8_convert import convert_fp8
    from glmctl.quantize.fp8_plan import DEFAULT_MODULES, Fp8Settings

    out = Output.from_flags(json_, quiet)
    settings = Fp8Settings(block=block, modules=_split(modules) or DEFAULT_MODULES,
                           exclude=_split(exclude), embeddings=embeddings)
    result = _convert(out, "fp8", "shards", dst, lambda cb: convert_fp8(
        src, dst, settings, force=force, resume=resume, dry_run=dry_run, on_progress=cb))
    out.result(result, render=lambda console: _render_fp8(console, result))


fp8.epilog = examples(
    "glmctl quantize fp8 /models/GLM-5.3-Flash /models/GLM-5.3-Flash-attn-fp8",
    "glmctl quantize fp8 SRC DST --dry-run --modules '*.self_attn.*_proj' --exclude '*.indexer.*'",
    "glmctl quantize fp8 SRC DST --resume",
) + "\n\n" + EXIT_CODES


def verify(
    dst: Annotated[Path, typer.Argument(help="Converted checkpoint directory.")],
    reference: Annotated[Path | None, typer.Option(
        "--reference", metavar="SRC", help="The source checkpoint: adds per-tensor dequantisation error.")] = None,
    min_snr_db: Annotated[float, typer.Option(
        "--min-snr-db", help="Fail when a converted tensor's SNR vs the reference is below this (dB).")] = 25.0,  # = verify.DEFAULT_MIN_SNR_DB
    top: Annotated[int, typer.Option("--top", min=0, help="Rows of worst tensors to show (human mode).")] = 10,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Check a block-FP8 checkpoint: structure, scales, config vs tensors, and error vs --reference."""
    from glmctl._cli.output import Output
    from glmctl.quantize.verify import verify_fp8

    out = Output.from_flags(json_, quiet)
    result = _progress(out, "verify", lambda cb: verify_fp8(dst, reference, min_snr_db=min_snr_db, on_progress=cb))
    data = {**_asdict(result), "ok": result.ok, "worst_snr_db": result.worst_snr_db,
            "max_rel_rms": result.max_rel_rms}
    out.result(data, render=lambda console: _render_verify(console, result, top))
    if not result.ok:
        raise typer.Exit(1)


verify.epilog = examples(
    "glmctl quantize verify /models/GLM-5.3-Flash-attn-fp8",
    "glmctl quantize verify DST --reference /models/GLM-5.3-Flash --json",
) + "\n\n" + EXIT_CODES

def exl3(
    src: SrcArg,
    dst: DstArg,
    bits: Annotated[int, typer.Option("--bits", min=2, max=8, help="Bits per weight of the routed experts (2-8).")] = 4,
    experts: Annotated[list[str] | None, typer.Option(
        "--experts", metavar="GLOB",
        help="Experts modules to convert, by name (e.g. 'model.layers.[3-9].mlp.experts'; repeat or "
             "comma-separate). Default: every MoE layer, the MTP layer included.")] = None,
    calibration: Annotated[str, typer.Option(
        "--calibration", metavar="FILES|none",
        help="Text files (comma-separated) run through the model layer by layer for a shared gate/up "
             "Hessian per layer and a per-expert down Hessian, or 'none' for calibration-free.")] = "none",
    calibration_tokens: Annotated[int, typer.Option(
        "--calibration-tokens", min=1, help="Calibration tokens to use (rows of 2048).")] = 131072,
    tp: Annotated[list[str] | None, typer.Option(
        "--tp", metavar="DEGREES",
        help="Tensor-parallel degrees the output must split at (every slice on 128-element "
             "boundaries). Default: those of the shipped EXL3 serving profiles.")] = None,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Continue an interrupted conversion from its last finished layer.")] = False,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace a non-empty DST (once the new one is complete) or discard a partial run.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would be converted; write nothing.")] = False,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Quantize the routed experts to EXL3 with exllamav3 1.6.5 (mul1 codebook); copy everything else.

    Needs a CUDA GPU (exllamav3's quantizer) except with --dry-run. Writes one shard per converted MoE layer, the source shards without those experts, and a config.json whose quantization_config (quant_method glmctl_exl3) the glmctl vLLM plugin reads; glmctl-exl3-report.json lists every tensor's proxy error (calibrated) or RMSE (calibration-free).
    """
    from glmctl._cli.output import Output
    from glmctl.errors import UsageError
    from glmctl.quantize.exl3_convert import convert_exl3
    from glmctl.quantize.exl3_plan import DEFAULT_EXPERTS_GLOB, Exl3Settings, default_tp_degrees

    out = Output.from_flags(json_, quiet)
    files = () if calibration.strip().lower() == "none" else _split([calibration])
    missing = [f for f in files if not Path(f).is_file()]
    if missing:  # refused by the dry run too, before hours of work would find it
        raise UsageError(f"--calibration: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not a file",
                         hint="pass text files, comma-separated, or --calibration none")
    if files and Path(src).is_dir() and not (Path(src) / "tokenizer.json").is_file():
        raise UsageError(f"--calibration needs the checkpoint's tokenizer, and {src} has no tokenizer.json",
                         hint="copy the tokenizer files into SRC, or pass --calibration none")
    try:
        degrees = tuple(int(t) for t in _split(tp)) or default_tp_degrees()
    except ValueError:
        raise typer.BadParameter(f"--tp takes integers, got {', '.join(_split(tp))}") from None
    settings = Exl3Settings(bits=bits, experts=_split(experts) or (DEFAULT_EXPERTS_GLOB,),
                            calibration=tuple(str(Path(f).absolute()) for f in files),
                            calibration_tokens=calibration_tokens, tp_degrees=degrees)
    result = _convert(out, "exl3", "layers", dst, lambda cb: convert_exl3(
        src, dst, settings, force=force, resume=resume, dry_run=dry_run, on_progress=cb))
    out.result(result, render=lambda console: _render_exl3(console, result))


exl3.epilog = examples(
    "glmctl quantize exl3 /models/GLM-5.3-Flash /models/GLM-5.3-Flash-exl3 --calibration none",
    "glmctl quantize exl3 SRC DST --calibration corpus.txt,code.txt --tp 8",
    "glmctl quantize exl3 SRC DST --dry-run --experts 'model.layers.[3-9].mlp.experts'",
    "glmctl quantize exl3 SRC DST --resume",
) + "\n\n" + EXIT_CODES


app.command("fp8", epilog=fp8.epilog)(fp8)
app.command("verify", epilog=verify.epilog)(verify)
app.command("exl3", epilog=exl3.epilog)(exl3)


def _asdict(obj) -> dict:
    import dataclasses

    return dataclasses.asdict(obj)


def _size(n: float) -> str:
    """Three significant digits: 512 KiB, 64.0 KiB, 1.50 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1000 or unit == "TiB":
            if unit == "B":
                return f"{n:.0f} B"
            return f"{n:.0f} {unit}" if abs(n) >= 100 else f"{n:.1f} {unit}" if abs(n) >= 10 \
                else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def _render_fp8(console: Console, r: Fp8Result) -> None:
    from rich import box
    from rich.table import Table

    from glmctl.quantize.glm5next import FATE_SHORT, FATE_TEXT, PLUGIN_FATE_SHORT

    title = f"{'Plan (dry run; nothing written)' if r.dry_run else 'Converted'}: {r.src} -> {r.dst}"
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("module", overflow="fold")
    for col in ("tensors", "before", "after"):
        table.add_column(col, justify="right", no_wrap=True)
    table.add_column("stock vLLM", no_wrap=True)
    table.add_column("+ glmctl", no_wrap=True)
    for row in r.roles:
        table.add_row(row.role.replace("self_attn.", ""), str(row.tensors), _size(row.bytes_in),
                      _size(row.bytes_out),
                      FATE_SHORT.get(row.fate, row.fate),
                      PLUGIN_FATE_SHORT.get(row.plugin_fate, row.plugin_fate))
    console.print(table)
    for fate in sorted({row.fate for row in r.roles}):
        console.print(f"  [dim]{FATE_SHORT.get(fate, fate)}: {FATE_TEXT.get(fate, fate)}[/dim]")
    console.print("  [dim]+ glmctl: what vLLM 0.30 does with glmctl's plugin (installed with glmctl)[/dim]")
    saved = r.bytes_in - r.bytes_out
    console.print(f"{r.tensors_quantized} tensors converted, {r.tensors_kept_fp8} already FP8, "
                  f"{r.tensors_copied} copied unchanged; weights {_size(r.bytes_in)} -> {_size(r.bytes_out)} "
                  f"({saved / max(r.bytes_in, 1):.1%} smaller), {r.shards} shard(s)")
    if not r.dry_run:
        resumed = f", {r.shards_resumed} shard(s) from the earlier run" if r.shards_resumed else ""
        console.print(f"{r.seconds:.1f} s, {_size(r.read_bytes_per_s)}/s of source weights{resumed}")
    for note in r.notes:
        console.print(f"[yellow]note:[/yellow] {note}")


def _render_verify(console: Console, r: VerifyResult, top: int) -> None:
    from rich.table import Table

    state = "[green]OK[/green]" if r.ok else "[red]FAILED[/red]"
    console.print(f"{r.path}: {state} - {r.shards} shard(s), {r.tensors} tensors, {r.fp8_weights} FP8 "
                  f"weights in {r.block}x{r.block} blocks" if r.block else f"{r.path}: {state}")
    for p in r.problems:
        console.print(f"[red]problem:[/red] {p}")
    if not r.reference:
        return
    console.print(f"vs {r.reference}: {r.identical} tensors byte-identical, {len(r.errors)} converted")
    if not r.errors:
        return
    console.print(f"worst SNR {r.worst_snr_db:.2f} dB (limit {r.min_snr_db:g} dB), "
                  f"max relative RMS error {r.max_rel_rms:.4f}")
    table = Table(title=f"Worst {min(top, len(r.errors))} tensors by SNR", title_justify="left")
    table.add_column("module", overflow="fold")
    for col in ("shape", "rel RMS", "max |err|", "SNR dB"):
        table.add_column(col, justify="right", no_wrap=True)
    for e in sorted(r.errors, key=lambda e: e.snr_db)[:top]:
        snr = f"{e.snr_db:.2f}" if e.ok else f"[red]{e.snr_db:.2f}[/red]"
        table.add_row(e.name.removesuffix(".weight"), "x".join(map(str, e.shape)), f"{e.rel_rms:.4f}",
                      f"{e.max_abs:.3g}", snr)
    console.print(table)


def _render_exl3(console: Console, r: Exl3Result) -> None:
    title = f"{'Plan (dry run; nothing written)' if r.dry_run else 'Converted'}: {r.src} -> {r.dst}"
    console.print(title)
    qc = r.quantization_config["experts"]
    console.print(f"{len(r.layers)} MoE layer(s), {r.linears} expert projections -> EXL3 {qc['bits']} bits "
                  f"({qc['codebook']}, exllamav3 {qc['exllamav3']}); tensor-parallel degrees checked: "
                  f"{', '.join(map(str, qc['tp_degrees']))}")
    console.print(f"routed-expert weights {_size(r.expert_bytes_in)} -> {_size(r.expert_bytes_out)} "
                  f"({r.expert_bytes_out / max(r.expert_bytes_in, 1):.1%}); checkpoint {_size(r.bytes_out)}")
    if not r.dry_run:
        console.print(f"{r.calibrated} tensors calibrated, {r.uncalibrated} calibration-free; "
                      f"{r.seconds:.1f} s ({r.seconds_per_linear:.2f} s per projection)"
                      + (f", {r.units_resumed} unit(s) from the earlier run" if r.units_resumed else ""))
        if r.worst:
            from rich.table import Table

            table = Table(title="Largest errors (all in the report)", title_justify="left")
            for col in ("tensor", "metric", "error", "calibrated"):
                table.add_column(col, justify="left" if col == "tensor" else "right")
            for e in r.worst[:5]:
                table.add_row(e.name, e.metric, f"{e.error:.5f}", "yes" if e.calibrated else "no")
            console.print(table)
        console.print(f"report: {r.report}")
    for note in r.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
