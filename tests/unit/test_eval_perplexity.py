"""Perplexity: window planning edge cases, the maths against a server whose log-probs are known,
paired baselines, and the CLI's errors. The server is tests.fake_server (no vLLM)."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from glmctl.errors import UsageError
from glmctl.evals import perplexity as ppl
from glmctl.evals import stats
from glmctl.evals.client import ContextTooLong, OpenAIServer, ServerError
from glmctl.evals.corpus import SourceText, stdlib_text
from glmctl.evals.tokenizer import ServerTokenizer, prefix_added
from tests.fake_server import FakeEngine, FakeServer, encode, logprob


def _coverage(windows, n, window, stride, has_prefix):
    """Every token scored exactly once, in order, each with enough context; windows never too long."""
    scored = []
    for k, w in enumerate(windows):
        assert 0 <= w.start <= w.score_from < w.end <= n
        assert w.end - w.start <= window
        if k:
            assert w.score_from - w.start >= min(window - stride, w.score_from)  # context kept
            assert w.score_from == windows[k - 1].end
        if not has_prefix:
            assert w.score_from > w.start  # a token without BOS needs one token before it
        scored.extend(range(w.score_from, w.end))
    assert scored == list(range(0 if has_prefix else 1, n))


@pytest.mark.parametrize("has_prefix", [True, False])
def test_windows_score_every_token_once_with_context(has_prefix):
    rng = random.Random(7)
    for _ in range(300):
        window = rng.randint(3, 60)
        stride = rng.randint(1, window - (0 if has_prefix else 1))
        n = rng.randint(2, 400)
        windows = ppl.plan_windows(n, window, stride, has_prefix=has_prefix)
        _coverage(windows, n, window, stride, has_prefix)


def test_text_shorter_than_a_window_is_one_window():
    assert ppl.plan_windows(10, 64, 32, has_prefix=True) == [ppl.Window(0, 10, 0)]
    assert ppl.plan_windows(10, 64, 32, has_prefix=False) == [ppl.Window(0, 10, 1)]


def test_last_window_is_aligned_to_the_end_and_full_length():
    windows = ppl.plan_windows(100, 40, 25, has_prefix=True)
    assert [(w.start, w.end, w.score_from) for w in windows] == [(0, 40, 0), (25, 65, 40), (50, 90, 65), (60, 100, 90)]


def test_disjoint_windows_need_a_bos():
    windows = ppl.plan_windows(100, 25, 25, has_prefix=True)
    assert [(w.start, w.score_from) for w in windows] == [(0, 0), (25, 25), (50, 50), (75, 75)]
    with pytest.raises(UsageError, match="without context"):
        ppl.plan_windows(100, 25, 25, has_prefix=False)


@pytest.mark.parametrize(("n", "window", "stride", "prefix", "match"), [
    (100, 10, 0, True, "between 1 and"),
    (100, 10, 11, True, "between 1 and"),
    (100, 1, 1, False, "too small"),
    (1, 8, 4, False, "nothing to score"),
    (0, 8, 4, True, "nothing to score"),
])
def test_bad_windowing_is_a_usage_error(n, window, stride, prefix, match):
    with pytest.raises(UsageError, match=match):
        ppl.plan_windows(n, window, stride, has_prefix=prefix)


def test_prefix_added_finds_bos_and_ignores_eos():
    assert prefix_added([2, 10, 11, 1], [10, 11]) == [2]
    assert prefix_added([7, 8, 10, 11], [10, 11]) == [7, 8]
    assert prefix_added([10, 11], [10, 11]) == []


def test_batch_means_stderr_is_larger_than_naive_for_correlated_tokens():
    rng = np.random.default_rng(0)
    iid = rng.normal(size=8192)
    naive = np.std(iid, ddof=1) / math.sqrt(len(iid))
    assert stats.batch_means_stderr(iid) == pytest.approx(naive, rel=0.35)
    blocky = np.repeat(rng.normal(size=256), 32)  # runs of 32 equal values: strongly correlated
    assert stats.batch_means_stderr(blocky) > 3 * np.std(blocky, ddof=1) / math.sqrt(len(blocky))


def _expected_nll(ids: list[int], prefix: list[int]) -> np.ndarray:
    """The fake model conditions on the previous token only, so the answer is closed-form."""
    seq = prefix + ids
    return np.array([-logprob(seq[i - 1], seq[i]) for i in range(len(prefix) or 1, len(seq))])


@pytest.fixture
def engine():
    return FakeEngine(max_model_len=1024)


@pytest.fixture
def fake(engine):
    with FakeServer(engine) as url:
        server = OpenAIServer(url)
        server.connect()
        yield server
        server.close()


SMALL = SourceText("def f(x):\n    return x + 1\n" * 40 + "café ✓\n", "files", ("t.py",), None)


@pytest.mark.parametrize("bos", ["auto", "none"])
def test_perplexity_matches_the_closed_form(fake, engine, bos):
    tok = ServerTokenizer(fake)
    r = ppl.measure(fake, tok, SMALL, window=64, stride=24, bos=bos, max_tokens=700)
    ids = encode(SMALL.text)[:700]
    prefix = [2] if bos == "auto" else []
    nll = _expected_nll(ids, prefix)
    assert r.windowing.prefix_ids == prefix
    assert r.tokens_scored == len(nll) == (700 if prefix else 699)
    assert r.perplexity == pytest.approx(math.exp(nll.mean()), rel=1e-9)
    assert r.logprobs == pytest.approx(list(-nll), abs=1e-12)
    scored_text = SMALL.text[:700] if prefix else SMALL.text[1:700]
    assert r.bytes_scored == len(scored_text.encode())  # "é" and "✓" are several bytes each
    assert r.bits_per_byte == pytest.approx(nll.sum() / math.log(2) / r.bytes_scored)
    assert 0 < r.perplexity_stderr < r.perplexity
    sent = [q for q in engine.requests if q["path"] == "/v1/completions"]
    assert all(len(q["prompt"]) <= 64 + len(prefix) and q["prompt_logprobs"] == 0 for q in sent)
    assert r.windowing.windows == len(sent)


def test_default_window_fits_the_server(fake):
    r = ppl.measure(fake, ServerTokenizer(fake), stdlib_text(), max_tokens=3000)
    assert r.windowing.window == 1024 - 1 - 1 and r.windowing.stride == r.windowing.window // 2
    assert r.text.python_version and r.text.files[0] == "textwrap.py"


def test_window_longer_than_max_model_len_says_both_numbers(fake):
    with pytest.raises(ContextTooLong, match=r"2,050 tokens, more than the server's max_model_len of 1,024"):
        ppl.measure(fake, ServerTokenizer(fake), SMALL, window=2048)


def test_paired_baseline_gives_the_relative_change_with_an_interval(fake):
    base = ppl.measure(fake, ServerTokenizer(fake), SMALL, window=64, stride=32)
    same = ppl.compare(base, base, "b.json")
    assert same.relative_change_percent == 0 and same.ci95_low_percent == same.ci95_high_percent == 0
    with FakeServer(FakeEngine(max_model_len=1024, logprob_shift=0.0026)) as url:
        worse_server = OpenAIServer(url)
        worse_server.connect()
        worse = ppl.measure(worse_server, ServerTokenizer(worse_server), SMALL, window=64, stride=32)
    cmp = ppl.compare(worse, base, "b.json")
    assert cmp.relative_change_percent == pytest.approx(100 * math.expm1(0.0026), rel=1e-6)  # the report's +0.26%
    assert cmp.ci95_low_percent <= cmp.relative_change_percent <= cmp.ci95_high_percent
    assert "+0.26%" in cmp.describe()


def test_baseline_with_other_windows_or_text_is_refused(fake):
    tok = ServerTokenizer(fake)
    base = ppl.measure(fake, tok, SMALL, window=64, stride=32)
    with pytest.raises(UsageError, match="--window 64 --stride 32"):
        ppl.compare(ppl.measure(fake, tok, SMALL, window=64, stride=16), base, "b.json")
    other = SourceText(SMALL.text.replace("x + 1", "x + 2"), "files", ("t.py",), None)
    with pytest.raises(UsageError, match="scored different tokens"):
        ppl.compare(ppl.measure(fake, tok, other, window=64, stride=32), base, "b.json")


def test_a_server_that_scores_other_tokens_is_caught(fake, monkeypatch):
    def shifted(self, ids):
        return [None] + [{str(t + 1): {"logprob": -1.0}} for t in ids[1:]]

    monkeypatch.setattr(FakeEngine, "prompt_logprobs", shifted)
    with pytest.raises(ServerError, match="different token than was sent"):
        fake.prompt_logprobs([2, 30, 31])


def _flat(text: str) -> str:
    return " ".join(text.split())  # Rich wraps lines at the terminal width


def test_cli_perplexity_json_and_baseline(run_cli, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text(SMALL.text)
    with FakeServer(FakeEngine(max_model_len=512)) as url:
        first = run_cli("eval", "perplexity", str(src), "--url", url, "--window", "128", "--json",
                        "--out", str(tmp_path / "base.json"))
        assert first.returncode == 0, first.stderr
        doc = json.loads(first.stdout)
        scored = len(f"# ---- {src / 'a.py'} ----\n") + len(SMALL.text)  # each file follows a header line
        assert doc["kind"] == "perplexity" and doc["tokens_scored"] == scored
        assert doc["windowing"]["window"] == 128 and doc["windowing"]["stride"] == 64
        assert "logprobs" not in doc and len(json.loads((tmp_path / "base.json").read_text())["logprobs"]) == scored
        again = run_cli("eval", "perplexity", str(src), "--url", url, "--window", "128",
                        "--baseline", str(tmp_path / "base.json"))
        assert again.returncode == 0, again.stderr
        assert "vs baseline" in _flat(again.stdout) and "+0.00%" in _flat(again.stdout)
        too_long = run_cli("eval", "perplexity", str(src), "--url", url, "--window", "4096")
        assert too_long.returncode == 2 and "max_model_len of 512" in _flat(too_long.stderr)
        wrong = run_cli("eval", "perplexity", "--url", url, "--model", "glm-5.3-flash")
        assert wrong.returncode == 2 and "serves 'fake-model', not 'glm-5.3-flash'" in _flat(wrong.stderr)
        bad_base = run_cli("eval", "perplexity", str(src), "--url", url, "--baseline", str(src / "a.py"))
        assert bad_base.returncode == 2 and "is not JSON" in _flat(bad_base.stderr)
    gone = run_cli("eval", "perplexity", "--url", url)
    assert gone.returncode == 1 and "no server answers at" in _flat(gone.stderr)


def test_url_or_profile_exactly_one(run_cli):
    proc = run_cli("eval", "perplexity")
    assert proc.returncode == 2 and "exactly one of --url" in _flat(proc.stderr)
