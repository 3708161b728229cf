"""The planner's verdict in preflight: the report's commercial stack fits 8 sessions on 8x L40; a
profile that asks for more is refused with the numbers and the closest setting that fits."""

from __future__ import annotations

import json

import pytest

from glmctl import paths
from glmctl.plan import load_model_spec
from glmctl.plan.presets import PRESETS
from glmctl.serving import launch_files, preflight, profile_fit, profiles
from tests.conftest import REPO
from tests.unit.fake_gpus import gpu

L40 = [gpu(i, "NVIDIA L40", (8, 9), 44.4, 44.3) for i in range(8)]  # CUDA-visible 44.4 GiB


@pytest.fixture
def exl3_config(tmp_path):
    """A checkpoint directory holding only the real model's config, marked as EXL3 4-bit experts."""
    cfg = dict(PRESETS["glm-5.3-flash"], quantization_config={"quant_method": "exl3", "bits": 4})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def _launch(name: str, model):
    return launch_files.render(launch_files.with_paths(profiles.load(name), model=model))


def _predict(launch, gpus=None):
    return profile_fit.predict_for_checkpoint(launch.profile, launch.model_dir, gpus)


def test_commercial_fits_eight_256k_sessions_on_8xL40(exl3_config):
    verdict = _predict(_launch("commercial", exl3_config), L40)
    assert verdict.available and verdict.fits and verdict.sessions_fit == 8
    assert verdict.kv_tokens >= 8 * 262_144  # the report measured 2,847,055 for this stack


def test_asking_for_more_sessions_than_fit_names_the_closest_setting(exl3_config):
    paths.user_profiles().mkdir(parents=True)
    (paths.user_profiles() / "greedy.yaml").write_text("extends: commercial\nmax_num_seqs: 16\n")
    launch = _launch("greedy", exl3_config)
    verdict = _predict(launch, L40)
    assert verdict.available and not verdict.fits
    assert 8 <= verdict.sessions_fit < 16
    assert f"max_num_seqs {verdict.sessions_fit} at max_model_len 262,144" in verdict.closest
    per_slot = int(verdict.closest.rsplit("max_model_len ", 1)[1].split()[0].replace(",", ""))
    assert 16 * per_slot <= verdict.kv_tokens < 16 * (per_slot + 2048)
    report = preflight.PreflightReport(profile="greedy")
    report.gpus = L40
    preflight._capacity(launch, report)
    [finding] = report.failures
    assert finding.usage and f"{verdict.kv_tokens:,} KV tokens" in finding.message
    assert finding.hint == verdict.closest


def test_too_few_gpus_for_one_request_says_so(exl3_config):
    verdict = _predict(_launch("commercial", exl3_config), [gpu(i, "RTX 4090", (8, 9), 23.6, 23.5)
                                                            for i in range(8)])
    assert verdict.available and not verdict.fits and verdict.kv_tokens == 0
    assert "not even one request of 262,144 tokens" in verdict.note or "rejects" in verdict.note
    assert verdict.closest


def test_no_prediction_for_a_model_the_planner_does_not_know(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    verdict = _predict(_launch("tiny-cpu", tmp_path))
    assert not verdict.available and "cannot plan this checkpoint" in verdict.note


def test_no_gpus_no_prediction(exl3_config):
    verdict = _predict(_launch("commercial", exl3_config), [])
    assert not verdict.available and "no GPUs" in verdict.note


def test_a_fixed_kv_space_is_planned_as_vllm_splits_it(tmp_path):
    """`kv-cache-memory-bytes` (the gpu lane's tiny-gpu profile): vLLM skips its memory profile
    and splits exactly that space, so the prediction is the planner's for that fixed space."""
    from glmctl.plan import gpu_node, plan_capacity
    from glmctl.testing.tiny_checkpoint import TinySpec, hf_config

    (tmp_path / "config.json").write_text(json.dumps(hf_config(TinySpec(), {"stop_token_ids": [0], "pad_token_id": 0})))
    launch = _launch(str(REPO / "tests" / "gpu" / "tiny-gpu.yaml"), tmp_path)
    h200 = [gpu(0, "NVIDIA H200", (9, 0), 139.8, 139.0)]
    verdict = _predict(launch, h200)
    fixed = launch.profile.vllm_args["kv-cache-memory-bytes"]
    model = load_model_spec(tmp_path)
    node = gpu_node(num_gpus=1, gpu_memory_gib=h200[0].total_gib, kv_cache_gib=fixed / 2**30)
    assert profile_fit.profile_node(launch.profile, h200) == node
    expected = plan_capacity(model, node, profile_fit.profile_setup(launch.profile, model))
    assert verdict.available and verdict.fits and verdict.kv_tokens == expected.kv_tokens
    assert expected.kv_pool_bytes == fixed
    assert profile_fit._size_bytes("1G") == 2**30 and profile_fit._size_bytes("1g") == 10**9
    assert profile_fit._size_bytes("1073741824") == profile_fit._size_bytes(2**30) == 2**30
    assert profile_fit._size_bytes(None) is None and profile_fit._size_bytes("lots") is None
