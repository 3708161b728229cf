"""`glmctl bench`: concurrent long-context sessions; steady-state decode from vLLM's own counter."""

from __future__ import annotations

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


def bench(
    url: UrlOpt = None,
    profile: ProfileOpt = None,
    checkpoint: CheckpointOpt = None,
    accept_license: AcceptLicenseOpt = None,
    model: ServedModelOpt = None,
    tokenizer_dir: TokenizerOpt = None,
    sessions: Annotated[str | None, typer.Option(
        help="Concurrent sessions (default 8; with --sweep a list, default 1,2,4,8).")] = None,
    context: Annotated[str | None, typer.Option(
        help="Prompt tokens per session, k = 1,000 (default 22k; with --sweep a list, default the "
             "report's 22k,64k,128k,240k that fit).")] = None,
    output_tokens: Annotated[int, typer.Option(min=2, help="Tokens each session generates a turn (EOS ignored).")] = 512,
    turns: Annotated[int, typer.Option(min=1, help="Turns per session: each later turn resends the conversation "
                                       "so far plus --turn-tokens new ones (a coding session's shape).")] = 1,
    turn_tokens: Annotated[int, typer.Option(min=1, help="New prompt tokens each later turn adds.")] = 256,
    prompts: Annotated[Path | None, typer.Option(
        help="A directory of real prompts (text files), cycled to the context length.")] = None,
    sweep: Annotated[bool, typer.Option(help="Run every sessions x context cell; print the scaling table.")] = False,
    poll_interval: Annotated[float, typer.Option(min=0.05, max=60, help="Seconds between /metrics samples.")] = 0.5,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write the result JSON here (a later --baseline).")] = None,
    baseline: BaselineOpt = None,
    timeout: RequestTimeoutOpt = 3600.0,
    deadline: DeadlineOpt = 43_200.0,
    api_key: ApiKeyOpt = None,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """N concurrent sessions at a context length: TTFT per session and steady-state decode tok/s.

    Steady decode is the rate of vllm:generation_tokens_total while all N sessions decode and nothing else happens (no waiting request, no prefill, no preemption), checked against the tokens the clients counted in the same window.

    Every request carries its session's id in the X-Session-ID header (vllm-router's session key: behind `glmctl fleet` a session's turns stay on one node) and X-Request-Id SESSION-tTURN (vLLM's request id). Behind vllm-router the counters are summed over the nodes it routes to. With --turns, the steady window lies in the first turn.

    Exit 0 only when every cell measured steady decode; 1 when a session failed (each failed session is named; nothing is written), no cell measured it (nothing is written), or some cells did not (the result is written, each such cell with its reason).
    """
    from glmctl._cli.output import Output
    from glmctl.errors import UsageError
    from glmctl.evals import corpus
    from glmctl.evals import serving_bench as b
    from glmctl.evals.results import check_writable, load_result, save_result
    from glmctl.evals.target import open_server
    from glmctl.evals.tokenizer import open_tokenizer
    from glmctl.evals.transport import Deadline, resolve_api_key

    output = Output.from_flags(json_, quiet)
    check_writable(out)
    session_list = b.parse_counts(sessions, "sessions") if sessions else None
    context_list = b.parse_counts(context, "context") if context else None
    if not sweep and ((session_list and len(session_list) > 1) or (context_list and len(context_list) > 1)):
        raise UsageError("several --sessions or --context values need --sweep", hint="add --sweep to run the grid")
    base = load_result(baseline, b.BenchResult, "bench") if baseline else None
    prompt_files = corpus.read_prompt_dir(prompts) if prompts else None
    with open_server(url, profile, model=model, checkpoint=checkpoint, accept=accept_license,
                     timeout=timeout, note=output.note, api_key=resolve_api_key(api_key),
                     deadline=Deadline(deadline, "glmctl bench")) as server, \
            output.progress(unit="tokens") as bar:
        tokenizer = open_tokenizer(server, tokenizer_dir)
        source = None if prompt_files else corpus.stdlib_text()
        prompt_source = b.PromptSource(tokenizer, source, prompt_files)
        if sweep:
            session_list = session_list or list(b.SWEEP_SESSIONS)
            context_list = context_list or b.sweep_contexts(server, output_tokens, turns, turn_tokens)
        session_list, context_list = session_list or [8], context_list or [22_000]
        task = bar.add_task("bench", total=None)

        def on_cell(n: int, ctx: int) -> None:
            bar.update(task, description=f"{n} x {ctx:,} tokens", completed=0, total=n * output_tokens * turns)

        result = b.run_bench(server, tokenizer, prompt_source, sessions=session_list, contexts=context_list,
                             output_tokens=output_tokens, poll_interval=poll_interval, on_cell=on_cell,
                             on_tokens=lambda n: bar.advance(task, n), turns=turns,
                             turn_tokens=turn_tokens if turns > 1 else 0)
    if base is not None:
        result.comparison, result.baseline_file = b.compare(result, base), str(baseline)
    if out is not None:
        save_result(out, result)
    output.result(result, lambda console: _render(console, result, out))
    unmeasured = b.unmeasured_cells(result)
    if unmeasured:
        output.warn(f"{len(unmeasured)} of {len(result.cells)} cell(s) measured no steady decode "
                    f"(first: {unmeasured[0].sessions} x {unmeasured[0].context_tokens:,}: "
                    f"{unmeasured[0].no_steady_reason})")
        raise typer.Exit(1)


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "—" if v is None else format(v, spec)


def _render(console, r, out: Path | None) -> None:
    from rich.markup import escape as e
    from rich.table import Table

    console.print(f"[bold]Bench[/bold]: {e(r.server.model)} at {e(r.server.url)}; prompts: {e(r.prompt_source)}")
    if r.nodes:
        console.print(f"behind vllm-router: {len(r.nodes)} node(s), counters summed over "
                      f"{e(', '.join(r.nodes))}")
    for c in r.cells:
        turns = (f" in {c.turns} turns (each later turn adds {c.turn_tokens:,} prompt tokens; the steady window "
                 "is in the first)") if c.turns > 1 else ""
        console.print(f"\n[bold]{c.sessions} session(s) x {c.context_tokens:,} prompt tokens[/bold], "
                      f"{c.output_tokens} output tokens each{turns} (EOS ignored)")
        if c.steady is not None:
            s = c.steady
            console.print(f"  steady decode: [bold]{s.decode_tok_s:.1f} tok/s[/bold] "
                          f"({s.per_session_tok_s:.1f} per session) over {s.seconds:.1f} s, {s.samples} samples "
                          f"[dim](clients counted {s.client_tok_s:.1f} tok/s in the same window)[/dim]")
            console.print(f"  KV usage {100 * s.kv_usage_mean:.1f}% (max {100 * s.kv_usage_max:.1f}%), "
                          f"preemptions {c.preemptions}")
        else:
            console.print(f"  [yellow]no steady window[/yellow]: {e(c.no_steady_reason or '')}")
        for url, t in c.lost_nodes.items():
            console.print(f"  [yellow]node {e(url)} stopped answering /metrics at {t:.1f} s[/yellow] "
                          "(the counters after that are the other nodes')")
        console.print(f"  averaged output {c.averaged_output_tok_s:.1f} tok/s over {c.wall_s:.1f} s "
                      "[dim](prefill and drain included: what `vllm bench serve` reports)[/dim]")
        table = Table(header_style="bold", show_edge=False)
        columns = ["session", "TTFT s", *(["later turns' TTFT s"] if c.turns > 1 else []), "tokens",
                   "decode tok/s", "in window tok/s", "end"]
        for col in columns:
            table.add_column(col, justify="right")
        for d in sorted(c.sessions_detail, key=lambda d: (d.ttft_s is None, d.ttft_s)):
            later = [", ".join(f"{t:.2f}" for t in d.turn_ttft_s[1:]) or "—"] if c.turns > 1 else []
            table.add_row(str(d.index + 1), _fmt(d.ttft_s, ".2f"), *later, str(d.output_tokens),
                          _fmt(d.decode_tok_s), _fmt(d.window_tok_s), e(d.error or d.finish_reason or ""))
        console.print(table)
    if len(r.cells) > 1:
        console.print()
        console.print(scaling_table(r))
    if r.comparison:
        console.print(f"\nvs baseline {r.baseline_file}:", markup=False)
        for ch in r.comparison:
            console.print(f"  {ch.sessions} x {ch.context_tokens:,}: {_fmt(ch.baseline_tok_s)} -> {_fmt(ch.tok_s)} tok/s"
                          + (f" ({ch.change_percent:+.1f}%)" if ch.change_percent is not None else ""))
    if out is not None:
        console.print(f"\nresult: {out}", markup=False)


def scaling_table(r):
    """The report's shape: sessions down, context across, steady decode tok/s in the cells."""
    from rich.table import Table

    contexts = sorted({c.context_tokens for c in r.cells})
    sessions = sorted({c.sessions for c in r.cells})
    cells = {(c.sessions, c.context_tokens): c for c in r.cells}
    table = Table(title="steady-state decode, tok/s (all sessions combined)", header_style="bold")
    table.add_column("sessions", justify="right")
    for ctx in contexts:
        table.add_column(f"~{ctx / 1000:g}k ctx", justify="right")
    for n in sessions:
        row = []
        for ctx in contexts:
            c = cells.get((n, ctx))
            row.append("" if c is None else _fmt(c.steady.decode_tok_s if c.steady else None, ".0f"))
        table.add_row(str(n), *row)
    return table


bench.epilog = examples(
    "glmctl bench --url http://127.0.0.1:8000 --sessions 8 --context 64k --out bench-64k.json",
    "glmctl bench --url http://127.0.0.1:8000 --sweep --sessions 1,4,8 --context 22k,64k,240k",
    "glmctl bench --url http://127.0.0.1:8000 --prompts ~/agent-prompts --context 128k --baseline bench-64k.json",
    "glmctl bench --url http://router:8000 --sessions 16 --context 64k --turns 4 --output-tokens 256",
)
