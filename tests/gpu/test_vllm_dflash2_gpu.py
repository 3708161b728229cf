"""DFlash2-5 on the tiny GLM-5.3-Flash inside real vLLM 0.30 on CUDA, with the glmctl plugin.

On CUDA vLLM runs the V2 model runner, so this is vLLM's own `DFlash2Speculator` (Triton selector
walk, FULL CUDA graphs of the 1 + 5 query forward) on GLM-5.3-Flash with what the plugin adds:
aux hidden states, the drafter's K/V aliased over the target's MLA pages (its own KV-cache group),
the kpool tail ring for five drafts. Cases (each one subprocess, `tests/vllm/dflash2_parity.py`,
about a minute of GPU):

  dflash2_greedy          plain decoding (alone and six copies in a batch) and DFlash2 with its own
                          and with steered drafts (5, 4, ..., 0 accepted in turn), eager: greedy
                          equal token for token to plain decoding in the verify shape, divergences
                          only as near-ties plain decoding alone reproduces (the MTP tests' rule)
  dflash2_greedy_graphed  the same with FULL CUDA graphs up to 48 tokens (8 x (1 + 5)), no
                          torch.compile, both engines graphed
  dflash2_capacity        vLLM's logged KV tokens with the drafter, prefix caching on (KDA "align"
                          mode), equal to `glmctl plan`'s for a fixed 1 GiB KV space; a sampled
                          request finishes

Run on the GPU machine with vLLM 0.30 importable and the plugin on:

    GLMCTL_PLUGIN=on VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=/tmp/vsite:$PWD \\
        python -m pytest -m gpu tests/gpu/test_vllm_dflash2_gpu.py -q -rs

Each case is also added to the JSON file named by $GLMCTL_GPU_LANE_RECORD, when set
({"name", "passed", "detail", "data"}; see `_record`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.gpu

TOKENS = 40
DRAFTS = 5
KV_BYTES = 1 << 30
PROMPTS = {
    "short": "def hello(world):",
    "code": "import os\nimport sys\n\ndef main(argv):\n    total = 0\n    for arg in argv:\n        total += len(arg)\n"
            "    return total\n\n" * 3,
    "text": "The quick brown fox jumps over the lazy dog. " * 30,  # > index_topk: the indexer drops pools
}
# the gpu lane's engine settings (bench/gpu: a fixed KV space, so the planner can predict it exactly)
GPU_LLM = {"dtype": "bfloat16", "seed": 0, "max_logprobs": -1, "disable_log_stats": False, "max_model_len": 4096,
           "max_num_seqs": 8, "max_num_batched_tokens": 4096, "gpu_memory_utilization": 0.1,
           "kv_cache_memory_bytes": KV_BYTES}
EAGER = {"enforce_eager": True, "enable_prefix_caching": False}
# FULL graphs of every uniform decode batch up to 48 tokens (8 requests x (1 + 5)); no torch.compile
GRAPHED = {"enable_prefix_caching": False,
           "compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "max_cudagraph_capture_size": 48}}


def _vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


needs_vllm = pytest.mark.skipif(not _vllm_available(), reason="needs vLLM 0.30 importable (the gpu lane's stage)")


def _record(name: str, passed: bool, detail: str, data: dict | None = None) -> None:
    """Add the case to $GLMCTL_GPU_LANE_RECORD: the lane's record helper where it exists, else the
    same entry appended to a JSON list (or to the "cases" of a JSON object) under a lock."""
    path = os.environ.get("GLMCTL_GPU_LANE_RECORD")
    if not path:
        return
    try:
        from tests.gpu.lane_record import record_case
    except ImportError:
        record_case = None
    if record_case is not None:
        record_case(name, passed, detail, data=data)
        return
    import fcntl

    entry = {"name": name, "passed": bool(passed), "detail": detail, **({"data": data} if data else {})}
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            doc = json.loads(target.read_text()) if target.exists() and target.read_text().strip() else []
        except json.JSONDecodeError:
            doc = []
        cases = doc["cases"] if isinstance(doc, dict) else doc
        cases[:] = [c for c in cases if c.get("name") != name] + [entry]
        tmp = target.with_name(f".{target.name}.{os.getpid()}")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, target)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The tiny checkpoint and drafter, built here the way the lane builds its checkpoint."""
    root = tmp_path_factory.mktemp("dflash2-gpu")
    for args in (["tiny-checkpoint", str(root / "tiny")],
                 ["tiny-drafter", str(root / "drafter"), "--target", str(root / "tiny")]):
        proc = subprocess.run([sys.executable, "-m", "glmctl", "testing", *args, "--quiet"], cwd=REPO,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "tiny", root / "drafter"


def _run(checkpoints, engines: list[dict], tmp_path, timeout: float = 540) -> tuple[dict, float]:
    tiny, drafter = checkpoints
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"checkpoint": str(tiny), "drafter": str(drafter), "prompts": PROMPTS,
                                   "tokens": TOKENS, "llm": GPU_LLM, "engines": engines}))
    env = {**os.environ, "GLMCTL_PLUGIN": os.environ.get("GLMCTL_PLUGIN", "on"),
           "VLLM_USE_FLASHINFER_SAMPLER": os.environ.get("VLLM_USE_FLASHINFER_SAMPLER", "0"),
           "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p)}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "vllm" / "dflash2_parity.py"), str(request)],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    seconds = time.monotonic() - started
    work = os.environ.get("GLMCTL_GPU_LANE_WORK")
    if work:  # the lane keeps every engine's request and output
        stem = Path(work) / f"dflash2-{tmp_path.name}"
        stem.with_suffix(".request.json").write_text(request.read_text())
        stem.with_suffix(".log").write_text(f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {proc.stderr[-3000:]}"}, seconds
    return json.loads(lines[-1][2:]), seconds


def _tokens(steps):
    return [s["token"] for s in steps]


def _first_divergence(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


TIE_NATS = 0.05  # bf16 on GPU: a top-1 margin this small is inside the kernels' rounding


def greedy_verdict(plain: dict, runs: dict, mode: str, routing_gap=None) -> tuple[bool, str, list]:
    """The MTP tests' rule: equal to plain decoding in the verify shape ("batch6"), token for
    token; a divergence only where plain decoding alone ("single") takes the same token from the
    same prefix (a near-tie resolved differently by another batch composition), where plain
    decoding's top-1 margin is under TIE_NATS and the token taken is its second choice, or where
    transformers fp32's MoE routing at that position is itself a near-tie (`routing_gap(name,
    shared tokens)` below 2 x ROUTING_TIE: bf16 noise of another batch shape may swap an expert
    there, as tests/vllm/noise_floor.py says)."""
    from tests.vllm.noise_floor import routing_near_tie

    problems, ties = [], []
    for name in PROMPTS:
        want, got, alone = _tokens(plain["batch6"][name]), _tokens(runs[name]), _tokens(plain["single"][name])
        if len(got) != len(want):
            problems.append(f"{mode} {name}: {len(got)} tokens, plain {len(want)}")
            continue
        i = _first_divergence(want, got)
        if i is None:
            continue
        top = plain["batch6"][name][i]["top"]
        margin = top[0][1] - top[1][1] if len(top) > 1 else float("inf")
        second = top[1][0] if len(top) > 1 else None
        gap = routing_gap(name, want[:i]) if routing_gap is not None else None
        if alone[: i + 1] == got[: i + 1] or (margin <= TIE_NATS and got[i] == second):
            ties.append((name, i, round(margin, 4)))
        elif routing_near_tie(gap):
            ties.append((name, i, f"routing gap {gap:.4f}"))
        else:
            problems.append(f"{mode} {name}: step {i} gives {got[i]}, plain {want[i]} (margin {margin:.3f} nats"
                            + (f", routing gap {gap:.4f}" if gap is not None else "")
                            + "), not reproduced by plain decoding alone")
    return not problems, "; ".join(problems), ties


def _routing_gaps(checkpoint: Path, ids: dict):
    """`gap(name, shared)`: transformers fp32's MoE routing gap at the position after prompt +
    `shared` (tests.hf_reference), on this GPU; None for a prompt whose ids are unknown."""
    import torch

    from tests.hf_reference import forward_with_routing_gaps, load_transformers_model

    forward = []

    def gap(name: str, shared: list[int]):
        if name not in ids:
            return None
        if not forward:
            torch.backends.cuda.matmul.allow_tf32 = False
            model = load_transformers_model(checkpoint, "float32").model.to("cuda")
            forward.append(forward_with_routing_gaps(model))
        _, gaps = forward[0](list(ids[name]) + list(shared))
        return float(gaps[-1])

    return gap


def _greedy_case(name: str, mode_llm: dict, checkpoints, tmp_path) -> None:
    engines = [{"label": "plain", "llm": mode_llm, "runs": ["single", "batch6"]},
               {"label": "dflash2", "dflash2": True, "llm": mode_llm, "runs": ["natural", "oracle"]}]
    out, seconds = _run(checkpoints, engines, tmp_path)
    data = {"seconds": round(seconds, 1)}
    try:
        assert "error" not in out, out.get("error")
        for label in ("plain", "dflash2"):
            assert "error" not in out[label], out[label].get("traceback", out[label].get("error"))
        plain, d = out["plain"], out["dflash2"]
        data.update(placement=d["placement"], kv_tokens=d["kv_tokens"], facts=d["facts"], engine_seconds=d["seconds"],
                    counters=d["counters"], oracle_counters=d.get("oracle_counters"))
        gap = _routing_gaps(checkpoints[0], d.get("ids") or plain.get("ids") or {})
        ok_n, why_n, ties_n = greedy_verdict(plain, d["natural"], "natural", gap)
        ok_o, why_o, ties_o = greedy_verdict(plain, d["oracle"], "oracle", gap)
        per_position = d["oracle_counters"]["vllm:spec_decode_num_accepted_tokens_per_pos"]
        drafts = d["counters"]["vllm:spec_decode_num_drafts"]
        checks = {
            "natural greedy = plain": (ok_n, why_n),
            "steered greedy = plain": (ok_o, why_o),
            "every acceptance count seen": (len(per_position) == DRAFTS and all(n > 0 for n in per_position),
                                            f"accepted per position {per_position}"),
            "5 draft tokens per draft": (drafts > 0 and d["counters"]["vllm:spec_decode_num_draft_tokens"]
                                         == DRAFTS * drafts, f"{drafts} drafts"),
            "drafter K/V aliased": (d["placement"] == "alias", f"placement {d['placement']}"),
        }
        failed = [f"{k}: {why}" for k, (ok, why) in checks.items() if not ok]
        detail = (f"{len(PROMPTS)} prompts x {TOKENS} tokens, natural and steered drafts = plain decoding "
                  f"(near-ties {ties_n + ties_o}); accepted per position {per_position}; "
                  f"drafter K/V {d['placement']}; {d['kv_tokens']} KV tokens; {seconds:.0f} s")
        _record(name, not failed, "; ".join(failed) if failed else detail, data)
        assert not failed, failed
    except AssertionError as exc:
        _record(name, False, f"failed: {exc}"[:2000], data)
        raise


@needs_vllm
def test_dflash2_greedy_eager(checkpoints, tmp_path):
    _greedy_case("dflash2_greedy", EAGER, checkpoints, tmp_path)


@needs_vllm
def test_dflash2_greedy_graphed(checkpoints, tmp_path):
    _greedy_case("dflash2_greedy_graphed", GRAPHED, checkpoints, tmp_path)


def planned_kv_tokens(checkpoint: Path, drafter: Path, prefix_caching: bool) -> tuple[int, dict]:
    from glmctl.plan import (
        ServingSetup,
        WeightFormats,
        gpu_node,
        load_model_spec,
        parse_speculative,
        plan_capacity,
    )

    model = load_model_spec(checkpoint)
    node = gpu_node(num_gpus=1, gpu_memory_gib=139.8, kv_cache_gib=KV_BYTES / (1 << 30))
    setup = ServingSetup(weights=WeightFormats.for_checkpoint(model.checkpoint_quant),
                         speculative=parse_speculative(f"dflash2:{DRAFTS}", str(drafter)),
                         max_model_len=GPU_LLM["max_model_len"], max_num_seqs=GPU_LLM["max_num_seqs"],
                         max_num_batched_tokens=GPU_LLM["max_num_batched_tokens"], enforce_eager=True,
                         enable_prefix_caching=prefix_caching)
    plan = plan_capacity(model, node, setup)
    return plan.kv_tokens, {"block_size": plan.setup.block_size, "fits": plan.fits, "reason": plan.reason,
                            "drafter_kv": plan.drafter_kv.model_dump() if plan.drafter_kv else None}


@needs_vllm
def test_dflash2_capacity(checkpoints, tmp_path):
    """vLLM's KV tokens with the drafter equal the planner's (prefix caching on: KDA "align")."""
    engines = [{"label": "dflash2", "dflash2": True, "llm": {"enforce_eager": True, "enable_prefix_caching": True},
                "runs": ["sampled"]}]
    out, seconds = _run(checkpoints, engines, tmp_path)
    data = {"seconds": round(seconds, 1)}
    try:
        assert "error" not in out, out.get("error")
        d = out["dflash2"]
        assert "error" not in d, d.get("traceback", d.get("error"))
        planned, plan = planned_kv_tokens(*checkpoints, prefix_caching=True)
        data.update(vllm_kv_tokens=d["kv_tokens"], planned_kv_tokens=planned, plan=plan, facts=d["facts"],
                    placement=d["placement"], sampled=d["sampled"])
        ok = d["kv_tokens"] == planned and d["placement"] == plan["drafter_kv"]["placement"]
        finished = d["sampled"]["tokens"] == TOKENS or d["sampled"]["finish"] == "stop"
        detail = (f"vLLM {d['kv_tokens']:,} KV tokens, planner {planned:,} (1 GiB, max_model_len 4096, prefix "
                  f"caching, drafter K/V {d['placement']}, block {plan['block_size']}); sampled request "
                  f"{d['sampled']}; {seconds:.0f} s")
        _record("dflash2_capacity", ok and finished, detail, data)
        assert ok, detail
        assert finished, d["sampled"]
    except AssertionError as exc:
        _record("dflash2_capacity", False, f"failed: {exc}"[:2000], data)
        raise
