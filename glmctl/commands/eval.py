"""`glmctl eval perplexity|needle|kld|humaneval`: quality checks against a live OpenAI-compatible server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from glmctl._cli.options import (
    AcceptLicenseOpt,
    ApiKeyOpt,
    BaselineOpt,
    CheckpointOpt,
    DeadlineOpt,
    JsonOpt,
    ProfileOpt,
    QuietOpt,
    RequestTimeoutOpt,
    ServedModelOpt,
    TokenizerOpt,
    UrlOpt,
    examples,
)
from glmctl.commands import eval_humaneval, eval_kld

app = typer.Typer(help="Quality checks against a live server: perplexity, needle in a haystack, KLD, HumanEval.",
                  no_args_is_help=True)



def _template_kwargs(raw: str | None) -> dict | None:
    from glmctl.errors import UsageError

    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--template-kwargs is not JSON: {exc.msg}", hint="e.g. '{\"enable_thinking\": false}'") from exc
    if not isinstance(value, dict):
        raise UsageError("--template-kwargs must be a JSON object")
    return value


def perplexity(
    paths: Annotated[list[Path] | None, typer.Argument(
        help="Text files or directories to score (default: a fixed slice of Python's stdlib source).")] = None,
    url: UrlOpt = None,
    profile: ProfileOpt = None,
    checkpoint: CheckpointOpt = None,
    accept_license: AcceptLicenseOpt = None,
    model: ServedModelOpt = None,
    tokenizer_dir: TokenizerOpt = None,
    window: Annotated[int | None, typer.Option(min=2, help="Text tokens per request (default 4,096, within max_model_len).")] = None,
    stride: Annotated[int | None, typer.Option(min=1, help="New tokens scored per window (default: half the window).")] = None,
    bos: Annotated[str, typer.Option(help="What every window starts with (never scored): auto = the tokenizer's own "
                                          "special prefix (BOS), none = nothing, or a literal such as '[gMASK]<sop>'.")] = "auto",
    max_tokens: Annotated[int, typer.Option(min=2, help="Score the text's first N tokens.")] = 30_000,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write the result JSON here (a later --baseline).")] = None,
    baseline: BaselineOpt = None,
    timeout: RequestTimeoutOpt = 600.0,
    deadline: DeadlineOpt = 7200.0,
    api_key: ApiKeyOpt = None,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Token perplexity and bits per byte from the server's prompt log-probabilities.

    Strided sliding windows (each window scores only its new tokens); the method, the tokenizer and the text's hash are in the result. With --baseline: the paired relative change and its 95% CI.
    """
    from glmctl._cli.output import Output
    from glmctl.evals import corpus
    from glmctl.evals import perplexity as ppl
    from glmctl.evals.results import check_writable, load_result, save_result
    from glmctl.evals.target import open_server
    from glmctl.evals.tokenizer import open_tokenizer
    from glmctl.evals.transport import Deadline, resolve_api_key

    output = Output.from_flags(json_, quiet)
    check_writable(out)
    base = load_result(baseline, ppl.PerplexityResult, "perplexity") if baseline else None
    source = corpus.load_text(paths)
    with open_server(url, profile, model=model, checkpoint=checkpoint, accept=accept_license,
                     timeout=timeout, note=output.note, api_key=resolve_api_key(api_key),
                     deadline=Deadline(deadline, "glmctl eval perplexity")) as server, \
            output.progress(unit="tokens") as bar:
        tokenizer = open_tokenizer(server, tokenizer_dir)
        task = bar.add_task("scoring", total=None)
        result = ppl.measure(server, tokenizer, source, window=window, stride=stride, bos=bos,
                             max_tokens=max_tokens, on_start=lambda n: bar.update(task, total=n),
                             on_window=lambda n: bar.advance(task, n))
    if base is not None:
        result.comparison = ppl.compare(result, base, str(baseline))
    if out is not None:
        save_result(out, result)
    output.result(result.model_dump(exclude={"logprobs"}) | {"logprobs_saved_to": str(out) if out else None},
                  lambda console: _render_perplexity(console, result, out))


