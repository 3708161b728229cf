"""Running a needle grid: resumable JSONL results, the length x depth summary, baselines, a heatmap.

The results file is JSON Lines: a header line with the settings every cell shares, then one line
per finished cell (its recipe, its measured layout, the answer and the score). A run appends a line
as soon as a cell is done, so an interrupted run resumes where it stopped; a file written with other
settings (model, tokenizer, text, needle kind, API...) is refused rather than mixed. A cut-off last
line (a crash mid-write) is ignored.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ValidationError

from glmctl.errors import UsageError
from glmctl.evals import needle as nd
from glmctl.evals.client import OpenAIServer
from glmctl.evals.corpus import SourceText
from glmctl.evals.results import SCHEMA_VERSION, ServerInfo, now, server_info
from glmctl.evals.tokenizer import Tokenizer


class NeedleSettings(BaseModel):
    kind: Literal["needle-header"] = "needle-header"
    schema_version: int = SCHEMA_VERSION
    created: str
    server: ServerInfo
    tokenizer: str
    source_origin: str
    source_files: list[str]
    source_python: str | None
    source_sha256: str
    seed: int
    needle_kind: nd.NeedleKind
    api: nd.Api
    distractors: int
    template_kwargs: dict | None
    max_answer_tokens: int

    def identity(self) -> dict:
        """What must be equal for two runs' cells to belong to one grid."""
        return self.model_dump(exclude={"created", "server"}) | {"model": self.server.model}


class CellResult(BaseModel):
    kind: Literal["needle-cell"] = "needle-cell"
    recipe: nd.CellRecipe
    layout: nd.CellLayout
    answer: str
    reasoning: str | None = None
    finish_reason: str | None = None
    served_prompt_tokens: int | None = None  # the server's own count: equals layout.prompt_tokens
    correct: bool
    distractor: bool
    seconds: float


class CellSummary(BaseModel):
    length: int
    depth_percent: float
    actual_depth_percent: float
    prompt_tokens: int
    needle_token_index: int
    correct: bool
    distractor: bool
    answer: str
    cut_off: bool = False  # the answer hit max_answer_tokens (finish_reason "length") and missed


class CellChange(BaseModel):
    length: int
    depth_percent: float
    baseline_correct: bool
    correct: bool


class NeedleComparison(BaseModel):
    baseline_file: str
    baseline_model: str
    baseline_accuracy: float
    cells_compared: int
    changed: list[CellChange]


class NeedleReport(BaseModel):
    kind: Literal["needle"] = "needle"
    schema_version: int = SCHEMA_VERSION
    results_file: str
    settings: NeedleSettings
    lengths: list[int]
    depths: list[float]
    cells: list[CellSummary]
    accuracy: float
    cells_resumed: int
    cells_run: int
    dry_run: bool = False
    cells_cut_off: int = 0  # answers that hit max_answer_tokens with no needle value in them
    heatmap: str | None = None
    comparison: NeedleComparison | None = None
    note: str


def read_results(path: Path) -> tuple[NeedleSettings | None, dict[tuple[int, float], CellResult]]:
    if not path.exists():
        return None, {}
    lines = path.read_text(encoding="utf-8").splitlines()
    header: NeedleSettings | None = None
    cells: dict[tuple[int, float], CellResult] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
            if raw.get("kind") == "needle-header":
                header = NeedleSettings.model_validate(raw)
            elif raw.get("kind") == "needle-cell":
                cell = CellResult.model_validate(raw)
                cells[(cell.recipe.length, cell.recipe.depth_percent)] = cell
            else:
                raise ValueError(f"unknown kind {raw.get('kind')!r}")
        except (json.JSONDecodeError, ValidationError, ValueError, AttributeError) as exc:
            if number == len(lines):  # a line cut off by a crash: that cell simply runs again
                break
            raise UsageError(f"{path}:{number} is not a needle result line ({exc})",
                             hint="pass another --out, or --restart to overwrite it") from exc
    if header is None and cells:
        raise UsageError(f"{path} has needle cells but no header line")
    return header, cells


def drop_cut_tail(path: Path) -> None:
    """Cut a last line that a crash left unfinished, so appended lines start on a line of their own."""
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return
    with path.open("r+b") as fh:
        fh.truncate(data.rfind(b"\n") + 1)


