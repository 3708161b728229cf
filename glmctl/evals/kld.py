"""`glmctl eval kld`: how far a build's next-token distributions are from the exact model's.

Per scored position of perplexity's token plan (kld_table.py), the reference (the exact model, a
second server or a saved table) and the build under test each report their top K tokens; the
statistic is KL(reference || build) over the union of the two top-K sets plus one bucket for the
remaining mass, a **lower bound** of the full-vocabulary KL (kld_math.py says why and how). The
summary follows llama.cpp's `--kl-divergence` printout: mean KLD with its standard error, median,
90/95/99/99.9th percentiles and maximum; "same top token" %; delta-p (the build's probability of
the actual token minus the reference's): mean, RMS, percentiles; the perplexity of both and the
paired ln-ratio with a 95% CI. Standard errors are by batch means over contiguous tokens
(stats.py), because neighbouring tokens are correlated.

The results file is JSON Lines: a header (the plan, both sides, K), then one line per window with
its per-position numbers; an interrupted run resumes, a file of other settings is refused.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel

from glmctl.errors import UsageError
from glmctl.evals import jsonl_log, stats
from glmctl.evals import kld_table as kt
from glmctl.evals import perplexity as ppl
from glmctl.evals.client import OpenAIServer
from glmctl.evals.kld_math import PositionStats, compare_positions
from glmctl.evals.results import SCHEMA_VERSION, ServerInfo, now, server_info

BOUND = ("lower bound: KL(reference || build) over the union of both top-K sets plus one bucket for "
         "all other tokens, with each unlisted probability set, within what the reports allow (at most "
         "that side's smallest top-K probability, together its unlisted mass), to the value that "
         "minimises the divergence; the full-vocabulary KL is at least this (up to 1e-6 nats of float "
         "rounding; exact when K covers the vocabulary)")
PERCENTILES = (90.0, 95.0, 99.0, 99.9)
DELTA_P_PERCENTILES = (1.0, 5.0, 10.0, 25.0, 50.0, 75.0, 90.0, 95.0, 99.0)


class ReferenceSide(BaseModel):
    source: Literal["server", "file"]
    server: ServerInfo  # for a file: the server it was saved from
    file: str | None = None


class KldHeader(BaseModel):
    kind: Literal["kld-header"] = "kld-header"
    schema_version: int = SCHEMA_VERSION
    created: str
    build: ServerInfo
    reference: ReferenceSide
    tokenizer: str
    text: ppl.TextInfo
    windowing: ppl.Windowing
    top_k: int
    scored_ids_sha256: str

    def identity(self) -> dict:
        return {"build": self.build.model, "reference": self.reference.server.model, "top_k": self.top_k,
                "sha256": self.scored_ids_sha256, "windowing": self.windowing.model_dump()}


class Spread(BaseModel):
    mean: float
    stderr: float | None = None
    rms: float | None = None
    median: float
    percentiles: dict[str, float]  # "99.9" -> value
    min: float
    max: float


class KldComparison(BaseModel):
    baseline_file: str
    baseline_build: str
    baseline_mean_kld: float
    difference: float  # this run's mean KLD minus the baseline's, nats
    ci95_low: float
    ci95_high: float
    positions_paired: int
    method: str


class KldReport(BaseModel):
    kind: Literal["kld"] = "kld"
    schema_version: int = SCHEMA_VERSION
    results_file: str
    settings: KldHeader
    positions: int
    windows_run: int
    windows_resumed: int
    bound: str = BOUND
    kld: Spread  # nats per token
    same_top_percent: float
    delta_p: Spread  # p_build(actual) - p_reference(actual), probability units
    p_build_of_reference_top: tuple[float, float]  # mean, low .. high (unlisted: 0 .. the build's cap)
    perplexity_reference: float
    perplexity_build: float
    perplexity_ratio: float  # build / reference
    ln_ratio: float  # mean over positions of ln p_reference - ln p_build = ln(perplexity_ratio)
    ln_ratio_ci95: tuple[float, float]
    stderr_method: str
    histogram: str | None = None
    comparison: KldComparison | None = None


def _window_record(index: int, s: PositionStats) -> dict:
    return {"kind": "kld-window", "index": index, "kld": s.kld.tolist(), "ref_lp": s.ref_logprob.tolist(),
            "build_lp": s.build_logprob.tolist(), "same_top": s.same_top.astype(int).tolist(),
            "p_top_low": s.p_ref_top_low.tolist(), "p_top_high": s.p_ref_top_high.tolist()}


def _stats_of(records: list[dict]) -> PositionStats:
    def cat(key: str) -> np.ndarray:
        return np.concatenate([np.asarray(r[key], dtype=np.float64) for r in records]) if records else np.zeros(0)
    return PositionStats(kld=cat("kld"), ref_logprob=cat("ref_lp"), build_logprob=cat("build_lp"),
                         same_top=cat("same_top").astype(bool), p_ref_top_low=cat("p_top_low"),
                         p_ref_top_high=cat("p_top_high"))


def read_results(path: Path) -> tuple[KldHeader | None, dict[int, dict]]:
    records = jsonl_log.read_records(path, "kld result")
    if not records:
        return None, {}
    if records[0].get("kind") != "kld-header":
        raise UsageError(f"{path} is not a kld results file (its first line is a {records[0].get('kind')!r})",
                         hint="pass the .jsonl that an earlier `glmctl eval kld --out` wrote")
    header = KldHeader.model_validate(records[0])
    return header, {int(r["index"]): r for r in records[1:] if r.get("kind") == "kld-window"}


def save_reference(server: OpenAIServer, tokenizer, source, *, path: Path, top_k: int = kt.DEFAULT_TOP_K,
                   window: int | None = None, stride: int | None = None, bos: str = "auto",
                   max_tokens: int = ppl.DEFAULT_MAX_TOKENS, restart: bool = False,
                   on_start: Callable[[int], None] | None = None,
                   on_window: Callable[[int], None] | None = None) -> kt.ReferenceFile:
    """Score `server` over the plan and save its top-K table (resumed if `path` holds part of it)."""
    plan = kt.plan_tokens([server], tokenizer, source, window=window, stride=stride, bos=bos, max_tokens=max_tokens)
    ref = kt.open_reference_for_saving(path, kt.reference_header(server, tokenizer, plan, top_k), restart)
    if on_start:
        on_start(plan.positions)
    for index, w in enumerate(plan.windows):
        if index not in ref.windows:
            kt.reference_table(ref, index, plan, top_k, server)
        if on_window:
            on_window(w.end - w.score_from)
    return ref


def run(build: OpenAIServer, tokenizer, source, *, out: Path, reference_server: OpenAIServer | None = None,
        reference_file: Path | None = None, save_reference: Path | None = None,
        reference_tokenizer=None, top_k: int = kt.DEFAULT_TOP_K, window: int | None = None,
        stride: int | None = None, bos: str = "auto", max_tokens: int = ppl.DEFAULT_MAX_TOKENS,
        restart: bool = False, on_start: Callable[[int], None] | None = None,
        on_window: Callable[[int], None] | None = None) -> KldReport:
    """Compare `build` with the reference (a server, or a saved table) over perplexity's plan."""
    if (reference_server is None) == (reference_file is None):
        raise UsageError("pass exactly one of --reference-url (a server) or --reference (a saved table)")
    if top_k < 1:
        raise UsageError(f"--top-k {top_k} must be at least 1")
    servers = [build] + ([reference_server] if reference_server is not None else [])
    plan = kt.plan_tokens(servers, tokenizer, source, window=window, stride=stride, bos=bos, max_tokens=max_tokens)
    if reference_server is not None:
        if reference_tokenizer is not None:  # both servers' own tokenizers must cut the text alike
            ref_ids = reference_tokenizer.encode(source.text)[:max_tokens]
            if ref_ids != plan.ids:
                raise UsageError(f"{reference_server.base_url} tokenizes the text differently from {build.base_url}",
                                 hint="KLD compares distributions over one vocabulary: serve the same tokenizer")
        ref_header = kt.reference_header(reference_server, tokenizer, plan, top_k)
        ref = (kt.open_reference_for_saving(save_reference, ref_header, restart) if save_reference
               else kt.ReferenceFile(None, ref_header, {}))
        side = ReferenceSide(source="server", server=server_info(reference_server))
    else:
        ref = kt.ReferenceFile.read(reference_file)  # type: ignore[arg-type]
        ref.check_matches(plan, top_k, tokenizer.source)
        side = ReferenceSide(source="file", server=ref.header.server, file=str(reference_file))  # type: ignore[union-attr]
    header = KldHeader(created=now(), build=server_info(build), reference=side, tokenizer=tokenizer.source,
                       text=plan.text, windowing=plan.windowing, top_k=top_k,
                       scored_ids_sha256=plan.scored_ids_sha256)
    found, done = (None, {}) if restart else read_results(out)
    if found is None:
        jsonl_log.start(out, header)
    else:
        jsonl_log.check_identity(out, found.identity(), header.identity(), "kld")
        jsonl_log.drop_cut_tail(out)
    if on_start:
        on_start(plan.positions)
    resumed = sum(1 for i in range(len(plan.windows)) if i in done)
    for index, w in enumerate(plan.windows):
        if index not in done:
            ref_table = kt.reference_table(ref, index, plan, top_k, reference_server)
            build_table = kt.fetch_window(build, plan, w, top_k)
            done[index] = _window_record(index, compare_positions(ref_table, build_table))
            jsonl_log.append(out, done[index])
        if on_window:
            on_window(w.end - w.score_from)
    per = _stats_of([done[i] for i in range(len(plan.windows))])
    return summarize(per, found or header, str(out), windows_run=len(plan.windows) - resumed,
                     windows_resumed=resumed)


