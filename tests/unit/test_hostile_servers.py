"""eval perplexity, eval needle and bench against servers that misbehave (tests.fake_server's
faults): each case asserts the exit code, the sentence, and that no valid-looking result was left."""

from __future__ import annotations

import json

import pytest

from tests.fake_server import FakeEngine, FakeServer
from tests.unit.cli_inproc import run_glmctl


@pytest.fixture
def serve():
    running = []

    def start(**kw) -> tuple[str, FakeEngine]:
        engine = FakeEngine(**({"max_model_len": 4096, "decode_tok_s": 400.0, "hang_s": 20.0} | kw))
        server = FakeServer(engine)
        running.append(server)
        return server.__enter__(), engine

    yield start
    for server in running:
        server.__exit__(None, None, None)


@pytest.fixture
def corpus(tmp_path):
    src = tmp_path / "text.txt"
    src.write_text("def add(a, b):\n    return a + b\n" * 20)
    return src


def perplexity(capsys, url, out, corpus, *extra):
    return run_glmctl(capsys, "eval", "perplexity", corpus, "--url", url, "--window", "128", "--out", out,
                      "--timeout", "3", *extra)


def bench(capsys, url, out, *extra):
    return run_glmctl(capsys, "bench", "--url", url, "--sessions", "2", "--context", "300", "--output-tokens",
                      "40", "--poll-interval", "0.05", "--out", out, "--timeout", "5", *extra)


# -- eval perplexity ------------------------------------------------------------------------------

@pytest.mark.parametrize(("faults", "code", "said"), [
    ({"/v1/completions": "500"}, 1, "HTTP 500"),
    ({"/v1/completions": "garbage"}, 1, "not JSON"),
    ({"/v1/completions": "missing"}, 1, "prompt_logprobs"),
    ({"/v1/completions": "nan"}, 1, "log p = nan"),
    ({"/v1/completions": "clamped"}, 1, "-9999"),
    ({"/tokenize": "garbage"}, 1, "not JSON"),
    ({"/tokenize": "missing"}, 1, "without a `tokens` list"),
    ({"/v1/models": "garbage"}, 1, "not JSON"),
    ({"/v1/models": "missing"}, 1, "did not return a model list"),
    ({"/v1/models": "500"}, 1, "HTTP 500"),
])
def test_perplexity_against_a_broken_server(capsys, serve, tmp_path, corpus, faults, code, said):
    url, _ = serve(faults=faults)
    out = tmp_path / "ppl.json"
    run = perplexity(capsys, url, out, corpus)
    assert run.code == code, run.text
    assert said in run.err and "unexpected error" not in run.err
    assert not out.exists()


@pytest.mark.parametrize("fault", ["hang", "trickle"])
def test_timeout_bounds_the_whole_request(capsys, serve, tmp_path, corpus, fault):
    """A byte every 0.5 s used to keep a per-read timeout from ever firing."""
    url, _ = serve(faults={"/v1/completions": fault}, trickle_s=0.5)
    out = tmp_path / "ppl.json"
    run = perplexity(capsys, url, out, corpus)
    assert run.code == 1 and "did not answer within 3 s" in run.err, run.err
    assert run.seconds < 12  # 3 s and the local work, not 20 s of trickle
    assert not out.exists()


def test_deadline_bounds_the_whole_command_and_says_so(capsys, serve, tmp_path, corpus):
    url, _ = serve(faults={"/v1/completions": "hang"})
    run = perplexity(capsys, url, tmp_path / "ppl.json", corpus, "--timeout", "60", "--deadline", "2")
    assert run.code == 1 and "--deadline of 2 s" in run.err, run.err
    assert run.seconds < 12


def test_a_stalled_model_list_is_announced_and_cut_at_the_timeout(capsys, serve, tmp_path, corpus):
    url, _ = serve(faults={"/v1/models": "hang"})
    run = perplexity(capsys, url, tmp_path / "ppl.json", corpus, "--timeout", "2")
    assert run.code == 1 and f"asking {url}" in run.err and "within 2 s" in run.err, run.err


def test_api_key_from_the_flag_or_vllms_variables_and_a_401_says_which(capsys, serve, tmp_path, corpus,
                                                                       monkeypatch):
    url, engine = serve(api_key="s3cret")
    out = tmp_path / "ppl.json"
    none = perplexity(capsys, url, out, corpus)
    assert none.code == 2 and "no API key was sent" in none.err and "--api-key" in none.err
    wrong = perplexity(capsys, url, out, corpus, "--api-key", "nope")
    assert wrong.code == 2 and "from --api-key was refused" in wrong.err
    assert "nope" not in wrong.text and not out.exists()
    monkeypatch.setenv("OPENAI_API_KEY", "wrong-too")
    monkeypatch.setenv("VLLM_API_KEY", "s3cret")  # vLLM's own variable wins
    ok = perplexity(capsys, url, out, corpus, "--json")
    assert ok.code == 0, ok.err
    assert "s3cret" not in ok.text and out.exists()
    assert out.stat().st_mode & 0o044  # a result is an ordinary file, not mkstemp's 0600
    monkeypatch.delenv("VLLM_API_KEY")
    other = perplexity(capsys, url, out, corpus)
    assert other.code == 2 and "from OPENAI_API_KEY was refused" in other.err