def _append(path: Path, record: BaseModel) -> None:
    with path.open("a", encoding="utf-8") as fh:
        fh.write(record.model_dump_json() + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def summarize(cell: CellResult) -> CellSummary:
    return CellSummary(length=cell.recipe.length, depth_percent=cell.recipe.depth_percent,
                       actual_depth_percent=cell.layout.actual_depth_percent,
                       prompt_tokens=cell.layout.prompt_tokens, needle_token_index=cell.layout.needle_token_index,
                       correct=cell.correct, distractor=cell.distractor, answer=cell.answer[:200],
                       cut_off=cell.finish_reason == "length" and not cell.correct)


def compare(cells: list[CellSummary], baseline_path: Path) -> NeedleComparison:
    header, base_cells = read_results(baseline_path)
    if header is None:
        raise UsageError(f"baseline {baseline_path} is not a needle results file (no header line)",
                         hint="pass the .jsonl an earlier `glmctl eval needle --out` wrote")
    changed, compared = [], 0
    for c in cells:
        b = base_cells.get((c.length, c.depth_percent))
        if b is None:
            continue
        compared += 1
        if b.correct != c.correct:
            changed.append(CellChange(length=c.length, depth_percent=c.depth_percent,
                                      baseline_correct=b.correct, correct=c.correct))
    accuracy = sum(b.correct for b in base_cells.values()) / max(1, len(base_cells))
    return NeedleComparison(baseline_file=str(baseline_path), baseline_model=header.server.model,
                            baseline_accuracy=accuracy, cells_compared=compared, changed=changed)


def run_grid(server: OpenAIServer, tokenizer: Tokenizer, source: SourceText, *, lengths: list[int],
             depths: list[float], out: Path, seed: int = 0, kind: nd.NeedleKind = "number",
             api: nd.Api = "chat", distractors: int = 3, template_kwargs: dict | None = None,
             max_answer_tokens: int = 48, restart: bool = False, dry_run: bool = False,
             on_cell: Callable[[CellSummary | None, int, int], None] | None = None) -> NeedleReport:
    server.check_fits(max(lengths) + max_answer_tokens,
                      f"the longest cell ({max(lengths):,} prompt tokens + {max_answer_tokens} answer tokens)",
                      hint="drop the longer --lengths, or serve the model with a larger --max-model-len")
    settings = NeedleSettings(
        created=now(), server=server_info(server), tokenizer=tokenizer.source, source_origin=source.origin,
        source_files=list(source.files), source_python=source.python_version, source_sha256=source.sha256,
        seed=seed, needle_kind=kind, api=api, distractors=distractors, template_kwargs=template_kwargs,
        max_answer_tokens=max_answer_tokens)
    header, done = (None, {}) if restart else read_results(out)
    if header is not None and header.identity() != settings.identity():
        diff = sorted(k for k, v in settings.identity().items() if header.identity().get(k) != v)
        raise UsageError(f"{out} holds a needle run with other settings ({', '.join(diff)})",
                         hint="pass another --out, or --restart to start that file over")
    cells = [(length, depth) for length in lengths for depth in depths]
    todo = [c for c in cells if c not in done]
    started_file = not dry_run and header is None
    if started_file:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("", encoding="utf-8")  # --restart, or a new file: start it with the header
        _append(out, settings)
    elif not dry_run:
        drop_cut_tail(out)
    finished: dict[tuple[int, float], CellSummary] = {k: summarize(v) for k, v in done.items() if k in cells}
    try:
        stream = nd.HaystackStream(source, tokenizer)
        if todo:
            stream.ensure_tokens(max(length for length, _ in todo))
        if on_cell:
            on_cell(None, len(finished), len(cells))
        for length, depth in todo:
            recipe, layout = nd.plan_cell(length, depth, seed=seed, kind=kind, api=api, distractors=distractors,
                                          template_kwargs=template_kwargs, max_answer_tokens=max_answer_tokens,
                                          stream=stream, tokenizer=tokenizer)
            if dry_run:
                result = CellResult(recipe=recipe, layout=layout, answer="", correct=False, distractor=False,
                                    seconds=0.0)
            else:
                result = _ask(server, tokenizer, source, recipe, layout)
                _append(out, result)
            finished[(length, depth)] = summarize(result)
            if on_cell:
                on_cell(finished[(length, depth)], len(finished), len(cells))
    except BaseException:
        if started_file and len(finished) == 0:
            out.unlink(missing_ok=True)  # a header without a cell is no result: leave none behind
        raise
    ordered = [finished[c] for c in cells]
    return NeedleReport(
        results_file=str(out), settings=header or settings, lengths=lengths, depths=depths, cells=ordered,
        accuracy=sum(c.correct for c in ordered) / len(ordered), cells_resumed=len(cells) - len(todo),
        cells_run=len(todo), dry_run=dry_run, cells_cut_off=sum(c.cut_off for c in ordered),
        note="exact substring scoring of the needle's value; prompts rebuild from each line's recipe",
    )


def _ask(server: OpenAIServer, tokenizer: Tokenizer, source: SourceText, recipe: nd.CellRecipe,
         layout: nd.CellLayout) -> CellResult:
    started = time.monotonic()
    if recipe.api == "chat":
        messages, _ = nd.build_text(recipe, source)
        answer = server.chat(messages, max_tokens=recipe.max_answer_tokens, template_kwargs=recipe.template_kwargs)
    else:
        answer = server.complete(nd.prompt_ids(tokenizer, recipe, source), max_tokens=recipe.max_answer_tokens)
    score = nd.score_answer(answer.text, recipe)
    return CellResult(recipe=recipe, layout=layout, answer=answer.text, reasoning=answer.reasoning,
                      finish_reason=answer.finish_reason, served_prompt_tokens=answer.prompt_tokens,
                      correct=score.correct, distractor=score.distractor,
                      seconds=round(time.monotonic() - started, 3))


def write_heatmap(report: NeedleReport, path: Path) -> bool:
    """A length x depth PNG (green found, red missed, amber a distractor). False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap
    except ImportError:
        return False
    grid = {(c.length, c.depth_percent): c for c in report.cells}
    values = [[(2 if grid[(L, d)].correct else 1 if grid[(L, d)].distractor else 0) for d in report.depths]
              for L in report.lengths]
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(report.depths), 1.0 + 0.6 * len(report.lengths)))
    ax.imshow(values, cmap=ListedColormap(["#d9534f", "#f0ad4e", "#5cb85c"]), vmin=0, vmax=2, aspect="auto")
    ax.set_xticks(range(len(report.depths)), [f"{d:g}%" for d in report.depths])
    ax.set_yticks(range(len(report.lengths)), [f"{L:,}" for L in report.lengths])
    ax.set_xlabel("needle depth (% of haystack tokens)")
    ax.set_ylabel("prompt tokens")
    ax.set_title(f"needle: {report.settings.server.model} ({report.accuracy:.0%} found)", fontsize=9)
    for i, L in enumerate(report.lengths):
        for j, d in enumerate(report.depths):
            ax.text(j, i, "found" if grid[(L, d)].correct else "missed", ha="center", va="center", fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)
    return True
