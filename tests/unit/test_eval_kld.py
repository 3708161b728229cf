"""eval kld: the lower bound's maths against exact KL on known distributions, the run against fake
servers whose distributions are known (save / resume / baseline), and the servers' failure modes."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from glmctl.errors import UsageError
from glmctl.evals import kld as kl
from glmctl.evals import kld_table as kt
from glmctl.evals.client import OpenAIServer, ServerError
from glmctl.evals.corpus import SourceText
from glmctl.evals.kld_math import TopK, compare_positions, kl_lower_bound, union_table
from glmctl.evals.tokenizer import ServerTokenizer
from tests.fake_server import FakeEngine, FakeServer, decode

VOCAB = 256  # the fake tokenizer's ids for ASCII text are 16 + code point < 256


def _report(logp: np.ndarray, k: int, actual: int) -> TopK:
    order = np.argsort(-logp, kind="stable")
    keep = sorted(set(order[:k].tolist()) | {actual})
    return TopK(ids=np.array(keep), logprobs=logp[keep], cap_logprob=float(logp[order[k - 1]]), actual=actual,
                top=int(order[0]))


def _exact_kl(lp: np.ndarray, lq: np.ndarray) -> float:
    return float(np.sum(np.exp(lp) * (lp - lq)))


def _random_logp(rng, n: int, spread: float = 3.0) -> np.ndarray:
    x = rng.normal(size=n) * spread
    return x - np.log(np.exp(x - x.max()).sum()) - x.max()


def test_full_vocabulary_reports_give_the_exact_kl():
    rng = np.random.default_rng(1)
    ref, build, exact = [], [], []
    for _ in range(50):
        lp, lq = _random_logp(rng, 40), _random_logp(rng, 40)
        ref.append(_report(lp, 40, 3))
        build.append(_report(lq, 40, 3))
        exact.append(_exact_kl(lp, lq))
    np.testing.assert_allclose(compare_positions(ref, build).kld, exact, rtol=1e-9, atol=1e-12)


def test_full_reports_with_float_rounding_match_the_direct_sum_of_tiny_divergences():
    """Servers' log-probabilities sum to 1 only within fp32 rounding; with every token listed the
    bound must still equal sum p (ln p - ln q) even when that is ~1e-7 nats (bf16 vs fp32 weights)."""
    rng = np.random.default_rng(4)
    ref, build, exact = [], [], []
    for _ in range(50):
        lp = _random_logp(rng, 500)
        lq = lp + rng.normal(size=500) * 1e-3
        lq -= np.log(np.exp(lq).sum())
        lp, lq = lp + rng.normal(size=500) * 3e-7, lq + rng.normal(size=500) * 3e-7  # fp32-like noise
        ref.append(_report(lp, 500, 7))
        build.append(_report(lq, 500, 7))
        exact.append(_exact_kl(lp, lq))
    got = compare_positions(ref, build).kld
    assert np.mean(exact) < 1e-5
    # the direct sum of unnormalised reports can dip below 0 by rounding; KL cannot
    np.testing.assert_allclose(got, np.maximum(exact, 0.0), rtol=1e-6, atol=1e-10)


def test_truncated_reports_bound_the_exact_kl_from_below_and_beat_the_plain_bucket():
    rng = np.random.default_rng(2)
    for k in (1, 3, 8):
        ref, build, exact, plain = [], [], [], []
        for _ in range(200):
            lp = _random_logp(rng, 30)
            lq = lp + rng.normal(size=30) * rng.choice([0.05, 0.5, 2.0])
            lq -= np.log(np.exp(lq).sum())
            actual = int(rng.integers(30))
            r, b = _report(lp, k, actual), _report(lq, k, actual)
            ref.append(r)
            build.append(b)
            exact.append(_exact_kl(lp, lq))
            # the plain scheme: tokens both listed, everything else in one bucket
            both = sorted(set(r.ids.tolist()) & set(b.ids.tolist()))
            p_in, q_in = np.exp(lp[both]), np.exp(lq[both])
            rest_p, rest_q = 1 - p_in.sum(), 1 - q_in.sum()
            plain.append(float(np.sum(p_in * np.log(p_in / q_in)) + rest_p * math.log(rest_p / rest_q)))
        bound = compare_positions(ref, build).kld
        assert np.all(bound <= np.asarray(exact) + 1e-9)
        assert np.all(bound >= np.asarray(plain) - 1e-9)
        assert bound.sum() > np.sum(plain)  # the caps carry information the plain bucket drops


def test_the_bound_is_the_minimum_over_fills_the_reports_allow():
    """No filling of the unknown entries within the caps and tails gives a smaller divergence."""
    rng = np.random.default_rng(3)
    for _ in range(40):
        lp = _random_logp(rng, 12)
        lq = _random_logp(rng, 12)
        r, b = _report(lp, 3, 0), _report(lq, 3, 0)
        p, p_known, cap_p, q, q_known, cap_q = union_table([r], [b])
        bound = kl_lower_bound(p, p_known, cap_p, q, q_known, cap_q)[0]
        tail_p, tail_q = 1 - p[p_known].sum(), 1 - q[q_known].sum()
        cells = p_known[0] | q_known[0]
        for _ in range(300):
            pf, qf = p[0].copy(), q[0].copy()
            for side, known, cap, tail in ((pf, p_known[0], cap_p[0], tail_p), (qf, q_known[0], cap_q[0], tail_q)):
                free = cells & ~known
                if free.any():
                    w = rng.dirichlet(np.ones(free.sum() + 1)) * tail
                    side[free] = np.minimum(w[:-1], cap)
            rest_p, rest_q = 1 - pf[cells].sum(), 1 - qf[cells].sum()
            value = sum(a * math.log(a / c) for a, c in zip(pf[cells], qf[cells], strict=True) if a > 0)
            value += rest_p * math.log(rest_p / rest_q) if rest_p > 0 else 0.0
            assert bound <= value + 1e-9


def test_a_token_the_build_drops_from_its_top_k_counts_at_most_its_cap():
    """Reference {a: .5, x: .3}, build {x: .6, b: .39}: `a` can have at most the build's unlisted .01."""
    a, x, b = 5, 6, 7
    ref = TopK(np.array([a, x]), np.log([0.5, 0.3]), math.log(0.3), actual=x, top=a)
    build = TopK(np.array([x, b]), np.log([0.6, 0.39]), math.log(0.39), actual=x, top=x)
    expected = 0.5 * math.log(0.5 / 0.01) + 0.3 * math.log(0.3 / 0.6) + 0.2 * math.log(0.2 / 0.39)
    s = compare_positions([ref], [build])
    assert s.kld[0] == pytest.approx(expected, rel=1e-9)
    assert not s.same_top[0] and s.p_ref_top_low[0] == 0 and s.p_ref_top_high[0] == pytest.approx(0.39)


