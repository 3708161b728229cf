"""Bench: metrics parsing, steady-window detection, and whole runs against the fake server (no vLLM)."""

from __future__ import annotations

import json

import pytest

from glmctl.errors import UsageError
from glmctl.evals import serving_bench as b
from glmctl.evals.client import OpenAIServer, ServerError
from glmctl.evals.corpus import stdlib_text
from glmctl.evals.metrics import MetricsSample, parse_metrics, steady_window
from glmctl.evals.tokenizer import ServerTokenizer
from tests.fake_server import FakeEngine, FakeServer

VLLM_TEXT = """\
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="glm"} 1200.0
vllm:generation_tokens_total{engine="1",model_name="glm"} 800.0
vllm:generation_tokens_total{engine="0",model_name="other"} 99999.0
# HELP vllm:generation_tokens_created Number of generation tokens processed.
# TYPE vllm:generation_tokens_created gauge
vllm:generation_tokens_created{engine="0",model_name="glm"} 1.7e9
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="glm"} 64000.0
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="glm"} 2.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="glm"} 4.0
vllm:num_requests_running{engine="1",model_name="glm"} 4.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="glm"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="glm"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="glm"} 0.7
"""


def test_parse_metrics_sums_engines_of_the_model():
    s = parse_metrics(VLLM_TEXT, "glm", t=3.0)
    assert (s.generation_tokens, s.prompt_tokens, s.preemptions, s.running, s.waiting) == (2000, 64000, 2, 8, 0)
    assert s.kv_usage == pytest.approx(0.6) and s.t == 3.0
    with pytest.raises(ServerError, match="no vllm:generation_tokens_total"):
        parse_metrics("# TYPE up gauge\nup 1\n", "glm")


def _s(t, gen, running, waiting=0, prompt=1000, pre=0):
    return MetricsSample(t=t, generation_tokens=gen, prompt_tokens=prompt, preemptions=pre, running=running,
                         waiting=waiting, kv_usage=0.1)


def test_steady_window_is_the_longest_span_with_all_decoding_and_nothing_else():
    samples = [
        _s(0.0, 0, 1, waiting=3, prompt=0),  # prefills queue
        _s(1.0, 10, 2, waiting=2, prompt=500),
        _s(2.0, 30, 4, prompt=1500),  # last prefill still running: prompt counter moves next
        _s(3.0, 60, 4, prompt=2000),
        _s(4.0, 100, 4, prompt=2000),
        _s(5.0, 140, 4, prompt=2000),
        _s(6.0, 180, 4, prompt=2000, pre=1),  # a preemption splits the window
        _s(7.0, 200, 4, prompt=2000, pre=1),
        _s(8.0, 230, 3, prompt=2000, pre=1),  # a session finished
    ]
    w = steady_window(samples, 4, after=2.5, before=8.0)
    assert (w.first, w.last, w.t0, w.t1) == (3, 5, 3.0, 5.0)
    assert w.tokens_per_second == pytest.approx(40.0)
    # the client's view bounds it: nothing before the last first token or after the first last one
    assert (steady_window(samples, 4, after=4.5, before=8.0).t0, steady_window(samples, 4, after=4.5, before=8.0).t1) == (6.0, 7.0)
    assert steady_window(samples, 4, after=3.5, before=5.5).first == 4
    assert steady_window(samples, 4, after=6.5, before=7.5) is None  # one sample is not a window
    assert steady_window(samples, 5, after=0, before=9) is None


@pytest.fixture
def served():
    engines = {}

    def start(**kw):
        engine = FakeEngine(**({"max_model_len": 4096, "decode_tok_s": 150.0} | kw))
        server_cm = FakeServer(engine)
        url = server_cm.__enter__()
        client = OpenAIServer(url)
        client.connect()
        engines[client] = server_cm
        return client, engine

    yield start
    for client, server_cm in engines.items():
        client.close()
        server_cm.__exit__(None, None, None)


def _prompts(server):
    return b.PromptSource(ServerTokenizer(server), stdlib_text())


def test_counter_rate_agrees_with_client_count_and_ttft_per_session(served):
    server, engine = served(prefill_tok_s=20_000.0)
    cell = b.run_cell(server, _prompts(server), sessions=3, context=1500, output_tokens=120, poll_interval=0.05)
    assert cell.steady is not None, cell.no_steady_reason
    s = cell.steady
    assert s.samples >= 3 and s.seconds > 0
    assert abs(s.decode_tok_s - s.client_tok_s) <= 0.10 * s.client_tok_s
    assert s.per_session_tok_s == pytest.approx(s.decode_tok_s / 3)
    assert len(cell.ttft_s) == 3 and all(t is not None and t > 0 for t in cell.ttft_s)
    # one prefill at a time (75 ms each): the sessions' first tokens queue behind each other
    ordered = sorted(cell.ttft_s)
    assert ordered[2] - ordered[0] >= 0.1
    assert all(d.output_tokens == 120 and d.finish_reason == "length" for d in cell.sessions_detail)
    sent = [q for q in engine.requests if q["path"] == "/v1/completions"]
    assert all(q["ignore_eos"] and q["max_tokens"] == 120 and len(q["prompt"]) == 1500 for q in sent)
    assert len({tuple(q["prompt"][:40]) for q in sent}) == 3  # unique from the first tokens on