def _spread(values: np.ndarray, percentiles: tuple[float, ...], *, stderr: bool, rms: bool) -> Spread:
    return Spread(mean=float(values.mean()), stderr=stats.batch_means_stderr(values) if stderr else None,
                  rms=float(np.sqrt(np.mean(values ** 2))) if rms else None, median=float(np.median(values)),
                  percentiles={f"{q:g}": float(np.percentile(values, q)) for q in percentiles},
                  min=float(values.min()), max=float(values.max()))


def summarize(per: PositionStats, header: KldHeader, results_file: str, *, windows_run: int,
              windows_resumed: int) -> KldReport:
    nll_ref, nll_build = -per.ref_logprob, -per.build_logprob
    diff = nll_build - nll_ref  # ln ratio per position
    se = stats.batch_means_stderr(diff)
    se = se if math.isfinite(se) else 0.0
    ln_ratio = float(diff.mean())
    delta_p = np.exp(per.build_logprob) - np.exp(per.ref_logprob)
    return KldReport(
        results_file=results_file, settings=header, positions=len(per.kld), windows_run=windows_run,
        windows_resumed=windows_resumed,
        kld=_spread(per.kld, PERCENTILES, stderr=True, rms=False),
        same_top_percent=100.0 * float(per.same_top.mean()),
        delta_p=_spread(delta_p, DELTA_P_PERCENTILES, stderr=True, rms=True),
        p_build_of_reference_top=(float(per.p_ref_top_low.mean()), float(per.p_ref_top_high.mean())),
        perplexity_reference=math.exp(float(nll_ref.mean())), perplexity_build=math.exp(float(nll_build.mean())),
        perplexity_ratio=math.exp(ln_ratio), ln_ratio=ln_ratio,
        ln_ratio_ci95=(ln_ratio - stats.Z95 * se, ln_ratio + stats.Z95 * se),
        stderr_method=stats.stderr_method(len(per.kld)),
    )