# -- against fake servers whose distributions are known ---------------------------------------


class DistributionEngine(FakeEngine):
    """A fake whose next-token distribution over VOCAB ids is a known function of the previous token;
    `noise` perturbs the logits (a "quantized build"); failure modes by flag."""

    def __init__(self, *, noise: float = 0.0, listed: int | None = None, wrong_token: bool = False,
                 none: bool = False, **kw) -> None:
        super().__init__(**kw)
        self.noise, self.listed, self.wrong_token, self.none = noise, listed, wrong_token, none

    def logp(self, prev: int) -> np.ndarray:
        rng = np.random.default_rng(prev)
        x = rng.normal(size=VOCAB) * 2.5
        if self.noise:
            x = x + np.random.default_rng(10_000 + prev).normal(size=VOCAB) * self.noise
        return x - np.log(np.exp(x - x.max()).sum()) - x.max()

    def prompt_top_logprobs(self, ids, top_k):
        if self.none:
            return None
        out = [None]
        for prev, tok in zip(ids, ids[1:], strict=False):
            lp = self.logp(prev)
            order = np.argsort(-lp, kind="stable")
            shown = top_k if self.listed is None else min(top_k, self.listed)
            entry = {str(int(t)): {"logprob": float(lp[t]), "rank": r + 1, "decoded_token": decode([int(t)])}
                     for r, t in enumerate(order[:shown])}
            sent = tok + 1 if self.wrong_token else tok
            entry.setdefault(str(sent), {"logprob": float(lp[sent]), "rank": int((lp > lp[sent]).sum()) + 1,
                                         "decoded_token": decode([sent])})
            out.append(entry)
        return out


TEXT = SourceText(("def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n" * 8), "files",
                  ("t.py",), None)
PLAN = {"window": 64, "stride": 32, "max_tokens": 300}


def _client(url: str) -> OpenAIServer:
    server = OpenAIServer(url)
    server.connect()
    return server


def _expected_kld(ref: DistributionEngine, build: DistributionEngine, plan: kt.TokenPlan, k: int) -> np.ndarray:
    out = []
    for w in plan.windows:
        ids = plan.window_ids(w)
        first = len(plan.prefix) + (w.score_from - w.start)
        for pos in range(first, len(ids)):
            actual = ids[pos]
            out.append(compare_positions([_report(ref.logp(ids[pos - 1]), k, actual)],
                                         [_report(build.logp(ids[pos - 1]), k, actual)]).kld[0])
    return np.array(out)


