"""eval kld against real vLLM servers (CPU): the lane's tiny checkpoint served in two configurations.

The tiny GLM-5.3-Flash checkpoint with bf16 KV and with FP8 KV (or, where the lane serves the tiny
Llama instead, GLMCTL_TEST_TINY_MODEL=llama, bf16 and float32 weights). The two servers run one
after the other (tests/vllm/plugin_servers.py, never both at once): the first scores itself through
both of its roles (two-server mode: KLD 0 within float noise) and saves reference tables; the
second is then compared with those tables. With K = the whole vocabulary the bound is the exact KL,
checked against KL computed here directly from the two servers' raw full-vocabulary responses; at
K = 20 it stays below that exact value.
"""

from __future__ import annotations

import json
import math
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from glmctl.evals import kld as kl
from glmctl.evals import kld_table as kt
from glmctl.evals.client import OpenAIServer
from glmctl.evals.corpus import stdlib_text
from glmctl.evals.tokenizer import ServerTokenizer
from tests.vllm.plugin_servers import start_server

pytestmark = pytest.mark.vllm

SECOND_CONFIG = {"glm": ("--kv-cache-dtype", "fp8"), "llama": ("--dtype", "float32")}
PLAN20 = {"window": 128, "stride": 64, "max_tokens": 512}
PLAN_FULL = {"window": 32, "stride": 16, "max_tokens": 64}


def _vocab(checkpoint: Path) -> int:
    config = json.loads((checkpoint / "config.json").read_text())
    return int(config.get("text_config", config).get("vocab_size") or config["vocab_size"])


def _raw_full(url: str, plan: kt.TokenPlan, vocab: int) -> list[np.ndarray]:
    """Per scored position, the full-vocabulary log-probabilities, read straight from vLLM's JSON."""
    out = []
    for w in plan.windows:
        body = {"model": "tiny", "prompt": plan.window_ids(w), "max_tokens": 1, "temperature": 0,
                "prompt_logprobs": vocab}
        req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            entries = json.loads(r.read())["choices"][0]["prompt_logprobs"]
        first = len(plan.prefix) + (w.score_from - w.start)
        for entry in entries[first:]:
            lp = np.full(vocab, -np.inf)
            for tok, item in entry.items():
                lp[int(tok)] = item["logprob"]
            out.append(lp)
    return out


def _client(url: str) -> OpenAIServer:
    server = OpenAIServer(url, timeout=300)
    server.connect()
    return server


@pytest.fixture(scope="module")
def bf16(tiny_launch_target, tmp_path_factory):
    """Everything the first (bf16) server has to give, gathered before it stops."""
    _, checkpoint = tiny_launch_target
    vocab = _vocab(checkpoint)
    tmp = tmp_path_factory.mktemp("kld-bf16")
    srv = start_server(checkpoint, tmp / "vllm.log")
    try:
        server = _client(srv.url)
        tok, text = ServerTokenizer(server), stdlib_text()
        self_report = kl.run(server, tok, text, out=tmp / "self.jsonl", reference_server=server,
                             reference_tokenizer=tok, top_k=20, **PLAN20)
        kl.save_reference(server, tok, text, path=tmp / "ref20.jsonl", top_k=20, **PLAN20)
        kl.save_reference(server, tok, text, path=tmp / "ref-full.jsonl", top_k=vocab, **PLAN_FULL)
        plan_full = kt.plan_tokens([server], tok, text, bos="auto", **PLAN_FULL)
        raw = _raw_full(srv.url, plan_full, vocab)
        server.close()
    finally:
        srv.stop()
    return {"self": self_report, "ref20": tmp / "ref20.jsonl", "ref_full": tmp / "ref-full.jsonl", "raw": raw,
            "plan_full": plan_full, "vocab": vocab}


@pytest.fixture(scope="module")
def fp8(bf16, tiny_launch_target, tmp_path_factory):
    """The second configuration against the first one's saved tables."""
    kind, checkpoint = tiny_launch_target
    tmp = tmp_path_factory.mktemp("kld-second")
    srv = start_server(checkpoint, tmp / "vllm.log", *SECOND_CONFIG[kind])
    try:
        server = _client(srv.url)
        tok, text = ServerTokenizer(server), stdlib_text()
        k20 = kl.run(server, tok, text, out=tmp / "k20.jsonl", reference_file=bf16["ref20"], top_k=20, **PLAN20)
        full = kl.run(server, tok, text, out=tmp / "full.jsonl", reference_file=bf16["ref_full"], top_k=bf16["vocab"],
                      **PLAN_FULL)
        full_at_20 = kl.run(server, tok, text, out=tmp / "full20.jsonl", reference_file=bf16["ref_full"], top_k=20,
                            **PLAN_FULL)
        raw = _raw_full(srv.url, bf16["plan_full"], bf16["vocab"])
        server.close()
    finally:
        srv.stop()
    return {"k20": k20, "full": full, "full_at_20": full_at_20, "raw": raw}


def _per_position(report) -> np.ndarray:
    _, windows = kl.read_results(Path(report.results_file))
    return kl._stats_of([w for _, w in sorted(windows.items())]).kld


def test_a_server_against_itself_is_zero(bf16):
    r = bf16["self"]
    assert r.positions == 512 - r.settings.windowing.first_scored_token and r.kld.max < 1e-6
    assert r.same_top_percent == 100.0 and abs(r.ln_ratio) < 1e-9


def test_another_config_is_positive_and_matches_the_direct_computation(bf16, fp8):
    exact = np.array([float(np.sum(np.exp(p) * (p - q)))
                      for p, q in zip(bf16["raw"], fp8["raw"], strict=True)])
    full = _per_position(fp8["full"])
    assert len(full) == len(exact) == bf16["plan_full"].positions
    np.testing.assert_allclose(full, np.maximum(exact, 0.0), rtol=1e-6, atol=1e-10)  # KL >= 0
    assert exact.mean() > 0  # the second configuration moves the distributions (bf16 vs fp32: ~1e-6 nats)
    at20 = _per_position(fp8["full_at_20"])
    assert np.all(at20 <= exact + 1e-6)  # the top-20 bound stays below the exact value (kld_math.ROUNDING)
    assert at20.mean() > 0
    k20 = fp8["k20"]
    print(f"\nsecond config vs bf16, tiny checkpoint, {k20.positions} tokens: mean KLD (top-20 bound) "
          f"{k20.kld.mean:.3g} ± {k20.kld.stderr:.2g}, 99th pct {k20.kld.percentiles['99']:.3g}, "
          f"same top {k20.same_top_percent:.1f}%, ppl ratio {k20.perplexity_ratio:.4f}; exact mean over "
          f"{len(exact)} tokens {exact.mean():.3g}, top-20 bound there {at20.mean():.3g}")
    assert k20.kld.mean > 0 and k20.same_top_percent < 100.0 + 1e-9
    assert math.isfinite(k20.perplexity_ratio)
