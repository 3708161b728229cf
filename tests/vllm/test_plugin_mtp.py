"""MTP speculative decoding of the tiny GLM-5.3-Flash on vLLM CPU with the glmctl plugin gives the
greedy output of plain decoding, token for token.

`speculative_config={"method": "mtp", "num_speculative_tokens": 3}`: the checkpoint's MTP layer
drafts three tokens per step and the target verifies four tokens per request (KDA spec-decode
state columns, multi-token indexer decode and kpool tail ring, sparse MLA over each token's own
selection). One subprocess (`mtp_parity.py`) runs a plain and an MTP engine offline, one after
the other; see there for the runs it makes.

What "the same output" means on vLLM CPU, measured: the matrix products round a decode step of
one row differently from one of several rows (bf16 partial sums), so plain decoding alone and
plain decoding in a batch of four already part ways where a greedy choice or an MoE routing
choice is a near-tie (on this checkpoint: 2 of 4 prompts within 48 tokens). MTP-3 verifies four
rows per step, so its reference is plain decoding of four identical requests: that must agree
token for token. A divergence is accepted only as a demonstrated near-tie: plain decoding alone
(another batch composition, no speculation) reaches the same token from the same prefix.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO
from tests.vllm.subprocess_report import run_report
from tests.vllm.test_plugin_serving import PARITY_PROMPTS

pytestmark = pytest.mark.vllm

TOKENS = 48  # three kpool boundaries (16 tokens) per prompt, each crossed by rejected drafts


@pytest.fixture(scope="module")
def runs(tiny_checkpoint):
    request = json.dumps({"prompts": PARITY_PROMPTS, "tokens": TOKENS})
    return run_report([str(REPO / "tests" / "vllm" / "mtp_parity.py"), str(tiny_checkpoint.path), request],
                      timeout=900, stderr_tail=6000)


def _tokens(steps):
    return [step["token"] for step in steps]


def _divergence(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def _max_logprob_gap(a, b, upto):
    """Largest difference of the chosen token's logprob over the first `upto` steps."""
    return max((abs(x["top"][0][1] - y["top"][0][1]) for x, y in zip(a[:upto], b[:upto], strict=True)),
               default=0.0)


def _assert_same_greedy(runs, mode):
    return assert_same_greedy(runs["batch4"], runs[mode], runs["single"], mode, TOKENS)


def assert_same_greedy(reference, runs, alone, mode, tokens, names=PARITY_PROMPTS):
    """Greedy `runs` equal `reference` (plain decoding in the verify step's row count) token for
    token; a divergence only as a demonstrated near-tie: plain decoding `alone` (another batch
    composition, no speculation) reaches the same token from the same prefix. Returns the
    near-ties taken (prompt, step, top-1 margin)."""
    exceptions = []
    for name in names:
        want, got, solo = (_tokens(r[name]) for r in (reference, runs, alone))
        assert len(got) == len(want) == tokens, name
        i = _divergence(want, got)
        gap = _max_logprob_gap(reference[name], runs[name], i or tokens)
        noise = _divergence(want, solo)
        print(f"{mode} {name}: first divergence from plain decoding: {i}, max "
              f"logprob difference before it {gap:.1e}; plain alone vs plain batched: {noise}")
        if i is None:
            continue
        top = reference[name][i]["top"]
        margin = top[0][1] - top[1][1]
        # Only a near-tie that plain decoding itself resolves the same way in another batch.
        assert solo[: i + 1] == got[: i + 1], (
            f"{mode} {name}: step {i} gives {got[i]}, plain decoding {want[i]} (top-1 margin "
            f"{margin:.3f} nats), and plain decoding alone does not reproduce it"
        )
        exceptions.append((name, i, margin))
    return exceptions


def test_mtp_greedy_output_is_the_plain_greedy_output(runs):
    counters = runs["mtp_counters"]
    assert counters["vllm:spec_decode_num_drafts"] > 0
    assert counters["vllm:spec_decode_num_draft_tokens"] == 3 * counters["vllm:spec_decode_num_drafts"]
    print("near-ties taken differently (prompt, step, margin):", _assert_same_greedy(runs, "mtp"))


def test_mtp_verify_bookkeeping_for_every_number_of_accepted_drafts(runs):
    """Drafts steered to accept 3, 2, 1 and 0 of 3 in turn: the output must not depend on how
    many drafts a step accepts (KDA state columns, conv windows, kpool ring, MLA rows)."""
    counters = runs["oracle_counters"]
    per_position = counters["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_position) == 3 and all(n > 0 for n in per_position), per_position
    assert 0 < counters["vllm:spec_decode_num_accepted_tokens"] < counters[
        "vllm:spec_decode_num_draft_tokens"]
    print("near-ties taken differently (prompt, step, margin):", _assert_same_greedy(runs, "oracle"))


def test_mtp_samples_with_temperature_on_cpu(runs):
    sampled = runs["sampled"]
    assert sampled["tokens"] == TOKENS or sampled["finish"] == "stop", sampled