def test_self_kld_is_zero_and_a_noisy_build_matches_the_direct_computation(tmp_path):
    ref_engine, build_engine = DistributionEngine(), DistributionEngine(noise=0.4)
    with FakeServer(ref_engine) as ref_url, FakeServer(build_engine) as build_url:
        ref, build = _client(ref_url), _client(build_url)
        tok = ServerTokenizer(build)
        same = kl.run(ref, ServerTokenizer(ref), TEXT, out=tmp_path / "self.jsonl", reference_server=ref,
                      top_k=8, **PLAN)
        assert same.kld.max == pytest.approx(0.0, abs=1e-9) and same.same_top_percent == 100.0
        assert same.ln_ratio == pytest.approx(0.0, abs=1e-12) and same.positions == 300
        report = kl.run(build, tok, TEXT, out=tmp_path / "b.jsonl", reference_server=ref,
                        reference_tokenizer=ServerTokenizer(ref), save_reference=tmp_path / "ref.jsonl",
                        top_k=8, **PLAN)
        plan = kt.plan_tokens([build], tok, TEXT, window=64, stride=32, bos="auto", max_tokens=300)
    expected = _expected_kld(ref_engine, build_engine, plan, 8)
    got = kl._stats_of([w for _, w in sorted(kl.read_results(tmp_path / "b.jsonl")[1].items())]).kld
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-12)
    assert report.kld.mean == pytest.approx(expected.mean()) and report.kld.mean > 0.01
    assert report.kld.max == pytest.approx(expected.max())
    assert 0 < report.same_top_percent < 100
    assert report.perplexity_ratio == pytest.approx(math.exp(report.ln_ratio))
    lo, hi = report.ln_ratio_ci95
    assert lo < report.ln_ratio < hi
    assert report.settings.scored_ids_sha256 == plan.scored_ids_sha256
    assert "lower bound" in report.bound


def test_a_saved_reference_replaces_the_reference_server_and_resumes(tmp_path):
    ref_engine, build_engine = DistributionEngine(), DistributionEngine(noise=0.4)
    ref_file = tmp_path / "ref.jsonl"
    with FakeServer(ref_engine) as ref_url:
        ref = _client(ref_url)
        kl.save_reference(ref, ServerTokenizer(ref), TEXT, path=ref_file, top_k=8, **PLAN)
        lines = ref_file.read_text().splitlines()
        # a kill in the middle of the third window's line: resuming asks only for what is missing
        ref_file.write_text("\n".join(lines[:3]) + "\n" + lines[3][:50])
        before = len(ref_engine.requests)
        kl.save_reference(ref, ServerTokenizer(ref), TEXT, path=ref_file, top_k=8, **PLAN)
        asked = [r for r in ref_engine.requests[before:] if r["path"] == "/v1/completions"]
        assert len(asked) == len(lines) - 3
        assert ref_file.read_text().splitlines() == lines
    with FakeServer(build_engine) as build_url:
        build = _client(build_url)
        from_file = kl.run(build, ServerTokenizer(build), TEXT, out=tmp_path / "f.jsonl", reference_file=ref_file,
                           top_k=8, **PLAN)
        with FakeServer(ref_engine) as ref_url:
            from_server = kl.run(build, ServerTokenizer(build), TEXT, out=tmp_path / "s.jsonl",
                                 reference_server=_client(ref_url), top_k=8, **PLAN)
        assert from_file.kld == from_server.kld
        # a smaller K reads the saved top 8 as its top 5
        five = kl.run(build, ServerTokenizer(build), TEXT, out=tmp_path / "5.jsonl", reference_file=ref_file,
                      top_k=5, **PLAN)
        assert five.kld.mean <= from_file.kld.mean + 1e-12
        # other tokens than the reference's are refused
        with pytest.raises(UsageError, match="scored other tokens"):
            kl.run(build, ServerTokenizer(build), TEXT, out=tmp_path / "x.jsonl", reference_file=ref_file,
                   top_k=8, window=64, stride=32, max_tokens=299)
        with pytest.raises(UsageError, match="fewer than --top-k"):
            kl.run(build, ServerTokenizer(build), TEXT, out=tmp_path / "y.jsonl", reference_file=ref_file,
                   top_k=9, **PLAN)


