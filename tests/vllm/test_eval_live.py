"""perplexity, needle and bench against a real vLLM server (CPU): the shared `tiny_server`.

That is the tiny GLM-5.3-Flash checkpoint served by `vllm serve` with the glmctl plugin, started
once per test session (tests/vllm/conftest.py). Every check goes through vLLM's real endpoints
(/tokenize, /v1/completions prompt_logprobs and streaming, /v1/chat/completions, /metrics), and the
transformers comparison loads the same weights in-process.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from glmctl.evals import needle as nd
from glmctl.evals import needle_run, serving_bench
from glmctl.evals import perplexity as ppl
from glmctl.evals.client import OpenAIServer
from glmctl.evals.corpus import stdlib_text
from glmctl.evals.tokenizer import HFTokenizer, ServerTokenizer

pytestmark = pytest.mark.vllm


@dataclass
class Live:
    url: str
    checkpoint: Path  # the weights the server serves, for transformers to load too


@pytest.fixture(scope="module")
def live(tiny_server, tiny_checkpoint):
    checkpoint = getattr(tiny_server, "checkpoint", None) or tiny_checkpoint.path
    return Live(url=tiny_server.base_url, checkpoint=Path(checkpoint))


@pytest.fixture
def server(live):
    with OpenAIServer(live.url) as client:
        client.connect()
        yield client


def _transformers_logprobs(checkpoint: Path, prefix: list[int], ids: list[int], windows, dtype: str) -> np.ndarray:
    """log p of the scored tokens of every window, computed in-process by transformers."""
    import torch

    config = json.loads((checkpoint / "config.json").read_text())
    if config.get("model_type", "").startswith("glm5_next"):
        from tests.hf_reference import load_transformers_model

        model = load_transformers_model(checkpoint, dtype=dtype).model
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype)).eval()
    out: list[float] = []
    for w in windows:
        x = torch.tensor([prefix + ids[w.start:w.end]])
        with torch.no_grad():
            logits = model(input_ids=x).logits[0].float()
        lp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, x[0, 1:, None])[:, 0]
        first = len(prefix) + (w.score_from - w.start)
        out.extend(lp[first - 1:].tolist())
    return np.asarray(out)


def test_perplexity_matches_transformers_on_the_same_windows(server, live):
    tok, source = ServerTokenizer(server), stdlib_text()
    result = ppl.measure(server, tok, source, window=256, stride=128, max_tokens=640)
    assert math.isfinite(result.perplexity) and math.isfinite(result.bits_per_byte) and result.perplexity > 1
    ids = tok.encode(source.text)[:640]
    # the model's own tokenizer, loaded here, tokenises the text exactly as the server does
    assert HFTokenizer(live.checkpoint).encode(source.text[:20_000])[:640] == ids
    prefix = result.windowing.prefix_ids
    windows = ppl.plan_windows(len(ids), 256, 128, has_prefix=bool(prefix))
    fp32 = _transformers_logprobs(live.checkpoint, prefix, ids, windows, "float32")
    bf16 = _transformers_logprobs(live.checkpoint, prefix, ids, windows, "bfloat16")
    served = np.asarray(result.logprobs)
    assert served.shape == fp32.shape == (result.tokens_scored,)
    spread = np.abs(bf16 - fp32)  # transformers against itself, fp32 vs bf16: the noise floor
    diff = np.abs(served - fp32)
    assert diff.mean() <= 2 * spread.mean() + 1e-3, (diff.mean(), spread.mean())
    assert diff.max() <= 2 * spread.max() + 1e-2, (diff.max(), spread.max())
    # log perplexity is the mean log-prob, so it may move by at most the per-token spread. (bf16's
    # own errors can cancel in the mean, seen at 1e-4 nats; a served model's need not: its KV cache
    # and kernels differ. A path biased beyond the bf16 noise still fails.)
    assert abs(math.log(result.perplexity) + fp32.mean()) <= 2 * spread.mean() + 1e-3


def test_needle_harness_places_every_needle_where_it_says(server, tmp_path):
    """A random tiny model does not retrieve anything: this checks the harness, not the model.

    For every cell the prompt rebuilt from its JSONL recipe is the prompt the server tokenised
    (same IDs, same count as vLLM's usage), the needle starts a line at the recorded token index and
    the requested depth, and the recorded score is the exact-substring score of the recorded answer.
    """
    tok, source = ServerTokenizer(server), stdlib_text()
    out = tmp_path / "needle.jsonl"
    lengths = [800, min(2000, (server.max_model_len or 4096) - 64)]
    report = needle_run.run_grid(server, tok, source, lengths=lengths, depths=[0, 50, 100], out=out,
                                 max_answer_tokens=12)
    completion = needle_run.run_grid(server, tok, source, lengths=[800], depths=[30], out=tmp_path / "c.jsonl",
                                     api="completion", kind="uuid", max_answer_tokens=12)
    cells = [*needle_run.read_results(out)[1].values(), *needle_run.read_results(tmp_path / "c.jsonl")[1].values()]
    assert len(cells) == 7 and len(report.cells) == 6 and len(completion.cells) == 1
    for cell in cells:
        ids = nd.prompt_ids(tok, cell.recipe, source)
        assert nd.ids_digest(ids) == cell.layout.prompt_sha256
        assert cell.served_prompt_tokens == cell.layout.prompt_tokens == len(ids) <= cell.recipe.length
        text = tok.decode(ids)
        at = text.find(cell.recipe.needle.line.rstrip("\n"))
        assert at > 0 and text[at - 1] == "\n"
        assert len(tok.decode(ids[: cell.layout.needle_token_index])) <= at < len(
            tok.decode(ids[: cell.layout.needle_token_index + 1]))
        tolerance = 100.0 * (cell.layout.needle_tokens + 40) / cell.layout.haystack_tokens
        assert abs(cell.layout.actual_depth_percent - cell.recipe.depth_percent) <= tolerance
        assert cell.correct == (cell.recipe.needle.value in cell.answer)
        assert nd.score_answer(f"It is {cell.recipe.needle.value}.", cell.recipe).correct
    assert report.accuracy == sum(c.correct for c in report.cells) / 6


def test_bench_counter_rate_agrees_with_the_clients_count(server):
    prompts = serving_bench.PromptSource(ServerTokenizer(server), stdlib_text())
    # Size the run to the model: the tiny Llama decodes ~10x faster than the tiny GLM on this CPU.
    # The three sessions overlap only once the last prompt is in: the first must still be decoding
    # after two more 600-token prefills (each slower than the probe's TTFT alone) and a window of
    # several polls, while decoding ~3x slower than alone (two busy cores).
    probe = serving_bench.run_cell(server, prompts, sessions=1, context=600, output_tokens=32, poll_interval=0.5)
    rate = probe.sessions_detail[0].decode_tok_s or 50.0
    ttft = probe.ttft_s[0] or 1.0
    output_tokens = int(min(max(64, rate / 3 * (3 * ttft + 4.0) * 2), (server.max_model_len or 4096) - 700))
    cell = serving_bench.run_cell(server, prompts, sessions=3, context=600, output_tokens=output_tokens, poll_interval=0.2)
    assert cell.steady is not None, cell.no_steady_reason
    s = cell.steady
    assert s.samples >= 3 and s.seconds > 0.3
    assert abs(s.decode_tok_s - s.client_tok_s) <= 0.10 * s.client_tok_s, (s.decode_tok_s, s.client_tok_s)
    assert len(cell.ttft_s) == 3 and all(t is not None and t > 0 for t in cell.ttft_s)
    for d in cell.sessions_detail:  # EOS ignored: every session decodes exactly what was asked
        assert d.output_tokens == d.usage_completion_tokens == output_tokens and d.finish_reason == "length"
        assert d.prompt_tokens == 600
    assert cell.preemptions == 0


def test_cli_reports_on_the_live_server(live, run_cli, tmp_path):
    proc = run_cli("eval", "perplexity", "--url", live.url, "--window", "128", "--max-tokens", "300", "--json",
                   timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["tokens_scored"] > 250 and doc["perplexity"] > 1
    too_long = run_cli("bench", "--url", live.url, "--context", "64k", "--sessions", "1")
    assert too_long.returncode == 2 and "max_model_len" in too_long.stderr


def test_humaneval_runs_against_the_live_server(live, run_cli, tmp_path):
    """vLLM's OpenAI server validates the request as the API does (at most four stop sequences):
    the harness's requests are accepted, and each program runs (random weights pass none)."""
    out = tmp_path / "he.jsonl"
    proc = run_cli("eval", "humaneval", "--url", live.url, "--problems", "0-1", "--max-tokens", "16",
                   "--out", str(out), "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert (doc["kind"], doc["problems"]) == ("humaneval", 2)
    assert len(out.read_text().splitlines()) == 3  # the header and one line per problem
