"""The glmctl plugin serves the tiny GLM-5.3-Flash checkpoint through a real `vllm serve` (vLLM CPU).

Uses the lane's shared `tiny_server` (tests/vllm/conftest.py; one start-up of ~30 s on 2 cores
for every test that needs the plain server). It proves the OpenAI API end to
end (completions with logprobs and echo, prompt_logprobs, chat, /metrics), that the plugin
activates once in every vLLM process, and parity with transformers' own glm5_next implementation.
"""

from __future__ import annotations

import re

import pytest

from tests.vllm.noise_floor import ROUTING_TIE, routing_near_tie

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
        for adapter in ("sparse-MLA backend", "kpool indexer", "mHC torch (vLLM's CPU platform)"):
            assert adapter in ln, (adapter, ln)


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


# -- parity with transformers 5.24's glm5_next ------------------------------------------------

PARITY_PROMPTS = {
    "short": "def hello(world):",
    "medium": "import os\nimport sys\n\ndef main(argv):\n    return len(argv)\n",
    "sparse-code": LONG_CODE,  # > index_topk (128) tokens: the indexer drops pools
    "sparse-text": LONG_TEXT,
}
GREEDY_TOKENS = 16


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """transformers' logprobs of every prompt token (fp32 and bf16), at every position the fp32
    routing gap (`routing_gap`, see `_routing_gap`), and the fp32 forward itself
    (`fp32_forward`)."""
    import torch
    from transformers import AutoTokenizer

    from tests.hf_reference import forward_with_routing_gaps, load_transformers_model

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint.path)
    ids = {name: tok(text)["input_ids"] for name, text in PARITY_PROMPTS.items()}
    out = {"ids": ids, "float32": {}, "bfloat16": {}, "routing_gap": {}}
    for dtype in ("float32", "bfloat16"):
        run = forward_with_routing_gaps(load_transformers_model(tiny_checkpoint.path, dtype=dtype).model)
        for name, seq in ids.items():
            lp, gap = run(seq)
            if dtype == "float32":
                out["routing_gap"][name] = gap.numpy()
                out["fp32_forward"] = run  # the greedy test scores the served paths with it
            out[dtype][name] = lp[:-1].gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
    return out


def test_prompt_logprobs_match_transformers_within_its_own_bf16_spread(server, reference):
    import numpy as np

    rows, served_all, fp32_all, bf16_all = [], [], [], []
    for name, seq in reference["ids"].items():
        body = {"model": "tiny", "prompt": seq, "max_tokens": 1, "prompt_logprobs": 0}
        plp = server.post("/v1/completions", body)["choices"][0]["prompt_logprobs"]
        served = np.array([entry[str(t)]["logprob"] for entry, t in zip(plp[1:], seq[1:], strict=True)])
        fp32 = reference["float32"][name].numpy()
        bf16 = reference["bfloat16"][name].numpy()
        diff, spread = np.abs(served - fp32), np.abs(bf16 - fp32)
        rows.append((name, len(seq), diff.mean(), diff.max(), spread.mean(), spread.max(),
                     np.corrcoef(served, fp32)[0, 1]))
        served_all.append(served)
        fp32_all.append(fp32)
        bf16_all.append(bf16)
    print("\nprompt logprobs, vLLM+glmctl (bf16) vs transformers fp32; transformers bf16 vs fp32:")
    print(f"{'prompt':<12} {'tokens':>6} {'mean|d|':>8} {'max|d|':>7} {'mean|s|':>8} "
          f"{'max|s|':>7} {'corr':>7}")
    for name, n, dmean, dmax, smean, smax, corr in rows:
        print(f"{name:<12} {n:>6} {dmean:8.4f} {dmax:7.3f} {smean:8.4f} {smax:7.3f} {corr:7.4f}")
    diff = np.abs(np.concatenate(served_all) - np.concatenate(fp32_all))
    spread = np.abs(np.concatenate(bf16_all) - np.concatenate(fp32_all))
    # Pooled over ~700 tokens (two prompts have sparse selection active): served-vs-fp32 sits at
    # transformers' own bf16-vs-fp32 noise floor.
    assert diff.mean() <= 1.5 * spread.mean() + 1e-3, (diff.mean(), spread.mean())
    assert np.quantile(diff, 0.99) <= 1.5 * np.quantile(spread, 0.99) + 1e-2
    for (name, _n, _dmean, _dmax, smean, _smax, corr), served, fp32 in zip(rows, served_all, fp32_all,
                                                                          strict=True):
        # per prompt, at the positions whose routing is decisive (see ROUTING_TIE)
        decisive = reference["routing_gap"][name][: len(fp32)] >= ROUTING_TIE
        assert decisive.sum() >= len(fp32) // 2, (name, int(decisive.sum()), len(fp32))
        dmean = float(np.abs(served - fp32)[decisive].mean())
        print(f"{name}: {int(decisive.sum())} of {len(fp32)} positions route decisively, mean|d| there {dmean:.4f}")
        assert dmean <= 2 * smean + 5e-3, name
        assert corr > 0.99, name


def test_greedy_continuations_match_where_the_reference_is_decisive(server, reference):
    """Every token of the served greedy path is transformers' fp32 greedy choice for the served
    prefix (teacher-forced, so one near-tie does not end the comparison), within the reference's
    own fp32-vs-bf16 spread (the 99th percentile of the prompt-logprob differences above: on
    this random tiny model single bf16 logprobs move by up to ~1 nat), at every step whose
    routing is decisive by twice ROUTING_TIE (a step's hidden state also carries, through
    attention, the perturbation of every earlier position whose experts swapped)."""
    import numpy as np

    spread = float(np.quantile(np.concatenate([
        np.abs(reference["bfloat16"][n] - reference["float32"][n]).numpy() for n in reference["ids"]
    ]), 0.99))
    checked_total = argmax_total = 0
    for name, seq in reference["ids"].items():
        served = served_token_ids(server, seq, GREEDY_TOKENS)
        assert len(served) == GREEDY_TOKENS, name
        lp, gap = reference["fp32_forward"](seq + served)
        shortfalls = []
        for step, got in enumerate(served):
            pos = len(seq) - 1 + step
            shortfall = float(lp[pos].max() - lp[pos, got])
            shortfalls.append(shortfall)
            if routing_near_tie(float(gap[pos])):
                continue
            assert shortfall <= spread, (name, step, got, shortfall, spread)
            checked_total += 1
            argmax_total += shortfall == 0.0
        print(f"{name}: fp32 shortfall of each served token (spread {spread:.2f}): "
              + " ".join(f"{x:.2f}" for x in shortfalls))
    # enough steps judged, and most of them transformers' own greedy choice exactly
    assert checked_total >= GREEDY_TOKENS, checked_total
    assert argmax_total >= 0.75 * checked_total, (argmax_total, checked_total)


def served_token_ids(server, prompt_ids: list[int], n: int) -> list[int]:
    body = {"model": "tiny", "prompt": prompt_ids, "max_tokens": n, "temperature": 0, "logprobs": 0,
            "return_tokens_as_token_ids": True}
    toks = server.post("/v1/completions", body)["choices"][0]["logprobs"]["tokens"]
    return [int(t.split(":", 1)[1]) for t in toks]