def test_results_resume_and_a_baseline_is_paired(tmp_path):
    ref_engine = DistributionEngine()
    with FakeServer(ref_engine) as ref_url, FakeServer(DistributionEngine(noise=0.2)) as a_url, \
            FakeServer(DistributionEngine(noise=0.8)) as b_url:
        ref, a, b = _client(ref_url), _client(a_url), _client(b_url)
        out = tmp_path / "a.jsonl"
        first = kl.run(a, ServerTokenizer(a), TEXT, out=out, reference_server=ref, top_k=8, **PLAN)
        lines = out.read_text().splitlines()
        out.write_text("\n".join(lines[:-1]) + "\n")  # the last window lost
        again = kl.run(a, ServerTokenizer(a), TEXT, out=out, reference_server=ref, top_k=8, **PLAN)
        assert (again.windows_run, again.windows_resumed) == (1, len(lines) - 2)
        assert again.kld == first.kld
        worse = kl.run(b, ServerTokenizer(b), TEXT, out=tmp_path / "b.jsonl", reference_server=ref, top_k=8, **PLAN)
        cmp = kl.compare(worse, out)
        assert cmp.difference == pytest.approx(worse.kld.mean - first.kld.mean)
        assert cmp.ci95_low < cmp.difference < cmp.ci95_high and cmp.ci95_low > 0  # 0.8 noise is worse
        with pytest.raises(UsageError, match="other settings"):
            kl.run(a, ServerTokenizer(a), TEXT, out=out, reference_server=ref, top_k=4, **PLAN)


@pytest.mark.parametrize(("engine", "error", "match"), [
    (DistributionEngine(listed=3), kt.TopKShortfall, "asked for the top 8 alternatives, the server listed 3"),
    (DistributionEngine(wrong_token=True), ServerError, "scored a different token than was sent"),
    (DistributionEngine(none=True), ServerError, "ignores `prompt_logprobs`"),
])
def test_server_failure_modes_are_clear_errors(tmp_path, engine, error, match):
    with FakeServer(DistributionEngine()) as ref_url, FakeServer(engine) as bad_url:
        ref, bad = _client(ref_url), _client(bad_url)
        with pytest.raises(error, match=match) as info:
            kl.run(bad, ServerTokenizer(ref), TEXT, out=tmp_path / "k.jsonl", reference_server=ref, top_k=8, **PLAN)
        if error is kt.TopKShortfall:
            assert "--max-logprobs 8" in info.value.hint


def test_cli_saves_compares_and_prints_json(tmp_path, run_cli):
    import subprocess
    import sys

    # The fake servers run in a child process of their own: the CLI runs in a subprocess too.
    script = (
        "import sys, time; sys.path.insert(0, '.');"
        "from tests.unit.test_eval_kld import DistributionEngine;"
        "from tests.fake_server import FakeServer;"
        "a = FakeServer(DistributionEngine()); b = FakeServer(DistributionEngine(noise=0.4));"
        "print(a.__enter__(), b.__enter__(), flush=True); time.sleep(600)"
    )
    text = tmp_path / "t.py"
    text.write_text(TEXT.text)
    servers = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                               cwd=str(__import__("tests").__path__[0] + "/.."))
    try:
        ref_url, build_url = servers.stdout.readline().split()
        common = [str(text), "--top-k", "8", "--window", "64", "--stride", "32", "--max-tokens", "300"]
        saved = run_cli("eval", "kld", "--url", ref_url, "--save-reference", str(tmp_path / "ref.jsonl"), *common,
                        "--json")
        assert saved.returncode == 0, saved.stderr
        res = run_cli("eval", "kld", "--url", build_url, "--reference", str(tmp_path / "ref.jsonl"), *common,
                      "--out", str(tmp_path / "k.jsonl"), "--json")
        assert res.returncode == 0, res.stderr
        doc = json.loads(res.stdout)
        assert doc["kind"] == "kld" and doc["positions"] == 300 and doc["kld"]["mean"] > 0
        assert doc["histogram"] and (tmp_path / "k.png").is_file()
        human = run_cli("eval", "kld", "--url", build_url, "--reference", str(tmp_path / "ref.jsonl"), *common,
                        "--out", str(tmp_path / "k.jsonl"))
        assert human.returncode == 0 and "lower bound" in human.stdout and "same top token" in human.stdout
        both = run_cli("eval", "kld", "--url", build_url, "--reference", "r.jsonl", "--reference-url", ref_url)
        assert both.returncode == 2 and "not both" in both.stderr
        none = run_cli("eval", "kld", "--url", build_url)
        assert none.returncode == 2 and "nothing to compare against" in none.stderr
    finally:
        servers.kill()
        servers.wait()