def _render_perplexity(console, r, out: Path | None) -> None:
    from rich.markup import escape as e
    from rich.table import Table

    console.print(f"[bold]Perplexity[/bold] of {e(r.server.model)} at {e(r.server.url)}")
    console.print(f"  text:      {r.text.tokens:,} tokens of {r.text.origin}"
                  f"{' (Python ' + r.text.python_version + ')' if r.text.python_version else ''}, "
                  f"{len(r.text.files)} file(s) from {e(r.text.files[0])}; sha256 {r.text.sha256[:12]}")
    console.print(f"  tokenizer: {e(r.tokenizer)} (no special tokens added to the text)")
    console.print(f"  windows:   {e(r.windowing.describe())}")
    table = Table(show_header=True, header_style="bold")
    for col in ("token perplexity", "± stderr", "bits per byte", "tokens scored", "bytes scored"):
        table.add_column(col, justify="right")
    table.add_row(f"{r.perplexity:.4f}", f"{r.perplexity_stderr:.4f}", f"{r.bits_per_byte:.4f}",
                  f"{r.tokens_scored:,}", f"{r.bytes_scored:,}")
    console.print(table)
    console.print(f"  [dim]stderr: {r.stderr_method}[/dim]")
    if r.comparison is not None:
        console.print(f"  [bold]vs baseline[/bold] {e(r.comparison.baseline_file)}: {e(r.comparison.describe())}")
        console.print(f"  [dim]{r.comparison.method}[/dim]")
    if out is not None:
        console.print(f"  result: {out}", markup=False)


perplexity.epilog = examples(
    "glmctl eval perplexity --url http://127.0.0.1:8000 --out ppl-bf16.json",
    "glmctl eval perplexity --url http://127.0.0.1:8000 --baseline ppl-bf16.json",
    "glmctl eval perplexity src/ --window 8192 --stride 4096 --url http://127.0.0.1:8000",
)