def test_no_steady_window_when_the_server_cannot_run_all_sessions(served):
    server, _ = served(max_num_seqs=2)
    cell = b.run_cell(server, _prompts(server), sessions=3, context=500, output_tokens=30, poll_interval=0.05)
    assert cell.steady is None and "at most 2 of 3 sessions" in cell.no_steady_reason


def test_no_steady_window_when_outputs_end_before_the_last_prefill(served):
    server, _ = served(prefill_tok_s=5_000.0, decode_tok_s=400.0)
    cell = b.run_cell(server, _prompts(server), sessions=3, context=1000, output_tokens=8, poll_interval=0.05)
    assert cell.steady is None and "raise --output-tokens" in cell.no_steady_reason


def test_context_longer_than_the_server_allows(served):
    server, _ = served(max_model_len=2048)
    with pytest.raises(UsageError, match=r"2,148 tokens, more than the server's max_model_len of 2,048"):
        b.run_bench(server, ServerTokenizer(server), _prompts(server), sessions=[1], contexts=[2000],
                    output_tokens=148)


def test_prompt_files_are_cycled_to_length(served, tmp_path):
    server, _ = served()
    files = [("a.txt", "first prompt\n" * 3), ("b.txt", "second\n")]
    src = b.PromptSource(ServerTokenizer(server), prompt_files=files)
    prompts = src.prompts(2, 200)
    assert [len(p) for p in prompts] == [200, 200]
    text0 = "".join(chr(t - 16) for t in prompts[0][1:])
    assert "session 1 of 2" in text0 and "first prompt" in text0 and "second" in text0


def test_parse_counts_and_sweep_defaults(served):
    assert b.parse_counts("8,1,4,4", "sessions") == [1, 4, 8]
    assert b.parse_counts("22k,64k", "context") == [22_000, 64_000]
    with pytest.raises(UsageError):
        b.parse_counts("0", "sessions")
    server, _ = served(max_model_len=70_000)
    assert b.sweep_contexts(server, 512) == [22_000, 64_000]
    small, _ = served(max_model_len=4096)
    with pytest.raises(UsageError, match="none of the sweep's default contexts"):
        b.sweep_contexts(small, 512)


def test_cli_sweep_json_table_and_baseline(run_cli, tmp_path, served):
    server, _ = served(decode_tok_s=300.0)
    url = server.base_url
    args = ["bench", "--url", url, "--sweep", "--sessions", "1,2", "--context", "300,600", "--output-tokens", "120",
            "--poll-interval", "0.05"]
    first = run_cli(*args, "--json", "--out", str(tmp_path / "b.json"))
    assert first.returncode == 0, first.stderr
    doc = json.loads(first.stdout)
    assert doc["kind"] == "bench" and [(c["sessions"], c["context_tokens"]) for c in doc["cells"]] == [
        (1, 300), (1, 600), (2, 300), (2, 600)]
    human = run_cli(*args, "--baseline", str(tmp_path / "b.json"))
    assert human.returncode == 0, human.stderr
    assert "steady-state decode, tok/s" in human.stdout and "vs baseline" in human.stdout
    no_sweep = run_cli("bench", "--url", url, "--sessions", "1,2")
    assert no_sweep.returncode == 2 and "--sweep" in no_sweep.stderr


def _stalling_client(stalls: int, stall_s: float):
    """An httpx-like client whose first `stalls` GETs of /metrics never answer in time."""
    import asyncio

    class Response:
        status_code = 200
        text = FakeEngine(model="m").metrics_text()

    class Client:
        calls = 0

        async def get(self, path):
            Client.calls += 1
            if Client.calls <= stalls:
                await asyncio.sleep(stall_s)
            return Response()

    return Client()


def test_metrics_scrapes_that_time_out_are_gaps_until_the_silence_limit():
    """vLLM's API server left /metrics unanswered for over 30 s while eight 227k-token prompts were
    admitted (the rank simulation on the H200): a timed-out scrape is a recorded gap and the run
    goes on; only a silence longer than the limit ends it."""
    import asyncio

    from glmctl.evals import bench_drive
    from glmctl.evals.client import ServerUnreachable

    async def run(stalls: int, limit: float):
        samples, silences, stop = [], [], asyncio.Event()
        task = asyncio.create_task(bench_drive._poll(_stalling_client(stalls, 1.0), "m", 0.01, 0.0, stop, samples,
                                                     0.05, None, {}, silences,
                                                     silence_limit=limit))
        await asyncio.sleep(0.3)
        stop.set()
        await task
        return samples, silences

    samples, silences = asyncio.run(run(stalls=2, limit=10.0))
    assert len(silences) == 2 and all(s >= 0.05 for _, s in silences) and samples
    with pytest.raises(ServerUnreachable, match="nothing for"):
        asyncio.run(run(stalls=100, limit=0.1))
