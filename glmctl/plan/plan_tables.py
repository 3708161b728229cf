"""Rich tables for `glmctl plan` (human mode; `--json` prints the same data as a document)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from glmctl.plan.capacity import CapacityPlan
from glmctl.plan.field_report import ReportReproduction
from glmctl.plan.fleet_capacity import FleetPlan

GIB = 1 << 30
_SECTIONS = {"weights": "weights", "drafter": "drafter", "reserve": "reserved"}


def _gib(n: float) -> str:
    return f"{n / GIB:,.3f}"


def _sizes(sizes: list[int]) -> str:
    if not sizes:
        return "none (eager)"
    return ", ".join(map(str, sizes)) if len(sizes) <= 8 else f"{len(sizes)} sizes, {sizes[0]}..{sizes[-1]}"


def render_plan(plan: CapacityPlan, console: Console) -> None:
    s, node, lay = plan.setup, plan.node, plan.kv_layout
    console.print(
        f"[bold]{plan.model}[/bold] on {node.name} ({node.device_memory_bytes / GIB:.2f} GiB "
        f"{'each' if node.platform == 'cuda' else 'host RAM'}: {node.memory_source}) · TP {s.tensor_parallel_size} · KV {s.kv_cache_dtype} · "
        f"speculative {s.speculative} · {s.max_model_len:,} tokens x {s.max_num_seqs} slots"
    )
    device = "GPU" if node.platform == "cuda" else "CPU node (host RAM)"
    table = Table(title=f"Memory per {device} (predicted)", title_justify="left")
    table.add_column("part")
    table.add_column("item")
    table.add_column("format / basis")
    table.add_column("GiB", justify="right")
    last = None
    for line in plan.memory:
        if line.section == "kv":
            continue
        table.add_row(_SECTIONS[line.section] if line.section != last else "", line.label, line.basis,
                      _gib(line.bytes))
        last = line.section
    if node.kv_cache_bytes is None:
        budget = ("vLLM budget", f"{s.gpu_memory_utilization} x {node.device_memory_bytes / GIB:.2f} GiB")
    else:
        budget = ("fixed KV space", "--kv-cache-gib" if node.platform == "cuda" else node.memory_source)
    table.add_row("budget", f"[bold]{budget[0]}[/bold]", budget[1], f"[bold]{_gib(plan.budget_bytes)}[/bold]",
                  end_section=True)
    table.add_row("KV pool", "[bold]left for KV blocks[/bold]", "result", f"[bold]{_gib(plan.kv_pool_bytes)}[/bold]")
    for line in plan.memory:
        if line.section == "kv":
            table.add_row("", f"  of which {line.label}", line.basis, _gib(line.bytes))
    console.print(table)

    kv = Table(title=f"KV cache per {device} (vLLM 0.30 layout: block {lay.block_size} tokens)",
               title_justify="left")
    kv.add_column("component")
    kv.add_column("layers", justify="right")
    kv.add_column("bytes/token", justify="right")
    for item in plan.kv_per_token:
        kv.add_row(item.label, str(item.layers), f"{item.bytes_per_token:,.1f}")
    kv.add_row("[bold]effective[/bold]", "", f"[bold]{plan.kv_bytes_per_token:,.1f}[/bold]")
    console.print(kv)
    console.print(
        f"pages: MLA {lay.mla_page_bytes:,} B, indexer {lay.indexer_page_bytes:,} B, tail {lay.tail_page_bytes:,} B, "
        f"KDA state {lay.kda_state_bytes:,} B (padded to the MLA page); one block = {lay.bytes_per_block:,} B; "
        f"{lay.num_kda_groups} KDA groups x {lay.kda_blocks_per_group} blocks + {lay.tail_blocks} tail block "
        f"per request ({lay.mamba_cache_mode} mode)"
    )
    if plan.fits:
        console.print(
            f"[bold green]KV tokens: {plan.kv_tokens:,}[/bold green] ({plan.num_blocks:,} blocks, "
            f"{plan.blocks_per_request} per request) · max concurrency at {s.max_model_len:,} tokens: "
            f"{plan.max_concurrency:.2f} ({plan.concurrency_at_max_model_len} of {s.max_num_seqs} slots) · "
            f"sessions that fit: [bold]{plan.sessions_that_fit}[/bold] "
            f"(tokens // {s.session_tokens:,}, capped at {s.max_num_seqs} slots)"
        )
    else:
        console.print(f"[bold red]{plan.reason}[/bold red]")
    c = node.constants
    if node.platform == "cuda":
        console.print(
            f"[dim]node constants ({c.source}): non-torch runtime {c.non_torch_runtime_gib} GiB, CUDA graphs "
            f"{c.cudagraph_first_mib:g} MiB first + {c.cudagraph_per_graph_mib:g} MiB each; capture sizes "
            f"{_sizes(s.cudagraph_capture_sizes)}; batched tokens {s.max_num_batched_tokens:,}[/dim]"
        )
    for note in plan.notes:
        console.print(f"[dim]note: {note}[/dim]")


def render_fleet(fleet: FleetPlan, console: Console) -> None:
    """One node's plan, then the fleet of N such nodes and what the loss of one leaves."""
    render_plan(fleet.node, console)
    console.print()
    loss = fleet.after_loss
    table = Table(title=f"Fleet: {fleet.nodes} node(s) like this one behind vllm-router, each session on one node "
                        f"(sessions of {fleet.session_tokens:,} tokens)", title_justify="left")
    table.add_column("")
    table.add_column("per node", justify="right")
    table.add_column(f"fleet of {fleet.nodes}", justify="right")
    table.add_column(f"after losing one ({loss.nodes_left} left)", justify="right")
    table.add_row("sessions", f"{fleet.sessions_per_node:,}", f"[bold]{fleet.fleet_sessions:,}[/bold]", f"{loss.sessions:,}")
    table.add_row("KV tokens", f"{fleet.kv_tokens_per_node:,}", f"{fleet.fleet_kv_tokens:,}", f"{loss.kv_tokens:,}")
    console.print(table)
    if not fleet.fits:
        console.print(f"[bold red]the node does not fit ({fleet.node.reason}): the fleet holds no session[/bold red]")
    console.print(f"sessions that stay resident through the loss of any one node: [bold]{loss.resilient_sessions:,}"
                  f"[/bold]; a full node's {loss.displaced_at_full_load:,} sessions are displaced when it goes")
    for note in fleet.notes:
        console.print(f"[dim]note: {note}[/dim]")


