"""DFlash2 speculative decoding (the tiny DFlash2 drafter, 5 draft tokens) of the tiny GLM-5.3-Flash
on vLLM CPU with the glmctl plugin: lossless, its KV cache where the planner says, served.

`speculative_config={"method": "dflash", "model": DRAFTER, "num_speculative_tokens": 5}`: the
drafter reads the target's hidden states after layers 0 and 2 (aux hidden states the plugin adds
to GLM-5.3-Flash), projects them to its own context K/V, drafts five tokens in one pass through
DFlash2's candidate-selector walk, and the target verifies six tokens per request. One subprocess
(`dflash2_parity.py`) runs the offline engines; see there for the runs it makes.

"The same output" follows the MTP tests' rule (tests/vllm/test_plugin_mtp.py): the reference is
plain decoding in the verify step's row count (six identical requests), token for token; a
divergence only as a near-tie that plain decoding alone reproduces. The drafter's weights are
random, so its own drafts are nearly always rejected; steered drafts accept 5, 4, ..., 0 in turn.

Where the drafter's K/V lives: aliased over the target's MLA pages in a group of its own (the
placement the plugin picks for this pair) or appended to every block. Its proposals must not
depend on which (nor on a 40-block pool in which blocks keep changing hands between groups), and
vLLM's KV capacity for each equals `glmctl plan`'s.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.conftest import REPO
from tests.vllm.subprocess_report import run_report
from tests.vllm.test_plugin_mtp import assert_same_greedy
from tests.vllm.test_plugin_serving import PARITY_PROMPTS

# four offline engines, then a server: ~15-25 min on two busy cores
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(3000)]

TOKENS = 32  # the kpool boundary at 16 tokens crossed by rejected drafts, the next one reached
DRAFTS = 5
LICENSE = "dflash2-cc-by-nc-nd-4.0"


CPU_LLM = {"dtype": "bfloat16", "max_model_len": 4096, "enforce_eager": True, "seed": 0, "max_logprobs": -1,
           "disable_log_stats": False}
ENGINES = [
    {"label": "plain", "runs": ["single", "batch6"]},
    # a 40-block pool: blocks pass between the drafter's group and the target's groups all the time
    {"label": "alias_small", "dflash2": True, "llm": {"num_gpu_blocks_override": 40}, "runs": ["natural", "batched"]},
    {"label": "append", "dflash2": True, "placement": "append", "runs": ["natural", "batched"]},
    {"label": "alias", "dflash2": True, "runs": ["oracle", "sampled"]},
]


@pytest.fixture(scope="module")
def runs(tiny_checkpoint, tiny_drafter, tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    request = tmp_path_factory.mktemp("dflash2") / "request.json"
    request.write_text(json.dumps({"checkpoint": str(tiny_checkpoint.path), "drafter": str(tiny_drafter.path),
                                   "prompts": PARITY_PROMPTS, "tokens": TOKENS, "llm": CPU_LLM,
                                   "engines": ENGINES}))
    out = run_report([str(REPO / "tests" / "vllm" / "dflash2_parity.py"), str(request)], timeout=2700,
                     stderr_tail=6000)
    (request.parent / "report.json").write_text(json.dumps(out))
    print(f"DFlash2 engines' report: {request.parent / 'report.json'}")
    failed = {label: part["traceback"] for label, part in out.items() if "error" in part}
    assert not failed, failed
    return out


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_dflash2_greedy_output_is_the_plain_greedy_output(runs):
    plain = runs["plain"]
    ties = assert_same_greedy(plain["batch6"], runs["alias_small"]["natural"], plain["single"], "dflash2", TOKENS)
    print("near-ties taken differently (prompt, step, margin):", ties)
    counters = runs["alias_small"]["counters"]
    assert counters["vllm:spec_decode_num_drafts"] > 0
    assert counters["vllm:spec_decode_num_draft_tokens"] == DRAFTS * counters["vllm:spec_decode_num_drafts"]


def test_dflash2_verify_bookkeeping_for_every_number_of_accepted_drafts(runs):
    """Drafts steered to accept 5, 4, ..., 0 of 5 in turn: the output must not depend on how many
    a step accepts (KDA state columns, conv windows, the kpool ring, the drafter's context K/V)."""
    part = runs["alias"]
    per_position = part["oracle_counters"]["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_position) == DRAFTS and all(n > 0 for n in per_position), per_position
    accepted = part["oracle_counters"]["vllm:spec_decode_num_accepted_tokens"]
    assert 0 < accepted < part["oracle_counters"]["vllm:spec_decode_num_draft_tokens"]
    ties = assert_same_greedy(runs["plain"]["batch6"], part["oracle"], runs["plain"]["single"], "oracle", TOKENS)
    print("near-ties taken differently (prompt, step, margin):", ties)


def test_dflash2_drafts_with_its_candidate_selector(runs):
    """On vLLM CPU's V1 runner the drafts come from the plugin's selector walk (vLLM's V1
    proposer would take the LM head's argmax and never call the selector)."""
    assert runs["alias"]["selector_walks"] > 0


def test_drafts_do_not_depend_on_where_the_drafter_kv_lives(runs):
    """Aliased over MLA pages in a 40-block pool (blocks change groups all the time) or appended
    to every block of the default pool: the same proposals at every step, alone and batched."""
    small, append = runs["alias_small"], runs["append"]
    assert small["placement"] == "alias" and append["placement"] == "append"
    assert small["natural"] == append["natural"]
    assert small["batched"] == append["batched"]
    for name, steps in small["proposals"].items():
        assert steps == append["proposals"][name], name
        assert steps and all(len(row) == DRAFTS for step in steps for row in step), name


def test_dflash2_samples_with_temperature_on_cpu(runs):
    sampled = runs["alias"]["sampled"]
    assert sampled["tokens"] == TOKENS or sampled["finish"] == "stop", sampled


def _planned_kv_tokens(tiny_checkpoint, tiny_drafter, placement: str | None, monkeypatch) -> int:
    from glmctl.plan import (
        ServingSetup,
        WeightFormats,
        cpu_node,
        load_model_spec,
        parse_speculative,
        plan_capacity,
    )

    if placement:
        monkeypatch.setenv("GLMCTL_DFLASH2_KV", placement)
    else:
        monkeypatch.delenv("GLMCTL_DFLASH2_KV", raising=False)
    model = load_model_spec(tiny_checkpoint.path)
    setup = ServingSetup(weights=WeightFormats.for_checkpoint(model.checkpoint_quant),
                         speculative=parse_speculative(f"dflash2:{DRAFTS}", str(tiny_drafter.path)),
                         max_model_len=4096, enable_prefix_caching=False, block_size=16)
    plan = plan_capacity(model, cpu_node(1.0), setup)
    assert plan.fits and plan.drafter_kv is not None
    assert plan.drafter_kv.placement == (placement or "alias")
    return plan.kv_tokens


def test_planner_kv_tokens_equal_vllms_with_the_drafter(runs, tiny_checkpoint, tiny_drafter, monkeypatch):
    """vLLM's logged KV capacity with the drafter, aliased (the plugin's choice here) and appended,
    is `glmctl plan --speculative dflash2:5 --drafter DIR`'s; aliasing holds more tokens."""
    alias = _planned_kv_tokens(tiny_checkpoint, tiny_drafter, None, monkeypatch)
    append = _planned_kv_tokens(tiny_checkpoint, tiny_drafter, "append", monkeypatch)
    assert alias == runs["alias"]["kv_tokens"]
    assert append == runs["append"]["kv_tokens"]
    print(f"KV tokens at 1 GiB, max_model_len 4096: plain {runs['plain']['kv_tokens']:,}, DFlash2 aliased "
          f"{alias:,}, appended {append:,} ({alias / append - 1:+.1%})")
    assert alias > append


# -- served: glmctl serve with noncommercial settings, /metrics, glmctl bench -----------------


def _profile(tmp_path):
    path = tmp_path / "tiny-dflash2.yaml"
    path.write_text(textwrap.dedent(f"""\
        description: the tiny checkpoint with the tiny DFlash2 drafter, as the noncommercial profile drafts
        extends: tiny-cpu
        usage: noncommercial
        max_model_len: 4096
        speculative:
          method: dflash2
          tokens: {DRAFTS}
          drafter:
            path: null
            licenses: [{LICENSE}]
        """))
    return path


def test_serve_refuses_the_drafter_without_its_licence(tmp_path, tiny_checkpoint, tiny_drafter):
    from glmctl.errors import LicenseError
    from glmctl.serving.server import prepare

    with pytest.raises(LicenseError) as info:
        prepare(_profile(tmp_path), model=tiny_checkpoint.path, drafter=tiny_drafter.path, port=None)
    assert f"--accept-license {LICENSE}" in str(info.value) + str(getattr(info.value, "hint", ""))


@pytest.fixture(scope="module")
def served(runs, tmp_path_factory, tiny_checkpoint, tiny_drafter):
    """`glmctl serve`'s library path with the licence accepted and the full preflight, started
    after the offline engines are gone (one vLLM at a time)."""
    from glmctl.serving.server import start_server

    tmp = tmp_path_factory.mktemp("dflash2-serve")
    server = start_server(_profile(tmp), model=tiny_checkpoint.path, drafter=tiny_drafter.path, port=None,
                          accept=[LICENSE], run_dir=tmp / "run", check=True, timeout_s=900)
    try:
        yield server
    finally:
        server.stop()


def test_served_kv_is_the_preflights_prediction(served, runs):
    """The serve preflight's planner prediction (with the drafter's pages) is what vLLM allocated."""
    info = served.info
    assert info.kv is not None and info.capacity is not None and info.capacity.available
    assert info.kv.tokens == info.capacity.kv_tokens == runs["alias"]["kv_tokens"]


def test_served_greedy_is_the_offline_dflash2_greedy_and_counts_drafts(served, runs):
    import httpx

    from glmctl.evals.metrics import parse_metrics

    info = served.info
    for name, prompt in PARITY_PROMPTS.items():
        r = httpx.post(f"{info.base_url}/v1/completions", timeout=600, json={
            "model": info.model, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0,
            "return_token_ids": True})
        r.raise_for_status()
        got = r.json()["choices"][0]["token_ids"]
        # the OpenAI server's engine drafts and verifies exactly as the offline one (same settings)
        assert got == [s["token"] for s in runs["alias_small"]["natural"][name]], name
    text = httpx.get(f"{info.base_url}/metrics", timeout=30).text
    drafts = _counter(text, "vllm:spec_decode_num_drafts_total")
    draft_tokens = _counter(text, "vllm:spec_decode_num_draft_tokens_total")
    accepted = _counter(text, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and draft_tokens == DRAFTS * drafts and 0 <= accepted <= draft_tokens
    assert parse_metrics(text, info.model).generation_tokens >= len(PARITY_PROMPTS) * TOKENS


def _counter(text: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                total += s.value
    return total


def test_bench_against_the_dflash2_server(served, run_cli):
    proc = run_cli("bench", "--url", served.info.base_url, "--sessions", "2", "--context", "0.3k",
                   "--output-tokens", "48", "--poll-interval", "0.25", "--json", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    cell = doc["cells"][0]
    assert cell["sessions"] == 2 and all(d["output_tokens"] == 48 for d in cell["sessions_detail"])
