"""MTP speculative decoding of the tiny GLM-5.3-Flash on vLLM CPU with the glmctl plugin.

`--speculative-config '{"method": "mtp", "num_speculative_tokens": 3}'`: the checkpoint's MTP layer
drafts three tokens per step and the target verifies four tokens per request (KDA spec-decode state
columns, multi-token indexer decode, sparse MLA over each token's own selection). One extra server
start for this module; the plain server is the lane's shared `tiny_server`.
"""

from __future__ import annotations

import re

import pytest

from tests.vllm.plugin_servers import start_server
from tests.vllm.test_plugin_serving import PARITY_PROMPTS

pytestmark = pytest.mark.vllm

TOKENS = 16
# The tiny random model's own bf16 noise floor (99th percentile of transformers' fp32-vs-bf16
# prompt-logprob differences, see test_plugin_serving): below this margin two correct bf16
# implementations may pick different greedy tokens.
NEAR_TIE = 0.6


@pytest.fixture(scope="module")
def mtp_server(tiny_checkpoint, tmp_path_factory):
    srv = start_server(
        tiny_checkpoint.path, tmp_path_factory.mktemp("mtp") / "vllm.log",
        "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}',
    )
    yield srv
    srv.stop()


def _greedy(server, prompt: str) -> list[tuple[int, float]]:
    """(token id, top-1 margin in nats) of each greedy step."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0,
            "logprobs": 2, "return_tokens_as_token_ids": True}
    lp = server.post("/v1/completions", body)["choices"][0]["logprobs"]
    steps = []
    for token, top in zip(lp["tokens"], lp["top_logprobs"], strict=True):
        values = sorted(top.values(), reverse=True)
        steps.append((int(token.split(":", 1)[1]), values[0] - values[1]))
    return steps


def test_mtp_greedy_output_is_the_plain_greedy_output(mtp_server, tiny_server):
    same_total = 0
    for name, prompt in PARITY_PROMPTS.items():
        plain, spec = _greedy(tiny_server, prompt), _greedy(mtp_server, prompt)
        same = 0
        for (want, margin), (got, spec_margin) in zip(plain, spec, strict=True):
            if got != want:
                # Only a near-tie (for both servers) may resolve differently.
                assert min(margin, spec_margin) <= NEAR_TIE, (name, same, want, got, margin)
                break
            same += 1
        print(f"{name}: MTP-3 and plain greedy agree on {same}/{TOKENS} tokens")
        same_total += same
    assert same_total >= 3 * TOKENS


def test_mtp_server_drafts_and_verifies(mtp_server):
    mtp_server.post("/v1/completions", {"model": "tiny", "prompt": "import os", "max_tokens": 8,
                                        "temperature": 0})
    text = mtp_server.get("/metrics")
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total"):
        assert re.search(rf"^{re.escape(name)}\{{[^}}]*\}} [1-9]", text, re.M), name
    log = mtp_server.log_text()
    assert "MTP drafter" in log and "method='mtp'" in log