def render_report(rep: ReportReproduction, console: Console) -> None:
    table = Table(title="KV pools of the report's 8x L40 node: planner predictions vs the report's measurements",
                  title_justify="left", caption=f"GiB per GPU; source: {rep.source}", caption_justify="left")
    table.add_column("#", no_wrap=True)
    table.add_column("change", min_width=16)
    for name in ("predicted\ntokens", "reported\ntokens", "resid.", "sessions\npred/rep",
                 "experts\nGiB"):
        table.add_column(name, justify="right", no_wrap=True)
    for r in rep.rows:
        ok = abs(r.residual_pct) <= 5.0
        table.add_row(r.step, r.change, f"{r.predicted_tokens:,}", f"{r.reported_tokens:,}",
                      f"[{'green' if ok else 'red'}]{r.residual_pct:+.2f}%[/]",
                      f"{r.predicted_sessions}/{r.reported_sessions}", f"{r.expert_weights_gib:.2f}")
    console.print(table)
    c = rep.node.constants
    console.print(
        f"one set of node constants for all rows: {rep.node.name}, {rep.node.device_memory_bytes / GIB:.2f} GiB per "
        f"GPU ({rep.node.memory_source}); non-torch runtime {c.non_torch_runtime_gib} GiB; CUDA graphs "
        f"{c.cudagraph_first_mib:g} MiB first + {c.cudagraph_per_graph_mib:g} MiB each ({c.source})"
    )
    for line in rep.setup_assumptions:
        console.print(f"assumed: {line}")
    for line in rep.sensitivity:
        console.print(f"[dim]{line}[/dim]")
    console.print(
        "predicted = this planner's model; reported = the report's measured values (vLLM's logged KV cache size). "
        f"Largest |residual|: {rep.max_abs_residual_pct:.2f}%"
    )


