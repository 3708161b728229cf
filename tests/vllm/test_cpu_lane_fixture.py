"""The CPU lane's prompt log-probabilities of the tiny checkpoint, committed for the gpu lane.

One subprocess runs vLLM CPU with the glmctl plugin offline (`tests/gpu/vllm_lane_engine.py`, the
engine runner the gpu lane uses on CUDA) three times, with bf16, `fp8` and `fp8_ds_mla` KV
caches, on the fixture's prompts (tests/vllm/lane_fixture.py); another runs transformers 5.24's
`glm5_next` in fp32 and bf16 on the same token ids. Checked here, with the lanes' noise-floor rule
(tests/vllm/noise_floor.py):
  - vLLM CPU (bf16 KV) against transformers fp32, within transformers' own bf16-vs-fp32 spread;
  - both FP8 KV layouts against bf16 KV within the CPU lane's FP8 bounds;
  - this run against the committed fixture: the same weights (tensor digest), transformers fp32
    to 1e-3 nats, and every vLLM run within the floor counted once per side (the fixture may come
    from another CPU, whose kernels round differently: vLLM CPU's AVX2 and AVX-512 builds swap
    different MoE experts at routing near-ties, so, as everywhere in the lanes, each prompt's own
    bounds count the positions whose fp32 routing is decisive and the pooled bounds count all).
The gpu lane (tests/gpu/test_vllm_lane_gpu.py) compares vLLM on CUDA with the same file.

    GLMCTL_UPDATE_FIXTURES=1 pytest tests/vllm/test_cpu_lane_fixture.py   # rewrite this host's from this run

The fixture is per CPU kind (`lane_fixture.host_fixture`): the AMX one (CI's hosts) is the gpu
lane's reference; another ISA's holds the same prompts' token ids and is written on such a host.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from tests.conftest import REPO
from tests.vllm import lane_fixture, noise_floor
from tests.vllm.subprocess_report import run_report

pytestmark = pytest.mark.vllm
UPDATE = os.environ.get("GLMCTL_UPDATE_FIXTURES") == "1"
ENGINE = REPO / "tests" / "gpu" / "vllm_lane_engine.py"
REFERENCE = REPO / "tests" / "gpu" / "vllm_lane_reference.py"


def cpu_engine_args(kv_cache_dtype: str) -> dict:
    """vLLM CPU as the lane runs it: bf16, eager, 4k context, any number of logprobs."""
    return {"dtype": "bfloat16", "max_model_len": 4096, "enforce_eager": True, "seed": 0, "max_logprobs": -1,
            "kv_cache_dtype": kv_cache_dtype}


@pytest.fixture(scope="module")
def committed():
    """This host's fixture (`lane_fixture.host_fixture`: vLLM CPU's AMX and AVX-512 kernels round
    differently enough to part at the marginal prompts), None when it is to be written."""
    path = lane_fixture.host_fixture()
    return None if UPDATE or not path.exists() else lane_fixture.load(path)


@pytest.fixture(scope="module")
def cpu_run(tiny_checkpoint, committed, tmp_path_factory):
    path = str(tiny_checkpoint.path)
    # every host's fixture holds the canonical (AMX) fixture's token ids; rewriting that one tokenizes anew
    rewrite_canonical = UPDATE and lane_fixture.host_isa() == "amx"
    canonical = lane_fixture.load() if lane_fixture.FIXTURE.exists() and not rewrite_canonical else None
    source = committed or canonical
    ids = lane_fixture.prompt_ids(source) if source else lane_fixture.tokenize(path)
    tmp = tmp_path_factory.mktemp("cpu-lane-fixture")
    engine = {"checkpoint": path, "engines": [
        {"label": dtype, "llm": cpu_engine_args(dtype), "prompts": ids, "prompt_logprobs": list(ids)}
        for dtype in lane_fixture.KV_CACHE_DTYPES]}
    reference = {"device": "cpu", "checkpoints": [
        {"label": "bf16", "path": path, "dtypes": ["float32", "bfloat16"], "prompts": ids}]}
    (tmp / "engine.json").write_text(json.dumps(engine))
    (tmp / "reference.json").write_text(json.dumps(reference))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    started = time.perf_counter()
    vllm_report = run_report([str(ENGINE), str(tmp / "engine.json")], timeout=1500, stderr_tail=6000)
    ref = run_report([str(REFERENCE), str(tmp / "reference.json")], timeout=900)["checkpoints"]["bf16"]
    print(f"\nvLLM CPU x3 and transformers x2 on {sum(len(v) - 1 for v in ids.values())} scored tokens: "
          f"{time.perf_counter() - started:.0f} s")
    return {
        "ids": ids,
        "weights_sha256": lane_fixture.weights_sha256(path),
        "vllm": {d: vllm_report["engines"][d]["prompt_logprobs"] for d in lane_fixture.KV_CACHE_DTYPES},
        "vllm_version": vllm_report["vllm_version"], "torch_version": vllm_report["torch_version"],
        "fp32": ref["float32"], "bf16": ref["bfloat16"], "routing_gap": ref["routing_gap"],
    }


def test_cpu_vllm_meets_the_noise_floor_against_transformers(cpu_run):
    check = noise_floor.logprob_parity(cpu_run["vllm"]["auto"], cpu_run["fp32"], cpu_run["fp32"], cpu_run["bf16"],
                                       routing_gaps=cpu_run["routing_gap"])
    print("vLLM CPU vs transformers fp32:", check.summary())
    assert check.passed, check.failures


@pytest.mark.parametrize("dtype", ["fp8", "fp8_ds_mla"])
def test_fp8_kv_stays_within_the_cpu_lanes_fp8_bounds(cpu_run, dtype):
    check = noise_floor.fp8_kv_parity(cpu_run["vllm"][dtype], cpu_run["vllm"]["auto"])
    print(f"{dtype} vs bf16 KV:", check.summary())
    assert check.passed, check.failures


def test_this_run_matches_the_committed_fixture(cpu_run, committed, tiny_checkpoint):
    if committed is None:
        fixture = {
            "what": "tests/vllm/test_cpu_lane_fixture.py: the tiny checkpoint's prompt log p (tokens 1..n-1) on "
                    "vLLM CPU with the glmctl plugin (bf16 weights, three KV caches) and in transformers",
            "checkpoint": {"seed": tiny_checkpoint.seed, "weights_sha256": cpu_run["weights_sha256"]},
            "made_with": {"vllm": cpu_run["vllm_version"], "torch": cpu_run["torch_version"],
                          "engine": cpu_engine_args("KV"), "isa": lane_fixture.host_isa()},
            "prompts": {n: {"text": lane_fixture.PROMPTS[n], "ids": ids} for n, ids in cpu_run["ids"].items()},
            "transformers": {"float32": _rounded(cpu_run["fp32"]), "bfloat16": _rounded(cpu_run["bf16"])},
            "vllm_cpu": {d: _rounded(v) for d, v in cpu_run["vllm"].items()},
        }
        target = lane_fixture.host_fixture()
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(fixture, indent=1) + "\n")
        pytest.skip(f"wrote {target.relative_to(REPO)} from this run (commit it)")
    assert committed["checkpoint"]["weights_sha256"] == cpu_run["weights_sha256"], (
        "the tiny checkpoint's weights changed: rerun with GLMCTL_UPDATE_FIXTURES=1 and commit the fixture")
    fp32_moved = max(float(np.abs(np.asarray(cpu_run["fp32"][n]) - np.asarray(v)).max())
                     for n, v in committed["transformers"]["float32"].items())
    assert fp32_moved <= 1e-3, fp32_moved
    for dtype, values in committed["vllm_cpu"].items():
        check = noise_floor.logprob_parity(cpu_run["vllm"][dtype], values, cpu_run["fp32"], cpu_run["bf16"], sides=2,
                                           routing_gaps=cpu_run["routing_gap"])
        print(f"{dtype}: this run vs the fixture:", check.summary())
        assert check.passed, (dtype, check.failures)


def _rounded(values: dict) -> dict:
    return {n: [round(float(x), 5) for x in v] for n, v in values.items()}