def needle(
    url: UrlOpt = None,
    profile: ProfileOpt = None,
    checkpoint: CheckpointOpt = None,
    accept_license: AcceptLicenseOpt = None,
    model: ServedModelOpt = None,
    tokenizer_dir: TokenizerOpt = None,
    lengths: Annotated[str, typer.Option(help="Prompt lengths in tokens (k = 1,000).")] = "32k,128k,250k",
    depths: Annotated[str, typer.Option(help="Needle depths, percent of the haystack.")] = "10,50,90",
    haystack: Annotated[list[Path] | None, typer.Option(
        help="Haystack source files or directories (default: Python's stdlib slice); repeatable.")] = None,
    kind: Annotated[str, typer.Option(help="Needle value: number (7 digits) or uuid.")] = "number",
    distractors: Annotated[int, typer.Option(min=0, max=100, help="Other names with other values in the haystack.")] = 3,
    api: Annotated[str, typer.Option(help="chat: the server applies the model's template; completion: the "
                                          "template is rendered here and the answer prefix is given.")] = "chat",
    template_kwargs: Annotated[str | None, typer.Option(
        help="JSON passed to the chat template, e.g. '{\"enable_thinking\": false}'.")] = None,
    max_answer_tokens: Annotated[int, typer.Option(min=1, help="Tokens the model may answer with.")] = 48,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the needles (per cell: seed, length, depth).")] = 0,
    out: Annotated[Path, typer.Option("--out", "-o", help="Results JSONL (resumed if it exists).")] = Path("needle.jsonl"),
    png: Annotated[Path | None, typer.Option(help="Heatmap PNG (default: next to --out; needs matplotlib).")] = None,
    restart: Annotated[bool, typer.Option(help="Start --out over instead of resuming it.")] = False,
    dry_run: Annotated[bool, typer.Option(help="Plan every cell's prompt and show the layout; ask nothing.")] = False,
    baseline: BaselineOpt = None,
    timeout: RequestTimeoutOpt = 1800.0,
    deadline: DeadlineOpt = 43_200.0,
    api_key: ApiKeyOpt = None,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Needle in a haystack over a grid of prompt lengths x depths, scored by exact match.

    Generated needles (a random name keyed to a random number or UUID) with distractors, placed at a line boundary at the requested token depth, measured on the final prompt. Every JSONL line holds the recipe that rebuilds its prompt exactly; an interrupted run resumes.
    """
    from glmctl._cli.output import Output
    from glmctl.errors import UsageError
    from glmctl.evals import corpus, needle_run
    from glmctl.evals import needle as nd
    from glmctl.evals.results import check_writable
    from glmctl.evals.target import open_server
    from glmctl.evals.tokenizer import open_tokenizer
    from glmctl.evals.transport import Deadline, resolve_api_key

    output = Output.from_flags(json_, quiet)
    check_writable(out)
    if png is not None:
        check_writable(png, "--png")
    if kind not in ("number", "uuid"):
        raise UsageError(f"--kind must be number or uuid, not {kind!r}")
    if api not in ("chat", "completion"):
        raise UsageError(f"--api must be chat or completion, not {api!r}")
    grid_lengths, grid_depths = nd.parse_lengths(lengths), nd.parse_depths(depths)
    kwargs = _template_kwargs(template_kwargs)
    source = corpus.load_text(haystack)
    with open_server(url, profile, model=model, checkpoint=checkpoint, accept=accept_license,
                     timeout=timeout, note=output.note, api_key=resolve_api_key(api_key),
                     deadline=Deadline(deadline, "glmctl eval needle")) as server, \
            output.progress(unit="cells") as bar:
        tokenizer = open_tokenizer(server, tokenizer_dir)
        task = bar.add_task("needle grid", total=len(grid_lengths) * len(grid_depths))
        report = needle_run.run_grid(
            server, tokenizer, source, lengths=grid_lengths, depths=grid_depths, out=out, seed=seed,
            kind=kind, api=api, distractors=distractors, template_kwargs=kwargs,  # type: ignore[arg-type]
            max_answer_tokens=max_answer_tokens, restart=restart, dry_run=dry_run,
            on_cell=lambda cell, done, total: bar.update(task, completed=done))
    if baseline is not None:
        report.comparison = needle_run.compare(report.cells, baseline)
    if not dry_run:
        png_path = png or out.with_suffix(".png")
        if needle_run.write_heatmap(report, png_path):
            report.heatmap = str(png_path)
        else:
            output.warn("matplotlib is not installed: no heatmap (pip install 'glmctl[plot]')")
    output.result(report, lambda console: _render_needle(console, report))


def _render_needle(console, report) -> None:
    from rich.markup import escape as e
    from rich.table import Table

    s = report.settings
    console.print(f"[bold]Needle in a haystack[/bold]: {e(s.server.model)} at {e(s.server.url)}"
                  + ("  [yellow](dry run: nothing asked)[/yellow]" if report.dry_run else ""))
    console.print(f"  needles: {s.needle_kind} keyed by a random name, {s.distractors} distractor(s), seed {s.seed}; "
                  f"api {s.api}; tokenizer {e(s.tokenizer)}")
    cells = {(c.length, c.depth_percent): c for c in report.cells}
    table = Table(title="found (actual depth %)", header_style="bold")
    table.add_column("prompt tokens", justify="right")
    for d in report.depths:
        table.add_column(f"{d:g}%", justify="center")
    for length in report.lengths:
        row = []
        for d in report.depths:
            c = cells[(length, d)]
            mark = ("[dim]planned[/dim]" if report.dry_run else "[green]found[/green]" if c.correct
                    else "[yellow]distractor[/yellow]" if c.distractor else "[red]missed[/red]")
            row.append(f"{mark} ({c.actual_depth_percent:.1f})")
        table.add_row(f"{length:,}", *row)
    console.print(table)
    if not report.dry_run:
        console.print(f"  found {sum(c.correct for c in report.cells)} of {len(report.cells)} "
                      f"({report.accuracy:.0%}); {report.cells_run} cell(s) run, {report.cells_resumed} resumed")
    console.print(f"  results: {report.results_file}" + (f"; heatmap: {report.heatmap}" if report.heatmap else ""),
                  markup=False)
    if report.cells_cut_off and not report.dry_run:
        console.print(f"  [yellow]{report.cells_cut_off} missed cell(s) stopped at --max-answer-tokens "
                      f"{s.max_answer_tokens}[/yellow] without the value: if the model reasons before it answers, "
                      "raise it, or pass --template-kwargs '{\"enable_thinking\": false}' where its template has "
                      "that switch", highlight=False)
    if report.comparison is not None:
        cmp = report.comparison
        console.print(f"  vs baseline {e(cmp.baseline_file)} ({cmp.baseline_accuracy:.0%} found): "
                      f"{len(cmp.changed)} of {cmp.cells_compared} cell(s) changed")
        for ch in cmp.changed:
            console.print(f"    {ch.length:,} @ {ch.depth_percent:g}%: "
                          f"{'found' if ch.baseline_correct else 'missed'} -> {'found' if ch.correct else 'missed'}")


needle.epilog = examples(
    "glmctl eval needle --url http://127.0.0.1:8000",
    "glmctl eval needle --url http://127.0.0.1:8000 --lengths 64k,128k,250k --depths 0,25,50,75,100 --kind uuid",
    "glmctl eval needle --url http://127.0.0.1:8000 --dry-run --lengths 8k",
    "glmctl eval needle --url http://127.0.0.1:8000 --template-kwargs '{\"enable_thinking\": false}'",
)

app.command(name="perplexity", epilog=perplexity.epilog)(perplexity)
app.command(name="needle", epilog=needle.epilog)(needle)

# The quality checks beyond perplexity live in modules of their own.

app.command(name="kld", epilog=eval_kld.kld.epilog)(eval_kld.kld)
app.command(name="humaneval", epilog=eval_humaneval.humaneval.epilog)(eval_humaneval.humaneval)
