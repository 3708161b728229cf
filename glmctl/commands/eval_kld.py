"""`glmctl eval kld`: KL divergence of a build's token distributions from the exact model's."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from glmctl._cli.options import (
    BaselineOpt,
    JsonOpt,
    QuietOpt,
    RequestTimeoutOpt,
    ServedModelOpt,
    TokenizerOpt,
    examples,
)


def kld(
    paths: Annotated[list[Path] | None, typer.Argument(
        help="Text files or directories to score (default: perplexity's slice of Python's stdlib source).")] = None,
    url: Annotated[str | None, typer.Option(
        "--url", help="The build under test (or, with --save-reference alone, the exact model).")] = None,
    model: ServedModelOpt = None,
    reference_url: Annotated[str | None, typer.Option(
        help="A second server with the exact (reference) model.")] = None,
    reference_model: Annotated[str | None, typer.Option(
        help="Served model name at --reference-url (default: the only one).")] = None,
    reference: Annotated[Path | None, typer.Option(
        help="A reference table saved earlier with --save-reference, instead of --reference-url.")] = None,
    save_reference: Annotated[Path | None, typer.Option(
        help="Save the reference's top-K table here (resumed if it exists). With --url alone: score "
             "--url as the reference and only save.")] = None,
    top_k: Annotated[int, typer.Option(
        help="Alternatives per position, within the server's --max-logprobs (vLLM's default: 20).")] = 20,
    tokenizer_dir: TokenizerOpt = None,
    window: Annotated[int | None, typer.Option(help="Text tokens per request (default 4,096, within max_model_len).")] = None,
    stride: Annotated[int | None, typer.Option(help="New tokens scored per window (default: half the window).")] = None,
    bos: Annotated[str, typer.Option(help="What every window starts with (never scored), as for perplexity: "
                                          "auto, none, or a literal.")] = "auto",
    max_tokens: Annotated[int, typer.Option(help="Score the text's first N tokens.")] = 30_000,
    out: Annotated[Path, typer.Option("--out", "-o", help="Results JSONL (resumed if it exists).")] = Path("kld.jsonl"),
    png: Annotated[Path | None, typer.Option(help="Histogram PNG (default: next to --out; needs matplotlib).")] = None,
    restart: Annotated[bool, typer.Option(help="Start --out (and --save-reference) over instead of resuming.")] = False,
    baseline: BaselineOpt = None,
    timeout: RequestTimeoutOpt = 600.0,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """KL divergence of the build's next-token distributions from the exact model's, per token.

    Over perplexity's tokens and windows, from vLLM's top-K prompt log-probabilities of both: KL(reference || build) over the union of the two top-K sets plus one bucket for the rest, a lower bound of the full-vocabulary KL; same-top-token %, delta-p, and the perplexity of both with the paired ln-ratio. With --baseline (an earlier --out): the paired change of mean KLD.
    """
    from glmctl._cli.output import Output
    from glmctl.errors import UsageError
    from glmctl.evals import corpus
    from glmctl.evals import kld as kl
    from glmctl.evals.client import OpenAIServer
    from glmctl.evals.tokenizer import ServerTokenizer, open_tokenizer

    output = Output.from_flags(json_, quiet)
    if url is None:
        raise UsageError("pass --url: the server to check (or, with --save-reference, the exact model)")
    if reference is not None and reference_url is not None:
        raise UsageError("pass one of --reference-url (a server) and --reference (a saved table), not both")
    if reference is not None and save_reference is not None:
        raise UsageError("--save-reference saves a reference fetched from a server; --reference reads one")
    if reference is None and reference_url is None and save_reference is None:
        raise UsageError("nothing to compare against", hint="pass --reference-url URL, --reference FILE, "
                                                            "or --save-reference FILE to save --url as one")
    source = corpus.load_text(paths)
    with OpenAIServer(url, model, timeout=timeout) as server, output.progress(unit="tokens") as bar:
        server.connect()
        tokenizer = open_tokenizer(server, tokenizer_dir)
        task = bar.add_task("scoring", total=None)
        progress = {"on_start": lambda n: bar.update(task, total=n), "on_window": lambda n: bar.advance(task, n)}
        common = {"top_k": top_k, "window": window, "stride": stride, "bos": bos, "max_tokens": max_tokens,
                  "restart": restart}
        if reference is None and reference_url is None:
            ref = kl.save_reference(server, tokenizer, source, path=save_reference, **common, **progress)
            output.result({"kind": "kld-reference", "file": str(save_reference), "server": server.base_url,
                           "model": server.model_id, "windows": len(ref.windows), "top_k": top_k},
                          lambda console: console.print(
                              f"saved the top-{top_k} reference of {server.model_id} ({len(ref.windows)} "
                              f"window(s)) to {save_reference}", markup=False))
            return
        if reference_url is not None:
            with OpenAIServer(reference_url, reference_model, timeout=timeout) as ref_server:
                ref_server.connect()
                ref_tok = ServerTokenizer(ref_server) if tokenizer_dir is None else None
                report = kl.run(server, tokenizer, source, out=out, reference_server=ref_server,
                                save_reference=save_reference, reference_tokenizer=ref_tok, **common, **progress)
        else:
            report = kl.run(server, tokenizer, source, out=out, reference_file=reference, **common, **progress)
    if baseline is not None:
        report.comparison = kl.compare(report, baseline)
    png_path = png or out.with_suffix(".png")
    if kl.write_histogram(report, png_path):
        report.histogram = str(png_path)
    else:
        output.warn("matplotlib is not installed: no histogram (pip install 'glmctl[plot]')")
    output.result(report, lambda console: _render(console, report))


def _render(console, r) -> None:
    from rich.markup import escape as e
    from rich.table import Table

    s = r.settings
    ref = s.reference
    where = f"{ref.server.url}" if ref.source == "server" else f"saved table {ref.file}"
    console.print(f"[bold]KL divergence[/bold] of {e(s.build.model)} at {e(s.build.url)} from "
                  f"{e(ref.server.model)} ({e(where)})")
    console.print(f"  text:   {r.positions:,} scored tokens of {s.text.origin}, sha256 {s.text.sha256[:12]}; "
                  f"tokenizer {e(s.tokenizer)}")
    console.print(f"  window: {s.windowing.windows} x {s.windowing.window:,} tokens, stride {s.windowing.stride:,}; "
                  f"top {s.top_k} alternatives per position")
    table = Table(show_header=True, header_style="bold", title="per-token KLD, nats (a lower bound)")
    for col in ("mean", "± stderr", "median", "90%", "95%", "99%", "99.9%", "max"):
        table.add_column(col, justify="right")
    k = r.kld
    table.add_row(f"{k.mean:.6f}", f"{k.stderr:.6f}", f"{k.median:.6f}",
                  *(f"{k.percentiles[q]:.5f}" for q in ("90", "95", "99", "99.9")), f"{k.max:.4f}")
    console.print(table)
    dp = r.delta_p
    console.print(f"  same top token: {r.same_top_percent:.2f}%   p_build(reference's top token): "
                  f"{_range(*r.p_build_of_reference_top)}")
    console.print(f"  delta-p (build - reference, actual token): mean {100 * dp.mean:+.3f}% ± {100 * (dp.stderr or 0):.3f}%, "
                  f"RMS {100 * (dp.rms or 0):.3f}%, 1/5/50/95/99th pct "
                  + "/".join(f"{100 * dp.percentiles[q]:+.2f}" for q in ("1", "5", "50", "95", "99"))
                  + f"%, min {100 * dp.min:+.2f}%, max {100 * dp.max:+.2f}%")
    lo, hi = r.ln_ratio_ci95
    console.print(f"  perplexity: reference {r.perplexity_reference:.4f}, build {r.perplexity_build:.4f}, ratio "
                  f"{r.perplexity_ratio:.5f}; ln ratio {r.ln_ratio:+.5f} (95% CI {lo:+.5f} .. {hi:+.5f})")
    console.print(f"  [dim]bound: {e(r.bound)}[/dim]")
    console.print(f"  [dim]stderr: {e(r.stderr_method)}; {r.windows_run} window(s) run, {r.windows_resumed} resumed[/dim]")
    if r.comparison is not None:
        c = r.comparison
        console.print(f"  [bold]vs baseline[/bold] {e(c.baseline_file)} ({e(c.baseline_build)}, mean KLD "
                      f"{c.baseline_mean_kld:.6f}): {c.difference:+.6f} nats (95% CI {c.ci95_low:+.6f} .. "
                      f"{c.ci95_high:+.6f}) over {c.positions_paired:,} paired tokens")
    console.print(f"  results: {r.results_file}" + (f"; histogram: {r.histogram}" if r.histogram else ""),
                  markup=False)


def _range(low: float, high: float) -> str:
    return f"{low:.4f}" if abs(high - low) < 5e-5 else f"{low:.4f} .. {high:.4f} (unlisted by the build: 0 .. its cap)"


kld.epilog = examples(
    "glmctl eval kld --url http://build:8000 --reference-url http://exact:8000",
    "glmctl eval kld --url http://exact:8000 --save-reference ref.jsonl",
    "glmctl eval kld --url http://build:8000 --reference ref.jsonl --out kld-4bit.jsonl",
    "glmctl eval kld --url http://build2:8000 --reference ref.jsonl --baseline kld-4bit.jsonl",
)
