"""eval humaneval: fake servers that answer with the canonical solutions, with `pass`, with loops,
fork and memory bombs; the sandbox's containment; resume; the paired baseline's exact numbers."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from glmctl.errors import UsageError
from glmctl.evals import humaneval as he
from glmctl.evals import humaneval_stats as hs
from glmctl.evals import sandbox
from glmctl.evals.client import OpenAIServer
from tests.fake_server import SPECIALS, FakeEngine, FakeServer

PROBLEMS, _ = he.load_problems()
BY_PROMPT = {p.prompt: p for p in PROBLEMS}

LOOP = "    while True:\n        pass\n"
FORK_BOMB = "    import os\n    while True:\n        try:\n            os.fork()\n        except OSError:\n            pass\n"
MEMORY_BOMB = "    x = []\n    while True:\n        x.append(bytearray(1 << 24))\n"
SLEEPY_CHILD = "    import os, time\n    if os.fork() == 0:\n        os.setsid()\n        time.sleep(600)\n    return None\n"


class AnswerEngine(FakeEngine):
    """Answers each HumanEval prompt with `answer(problem)` (text after the prompt)."""

    def __init__(self, answer, **kw) -> None:
        super().__init__(max_model_len=1 << 20, **kw)
        self.answer_for = answer

    def answer(self, prompt_text: str) -> str:
        prompt = prompt_text.removeprefix(SPECIALS[2])
        return self.answer_for(BY_PROMPT[prompt])


def _run(tmp_path, answer, name="he.jsonl", **kw):
    with FakeServer(AnswerEngine(answer)) as url:
        server = OpenAIServer(url)
        server.connect()
        return he.run(server, out=tmp_path / name, max_tokens=4096, **kw)


def test_data_set_is_the_packages_164_problems():
    assert len(PROBLEMS) == 164 and [p.number for p in PROBLEMS] == list(range(164))
    assert PROBLEMS[0].task_id == "HumanEval/0" and PROBLEMS[0].entry_point == "has_close_elements"


@pytest.mark.slow
def test_canonical_solutions_pass_all_164(tmp_path):
    report = _run(tmp_path, lambda p: p.canonical_solution, concurrency=2)
    failed = [(p.task_id) for p in report.per_problem if not p.first_passed]
    assert failed == [] and report.problems_passed == 164 and report.pass_at_1 == 1.0
    assert report.pass_at_1_ci95 == pytest.approx(hs.wilson(164, 164))
    assert report.outcomes == {"passed": 164}


@pytest.mark.slow
def test_pass_scores_zero(tmp_path):
    report = _run(tmp_path, lambda p: "    pass\n", concurrency=2)
    assert report.problems_passed == 0 and report.pass_at_1 == 0.0 and report.problems == 164
    assert report.pass_at_1_ci95[0] == 0.0 and 0 < report.pass_at_1_ci95[1] < 0.03


@pytest.mark.parametrize("body", [LOOP, FORK_BOMB, MEMORY_BOMB, SLEEPY_CHILD], ids=["loop", "fork", "memory", "setsid"])
def test_runaway_programs_fail_within_the_deadline_and_leave_nothing_running(tmp_path, body):
    limits = sandbox.Limits(wall_s=3.0, memory_bytes=256 << 20)
    started = time.monotonic()
    report = _run(tmp_path, lambda p: body if p.number == 2 else p.canonical_solution, problems_spec="1-3",
                  concurrency=3, limits=limits)
    assert time.monotonic() - started < 3.0 + 15  # the deadline, plus three interpreters' start-up here
    by = {p.task_id: p.first_passed for p in report.per_problem}
    assert by == {"HumanEval/1": True, "HumanEval/2": False, "HumanEval/3": True}
    if os.geteuid() == 0:  # every sandbox ran under a user id of its own: none of them is left
        assert _sandbox_uids() == []


def _sandbox_uids() -> list[int]:
    uids = []
    for entry in os.scandir("/proc"):
        try:
            with open(f"{entry.path}/status") as fh:
                fields = dict(line.split(":", 1) for line in fh if ":" in line)
        except (OSError, NotADirectoryError):
            continue
        uid = int(fields.get("Uid", "-1").split()[0])
        if uid >= sandbox.UID_BASE and not fields.get("State", "").strip().startswith("Z"):
            uids.append(uid)
    return uids


def test_sandbox_outcomes(tmp_path):
    os.environ["GLMCTL_TEST_SECRET"] = "sk-do-not-leak"
    try:
        limits = sandbox.Limits(wall_s=5.0)
        outside = tmp_path / "outside.txt"
        cases = {
            "assert 1 + 1 == 2\n": ("passed", None),
            "assert 1 == 2\n": ("failed", "AssertionError"),
            "import os\nassert 'GLMCTL_TEST_SECRET' not in os.environ\n": ("passed", None),
            f"open({str(outside)!r}, 'w').write('x')\n": ("failed", "PermissionError"),
            "import shutil\nshutil.rmtree('/usr')\n": ("failed", "PermissionError"),
            "open('inside.txt', 'w').write('x')\nassert open('inside.txt').read() == 'x'\n": ("passed", None),
            "import sys\nsys.exit(0)\n": ("failed", "SystemExit(0)"),
            "import os\nos._exit(0)\n": ("exit", "exit code 0 before the program's end"),
            "x = [0] * (1 << 40)\n": ("failed", "MemoryError"),
        }
        for source, (kind, error) in cases.items():
            outcome = sandbox.run_program(source, limits)
            assert (outcome.kind, outcome.error) == (kind, error), (source, outcome)
            assert outcome.passed == (kind == "passed")
        assert not outside.exists()
    finally:
        del os.environ["GLMCTL_TEST_SECRET"]


def test_resume_after_a_kill_reruns_only_the_missing_problems(tmp_path):
    engine = AnswerEngine(lambda p: p.canonical_solution)
    out = tmp_path / "he.jsonl"
    with FakeServer(engine) as url:
        server = OpenAIServer(url)
        server.connect()
        he.run(server, out=out, problems_spec="0-5", concurrency=2)
        lines = out.read_text().splitlines()
        kept = lines[:4]  # the header and three samples; a fourth line cut in the middle by the kill
        out.write_text("\n".join(kept) + "\n" + lines[4][:40])
        before = len(engine.requests)
        report = he.run(server, out=out, problems_spec="0-5", concurrency=2)
        asked = {BY_PROMPT[r["prompt"]].task_id for r in engine.requests[before:] if r["path"] == "/v1/completions"}
    kept_ids = {json.loads(line)["task_id"] for line in kept[1:]}
    assert asked == {f"HumanEval/{i}" for i in range(6)} - kept_ids
    assert (report.samples_run, report.samples_resumed, report.problems_passed) == (3, 3, 6)
    assert len(out.read_text().splitlines()) == 7
    with FakeServer(engine) as url:
        server = OpenAIServer(url)
        server.connect()
        with pytest.raises(UsageError, match="other settings"):
            he.run(server, out=out, problems_spec="0-5", max_tokens=17)


@pytest.mark.parametrize("tail", ["\nprint('extra')\n", "\n# extra\n"])
def test_requests_use_the_standard_stops_and_completions_are_cut_at_them(tmp_path, tail):
    """The server takes at most four stop sequences (the OpenAI API's limit, which vLLM enforces
    with HTTP 400); the fifth, `\\n#`, is applied to the completion here."""
    engine = AnswerEngine(lambda p: p.canonical_solution + tail)
    with FakeServer(engine) as url:
        server = OpenAIServer(url)
        server.connect()
        report = he.run(server, out=tmp_path / "he.jsonl", problems_spec="0")
    body = [r for r in engine.requests if r["path"] == "/v1/completions"][0]
    assert body["stop"] == ["\ndef", "\nclass", "\nif", "\nprint"] and body["temperature"] == 0.0
    assert report.problems_passed == 1
    line = json.loads((tmp_path / "he.jsonl").read_text().splitlines()[1])
    assert "extra" not in line["completion"]


def test_baseline_with_known_flips_gives_the_exact_mcnemar_p(tmp_path):
    # baseline fails 3, 4, 5, 6, 7, 8; this run fails 1 and 2 only: 6 flipped to pass, 2 to fail
    def answers(failing):
        return lambda p: "    pass\n" if p.number in failing else p.canonical_solution

    base = _run(tmp_path, answers({3, 4, 5, 6, 7, 8}), name="base.jsonl", problems_spec="0-11", concurrency=2)
    new = _run(tmp_path, answers({1, 2}), name="new.jsonl", problems_spec="0-11", concurrency=2)
    cmp = he.compare(new, tmp_path / "base.jsonl")
    assert (cmp.only_this_run_passed, cmp.only_baseline_passed, cmp.problems_paired) == (6, 2, 12)
    # two-sided exact binomial test of 2 in 8 at 1/2: 2 * (1 + 8 + 28) / 256
    assert cmp.mcnemar_p == pytest.approx(2 * 37 / 256)
    assert cmp.newly_passing == [f"HumanEval/{i}" for i in range(3, 9)]
    assert cmp.newly_failing == ["HumanEval/1", "HumanEval/2"]
    assert cmp.difference_points == pytest.approx(100 * 4 / 12)
    lo, hi = cmp.ci95_points
    assert lo < cmp.difference_points < hi
    assert base.pass_at_1 == pytest.approx(6 / 12) and cmp.baseline_pass_at_1 == pytest.approx(6 / 12)
    # a report saved with --json serves as the baseline too
    (tmp_path / "base.json").write_text(base.model_dump_json())
    assert he.compare(new, tmp_path / "base.json").mcnemar_p == cmp.mcnemar_p


def test_statistics():
    assert hs.mcnemar_exact(0, 0) == 1.0 and hs.mcnemar_exact(5, 5) == 1.0
    assert hs.mcnemar_exact(0, 6) == pytest.approx(2 / 64)
    lo, hi = hs.wilson(0, 164)
    assert lo == 0.0 and hi == pytest.approx(3.8415 / (164 + 3.8415), rel=1e-3)
    assert hs.pass_at_k([10, 10], [0, 10], 1) == pytest.approx(0.5)
    assert hs.pass_at_k([10], [1], 10) == 1.0 and hs.pass_at_k([10], [1], 1) == pytest.approx(0.1)
    diff, lo, hi = hs.paired_difference(36, 12, 2, 0)
    assert diff == pytest.approx(0.2) and 0 < lo < diff < hi < 1  # 12 vs 2 discordant: a clear gain
    diff, lo, hi = hs.paired_difference(80, 0, 0, 84)  # identical runs: no difference, a narrow interval
    assert diff == 0 and -0.05 < lo < 0 < hi < 0.05


def test_samples_need_a_temperature_and_give_pass_at_k(tmp_path):
    with pytest.raises(UsageError, match="copies of the greedy answer"):
        _run(tmp_path, lambda p: p.canonical_solution, samples=3)
    report = _run(tmp_path, lambda p: p.canonical_solution, samples=2, temperature=0.8, problems_spec="0-1")
    assert report.pass_at_k == {"1": 1.0} and report.settings.samples == 2 and report.samples_run == 4


def test_cli_runs_resumes_compares_and_refuses_bad_flags(tmp_path, run_cli):
    import subprocess
    import sys

    script = ("import sys, time; sys.path.insert(0, '.');"
              "from tests.unit.test_eval_humaneval import AnswerEngine;"
              "from tests.fake_server import FakeServer;"
              "s = FakeServer(AnswerEngine(lambda p: p.canonical_solution if p.number else '    pass\\n'));"
              "print(s.__enter__(), flush=True); time.sleep(600)")
    servers = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                               cwd=str(Path(__file__).resolve().parents[2]))
    try:
        url = servers.stdout.readline().strip()
        out = tmp_path / "he.jsonl"
        res = run_cli("eval", "humaneval", "--url", url, "--problems", "0-2", "--out", str(out), "--json")
        assert res.returncode == 0, res.stderr
        doc = json.loads(res.stdout)
        assert (doc["kind"], doc["problems"], doc["problems_passed"]) == ("humaneval", 3, 2)
        (tmp_path / "prev.json").write_text(res.stdout)
        human = run_cli("eval", "humaneval", "--url", url, "--problems", "0-2", "--out", str(out),
                        "--baseline", str(tmp_path / "prev.json"))
        assert human.returncode == 0, human.stderr
        assert "pass@1" in human.stdout and "McNemar exact p = 1" in human.stdout and "3 resumed" in human.stdout
        bad = run_cli("eval", "humaneval", "--url", url, "--samples", "3", "--out", str(tmp_path / "x.jsonl"))
        assert bad.returncode == 2 and "temperature" in bad.stderr
        assert run_cli("eval", "humaneval").returncode == 2
    finally:
        servers.kill()
        servers.wait()