def render_prediction(pred, console: Console) -> None:
    """The node prediction in the report's scaling-table layout: sessions x context per method,
    each cell the predicted tok/s beside the report's, the ratio and what dominates the step."""
    from glmctl.plan.prediction.node_records import CONTEXT_LABELS, REPORT_DECODE_CELLS

    console.print(f"[bold]8x {pred.target.name} decode, predicted[/bold] from {pred.source} "
                  f"({pred.stand_in.name} rank step; {pred.stand_in.source})")
    for spec in sorted({c.speculative for c in pred.cells}, key=lambda s: (s != "mtp:3", s)):
        table = Table(title=f"combined tok/s, {spec}: predicted (pred; basis per cell below) | report (rep, "
                            "measured on 8x L40, 4-bit experts)", title_justify="left")
        table.add_column("sessions", justify="right")
        for label in CONTEXT_LABELS:
            table.add_column(f"~{label}", justify="right")
        cells = {(c.sessions, c.context_label): c for c in pred.cells if c.speculative == spec}
        reported = {(n, ctx) for n, ctx, s in REPORT_DECODE_CELLS if s == spec}
        for sessions in sorted({n for n, _ in cells} | {n for n, _ in reported}):
            row = []
            for label in CONTEXT_LABELS:
                c = cells.get((sessions, label))
                report = REPORT_DECODE_CELLS.get((sessions, label, spec))
                if c is None:
                    row.append(f"not measured | rep {report:.0f}" if report else "")
                    continue
                ratio = f" ({c.ratio_to_report:.2f}x)" if c.ratio_to_report else ""
                spread = (f"\nrange {c.range_tok_s[0]:,.0f}..{c.range_tok_s[1]:,.0f}" if c.range_tok_s else "")
                row.append(f"pred {c.predicted_tok_s:,.0f} | rep {f'{report:.0f}' if report else '—'}{ratio}"
                           f"{spread}\n[dim]{c.dominated_by}[/dim]")
            table.add_row(str(sessions), *row)
        console.print(table)
    detail = Table(title="per cell (step time per rank on 8x L40, predicted)", title_justify="left")
    for name in ("cell", "measured ms", "step ms", "collectives ms", "tokens/step", "basis"):
        detail.add_column(name, justify="right" if "ms" in name or "tokens" in name else "left")
    for c in pred.cells:
        basis = c.label
        if c.report_implied_share is not None:
            basis += (f"; the report's {c.report_tok_s:g} tok/s implies {c.report_implied_share:.0%} of the step "
                      "scaled (inferred from the report, not measured)")
        detail.add_row(f"{c.sessions} x {c.context_tokens:,} {c.speculative}", f"{c.measured_step_us / 1e3:.2f}",
                       f"{c.predicted_step_us / 1e3:.2f}", f"{c.collectives_us / 1e3:.2f} ({c.collective_calls} calls)",
                       f"{c.tokens_per_step:g}", basis)
    console.print(detail)
    for p in pred.prefill:
        report = "" if p.report_s is None else (
            f"; report {p.report_s[0]:g}-{p.report_s[1]:g} s" if p.report_s[0] != p.report_s[1]
            else f"; report about {p.report_s[0]:g} s")
        spread = f", range {p.range_s[0]:,.1f}..{p.range_s[1]:,.1f} s" if p.range_s else ""
        console.print(f"prefill {p.prompt_tokens:,} tokens: {p.predicted_ttft_s:,.1f} s{spread} (collectives "
                      f"{p.collectives_s:,.1f} s){report} — {p.label}")
    console.print(f"collectives: {pred.collective_model}")
    console.print(f"tokens per step: {pred.acceptance}")
    for note in pred.notes:
        console.print(f"[dim]{note}[/dim]")
