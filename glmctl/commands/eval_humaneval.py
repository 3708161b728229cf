"""`glmctl eval humaneval`: pass@1 (and pass@k) on the 164 HumanEval problems, executed sandboxed."""

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
    UrlOpt,
    examples,
)


def humaneval(
    url: UrlOpt = None,
    model: ServedModelOpt = None,
    samples: Annotated[int, typer.Option(help="Completions per problem (pass@k for k = 1, 10, 100 up to it).")] = 1,
    temperature: Annotated[float, typer.Option(help="Sampling temperature (0: greedy; needed > 0 for --samples > 1).")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling with --temperature > 0.")] = 0.95,
    max_tokens: Annotated[int, typer.Option(help="Tokens per completion.")] = 512,
    concurrency: Annotated[int, typer.Option(help="Problems in flight at once (requests and test runs).")] = 4,
    exec_timeout: Annotated[float, typer.Option(
        "--exec-timeout", help="Wall-clock seconds a program may run before its process group is killed.")] = 10.0,
    memory_mib: Annotated[int, typer.Option(help="Address-space limit of each program, MiB.")] = 1024,
    problems: Annotated[str | None, typer.Option(
        help="Only these task numbers, e.g. 0-19,42 (default: all 164).")] = None,
    seed: Annotated[int, typer.Option(help="Sampling seed (per sample: seed + 1000 x task number + sample).")] = 0,
    out: Annotated[Path, typer.Option("--out", "-o", help="Per-sample results JSONL (resumed if it exists).")] = Path("humaneval.jsonl"),
    restart: Annotated[bool, typer.Option(help="Start --out over instead of resuming it.")] = False,
    baseline: BaselineOpt = None,
    timeout: RequestTimeoutOpt = 600.0,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Functional correctness on HumanEval: completions from the server, tests run in a sandbox.

    Each prompt goes to /v1/completions with the standard stop sequences; each program (prompt + completion + tests) runs in its own process, session and temporary directory under a wall-clock deadline and resource limits, never in glmctl. pass@1 with a Wilson 95% interval; with --baseline (an earlier --out, or a --json report): the paired difference, McNemar's exact test and the problems that flipped.
    """
    from glmctl._cli.output import Output
    from glmctl.errors import UsageError
    from glmctl.evals import humaneval as he
    from glmctl.evals import sandbox
    from glmctl.evals.client import OpenAIServer

    output = Output.from_flags(json_, quiet)
    if url is None:
        raise UsageError("pass --url: the OpenAI-compatible server to ask", hint="e.g. --url http://127.0.0.1:8000")
    if memory_mib < 64:
        raise UsageError(f"--memory-mib {memory_mib} is below what Python itself needs (64 MiB)")
    limits = sandbox.Limits(wall_s=exec_timeout, memory_bytes=memory_mib << 20)
    with OpenAIServer(url, model, timeout=timeout) as server, output.progress(unit="samples") as bar:
        server.connect()
        task = bar.add_task("humaneval", total=None)
        report = he.run(server, out=out, problems_spec=problems, samples=samples, temperature=temperature,
                        top_p=top_p, max_tokens=max_tokens, concurrency=concurrency, timeout_s=exec_timeout,
                        seed=seed, restart=restart, limits=limits,
                        on_sample=lambda done, total: bar.update(task, completed=done, total=total))
    if baseline is not None:
        report.comparison = he.compare(report, baseline)
    output.result(report, lambda console: _render(console, report))


def _render(console, r) -> None:
    from rich.markup import escape as e
    from rich.table import Table

    s = r.settings
    console.print(f"[bold]HumanEval[/bold] ({e(s.dataset)}): {e(s.server.model)} at {e(s.server.url)}")
    sampling = "greedy" if s.temperature == 0 else f"temperature {s.temperature:g}, top_p {s.top_p:g}, seed {s.seed}"
    console.print(f"  {r.problems} problem(s) x {s.samples} sample(s), {sampling}, max {s.max_tokens} tokens; "
                  f"programs sandboxed ({s.limits['wall_s']:g} s wall, {s.limits['memory_bytes'] >> 20} MiB)")
    table = Table(show_header=True, header_style="bold")
    table.add_column("pass@1", justify="right")
    table.add_column("95% CI", justify="right")
    for k in r.pass_at_k:
        if k != "1":
            table.add_column(f"pass@{k}", justify="right")
    table.add_column("problems passed", justify="right")
    lo, hi = r.pass_at_1_ci95
    table.add_row(f"{100 * r.pass_at_1:.1f}%", f"{100 * lo:.1f} .. {100 * hi:.1f}%",
                  *(f"{100 * v:.1f}%" for k, v in r.pass_at_k.items() if k != "1"),
                  f"{r.problems_passed} / {r.problems}")
    console.print(table)
    console.print(f"  [dim]CI: {e(r.ci_method)}; outcomes: "
                  + ", ".join(f"{k} {v}" for k, v in sorted(r.outcomes.items()))
                  + f"; {r.samples_run} sample(s) run, {r.samples_resumed} resumed[/dim]")
    if r.comparison is not None:
        c = r.comparison
        lo, hi = c.ci95_points
        console.print(f"  [bold]vs baseline[/bold] {e(c.baseline_file)} ({e(c.baseline_model)}, pass@1 "
                      f"{100 * c.baseline_pass_at_1:.1f}%): {c.difference_points:+.1f} points (95% CI {lo:+.1f} .. "
                      f"{hi:+.1f}) over {c.problems_paired} paired problems; McNemar exact p = {c.mcnemar_p:.4g} "
                      f"({c.only_this_run_passed} passed only here, {c.only_baseline_passed} only in the baseline)")
        if c.newly_passing:
            console.print(f"    now passing: {', '.join(c.newly_passing)}", markup=False)
        if c.newly_failing:
            console.print(f"    now failing: {', '.join(c.newly_failing)}", markup=False)
    console.print(f"  results: {r.results_file}", markup=False)


humaneval.epilog = examples(
    "glmctl eval humaneval --url http://127.0.0.1:8000 --out he-exact.jsonl",
    "glmctl eval humaneval --url http://127.0.0.1:8001 --out he-4bit.jsonl --baseline he-exact.jsonl",
    "glmctl eval humaneval --url http://127.0.0.1:8000 --samples 10 --temperature 0.8 --out he-p10.jsonl",
    "glmctl eval humaneval --url http://127.0.0.1:8000 --problems 0-19 --out he-quick.jsonl",
)