def compare(report: KldReport, baseline_path: Path) -> KldComparison:
    """Paired difference of mean KLD against an earlier run over the same positions and K."""
    header, windows = read_results(baseline_path)
    if header is None:
        raise UsageError(f"baseline {baseline_path} is empty or does not exist")
    s = report.settings
    if (header.scored_ids_sha256, header.top_k, header.windowing.window, header.windowing.stride) != (
            s.scored_ids_sha256, s.top_k, s.windowing.window, s.windowing.stride):
        raise UsageError(f"baseline {baseline_path} scored other tokens, windows or --top-k "
                         f"(K {header.top_k}, window {header.windowing.window}, stride {header.windowing.stride})",
                         hint="a paired comparison needs the same text, windows and --top-k")
    if len(windows) < header.windowing.windows:
        raise UsageError(f"baseline {baseline_path} is incomplete ({len(windows)} of "
                         f"{header.windowing.windows} windows)", hint="finish that run first (it resumes)")
    base = _stats_of([windows[i] for i in range(header.windowing.windows)]).kld
    mine = _stats_of([w for _, w in sorted(read_results(Path(report.results_file))[1].items())]).kld
    diff = mine - base
    se = stats.batch_means_stderr(diff)
    se = se if math.isfinite(se) else 0.0
    mean = float(diff.mean())
    return KldComparison(baseline_file=str(baseline_path), baseline_build=header.build.model,
                         baseline_mean_kld=float(base.mean()), difference=mean, ci95_low=mean - stats.Z95 * se,
                         ci95_high=mean + stats.Z95 * se, positions_paired=len(diff),
                         method="paired per-position KLD differences, " + stats.stderr_method(len(diff)))


def write_histogram(report: KldReport, path: Path) -> bool:
    """Per-token KLD histogram (log-spaced bins) as a PNG. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    header, windows = read_results(Path(report.results_file))
    kld = _stats_of([w for _, w in sorted(windows.items())]).kld
    floor = 1e-6
    bins = np.logspace(math.log10(floor), math.log10(max(floor * 10, float(kld.max()) * 1.1)), 60)
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.hist(np.maximum(kld, floor), bins=bins, color="#4a7ab8")
    ax.set_xscale("log")
    for value, label, style in ((report.kld.mean, "mean", "-"), (report.kld.median, "median", "--"),
                                (report.kld.percentiles["99"], "99th pct", ":")):
        ax.axvline(max(value, floor), color="#c0392b", linestyle=style, linewidth=1, label=f"{label} {value:.4g}")
    ax.set_xlabel(f"KL(reference || build) per token, nats (lower bound, top {report.settings.top_k}; "
                  f"< {floor:g} shown at {floor:g})", fontsize=8)
    ax.set_ylabel("tokens")
    ax.set_title(f"{report.settings.build.model} vs {report.settings.reference.server.model}: "
                 f"{report.positions:,} tokens", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)
    return True