def test_unwritable_out_is_refused_before_anything_is_asked(capsys, serve, tmp_path, corpus):
    url, engine = serve()
    run = perplexity(capsys, url, corpus / "ppl.json", corpus)  # under a file: root cannot write there either
    assert run.code == 2 and "cannot create files in" in run.err, run.err
    assert engine.requests == []


@pytest.mark.parametrize(("url", "said"), [
    ("ftp://127.0.0.1:8000", "scheme must be http or https"),
    ("http://127.0.0.1:99999", "port 99999"),
    ("http://:8000", "names no host"),
])
def test_bad_urls_are_usage_errors(capsys, tmp_path, corpus, url, said):
    run = perplexity(capsys, url, tmp_path / "ppl.json", corpus)
    assert run.code == 2 and said in run.err, run.err
    assert "GLMCTL_DEBUG" not in run.err  # a usage error needs no traceback offer


# -- eval needle ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("faults", "said"), [
    ({"/v1/chat/completions": "500"}, "HTTP 500"),
    ({"/v1/chat/completions": "missing"}, "no choices[0].message"),
    ({"/detokenize": "missing"}, "`prompt` string"),
    ({"/tokenize": "garbage"}, "not JSON"),
])
def test_needle_against_a_broken_server_leaves_no_results_file(capsys, serve, tmp_path, faults, said):
    url, _ = serve(faults=faults, max_model_len=3000)
    out = tmp_path / "needle.jsonl"
    run = run_glmctl(capsys, "eval", "needle", "--url", url, "--lengths", "1k", "--depths", "50",
                     "--out", out, "--timeout", "3")
    assert run.code == 1 and said in run.err and "unexpected error" not in run.err, run.err
    assert not out.exists() and not out.with_suffix(".png").exists()


# -- bench ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("faults", "code", "said"), [
    ({"stream": "500"}, 1, "2 of 2 session(s) failed"),
    ({"stream": "half"}, 1, "1 of 2 session(s) failed"),
    ({"stream": "empty"}, 1, "no token received"),
    ({"stream": "garbage"}, 1, "failed"),
    ({"/metrics": "garbage"}, 1, "not Prometheus text"),
    ({"/metrics": "nan"}, 1, "counters are broken"),
    ({"/metrics": "500"}, 1, "/metrics answered HTTP 500"),
])
def test_bench_that_measured_nothing_exits_1_and_writes_nothing(capsys, serve, tmp_path, faults, code, said):
    url, _ = serve(faults=faults)
    out = tmp_path / "bench.json"
    run = bench(capsys, url, out, "--json")
    assert run.code == code, run.text
    assert said in run.err and "unexpected error" not in run.err
    assert not out.exists() and run.out == ""


def test_bench_session_streams_are_bounded_by_the_timeout(capsys, serve, tmp_path):
    url, _ = serve(faults={"stream": "trickle"}, trickle_s=0.3)
    out = tmp_path / "bench.json"
    run = bench(capsys, url, out, "--timeout", "3")
    assert run.code == 1 and "did not finish within --timeout 3 s" in run.err, run.err
    assert run.seconds < 15 and not out.exists()


def test_bench_deadline_is_the_whole_run(capsys, serve, tmp_path):
    url, _ = serve(faults={"stream": "hang"})
    run = bench(capsys, url, tmp_path / "bench.json", "--timeout", "60", "--deadline", "3")
    assert run.code == 1 and "glmctl bench did not finish within its --deadline of 3 s" in run.err, run.err
    assert run.seconds < 15


def test_bench_needs_the_servers_api_key(capsys, serve, tmp_path):
    url, _ = serve(api_key="k")
    out = tmp_path / "bench.json"
    refused = bench(capsys, url, out)
    assert refused.code == 2 and "--api-key" in refused.err and not out.exists()
    ok = bench(capsys, url, out, "--api-key", "k")
    assert ok.code == 0, ok.err
    assert json.loads(out.read_text())["cells"][0]["steady"] is not None


def test_a_sweep_with_an_unmeasured_cell_exits_1_and_says_which(capsys, serve, tmp_path):
    url, _ = serve(max_num_seqs=1)  # one at a time: two sessions never decode together
    out = tmp_path / "bench.json"
    run = run_glmctl(capsys, "bench", "--url", url, "--sweep", "--sessions", "1,2", "--context", "300",
                     "--output-tokens", "60", "--poll-interval", "0.05", "--out", out)
    assert run.code == 1, run.text
    assert "1 of 2 cell(s) measured no steady decode" in run.err and "2 x 300" in run.err
    cells = json.loads(out.read_text())["cells"]
    assert cells[0]["steady"] is not None and cells[1]["steady"] is None and cells[1]["no_steady_reason"]
