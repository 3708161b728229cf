"""Preflight: artifacts, port, GPUs; and `glmctl serve`'s errors and dry run, through the CLI.

Everything here stops before vLLM would start (no vLLM import): the checks that need vLLM's
parser or a real server are in tests/vllm/test_serve.py.
"""

from __future__ import annotations

import json
import os
import socket

import numpy as np
import pytest

from glmctl.serving import launch_files, preflight, profiles
from glmctl.serving.artifacts import verify_checkpoint
from tests.unit.fake_gpus import gpu


def _checkpoint(root, shards: int = 2, index: bool = True):
    from safetensors.numpy import save_file

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"architectures": ["X"]}))
    (root / "tokenizer.json").write_text("{}")
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({f"w{i}": np.ones((4, 4), dtype=np.float32)}, str(root / name))
        weight_map[f"w{i}"] = name
    if index:
        (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return root


def test_a_complete_checkpoint_passes(tmp_path):
    rep = verify_checkpoint(_checkpoint(tmp_path / "c"))
    assert rep.ok and rep.shards == 2 and rep.tensors == 2 and rep.bytes > 0


def test_missing_directory_is_a_wrong_path_not_a_broken_file(tmp_path):
    rep = verify_checkpoint(tmp_path / "nope")
    assert rep.missing and "does not exist" in rep.problems[0]


def test_shard_missing_from_the_index_and_truncated_shard_are_named(tmp_path):
    root = _checkpoint(tmp_path / "c", shards=3)
    (root / "model-00002-of-00003.safetensors").unlink()
    shard = root / "model-00003-of-00003.safetensors"
    os.truncate(shard, shard.stat().st_size - 8)
    rep = verify_checkpoint(root)
    assert not rep.ok and not rep.missing
    text = " ".join(rep.problems)
    assert "model-00002-of-00003.safetensors is listed in the index but missing" in text
    assert "model-00003-of-00003.safetensors is unreadable" in text


def test_no_tokenizer_is_a_problem_for_the_served_checkpoint_only(tmp_path):
    root = _checkpoint(tmp_path / "c", shards=1, index=False)
    (root / "tokenizer.json").unlink()
    assert not verify_checkpoint(root).ok
    assert verify_checkpoint(root, role="drafter", need_tokenizer=False).ok


def test_port_problem_sees_a_listener():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert preflight.port_problem("127.0.0.1", port) == f"port {port} on 127.0.0.1 is already in use"
    assert preflight.port_problem("127.0.0.1", port) is None


def _l40(i: int, free: float = 44.5):
    return gpu(i, "NVIDIA L40", (8, 9), 44.99, free)


def test_gpus_meeting_the_commercial_profile():
    failures, summary = preflight.gpu_findings(profiles.load("commercial"), [_l40(i) for i in range(8)])
    assert failures == [] and summary.startswith("8 GPUs: NVIDIA L40, sm_89")


@pytest.mark.parametrize(
    ("gpus", "expected"),
    [
        ([_l40(i) for i in range(4)], "needs 8 GPUs; 4 visible"),
        ([gpu(i, "Tesla V100", (7, 0), 31.7, 31.0) for i in range(8)], "compute capability >= 8.0"),
        ([gpu(i, "RTX A4000", (8, 6), 15.7, 15.5) for i in range(8)], "needs 44 GiB per GPU"),
        ([_l40(0, free=10.0)] + [_l40(i) for i in range(1, 8)], "GPU 0 (10.0 of 45.0 GiB free)"),
    ],
)
def test_gpus_short_of_the_profile(gpus, expected):
    failures, summary = preflight.gpu_findings(profiles.load("commercial"), gpus)
    assert summary is None and expected in failures[0].message and failures[0].hint


def test_preflight_failures_are_listed_with_fixes_and_exit_codes(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        prof = launch_files.with_paths(profiles.load("tiny-cpu"), model=tmp_path / "missing")
        with pytest.raises(preflight.PreflightError) as err:
            preflight.run(launch_files.render(prof, port=port))
    text = err.value.message
    assert "checkpoint directory" in text and "does not exist" in text and "--model" in text
    assert f"port {port} on 127.0.0.1 is already in use" in text and "--port" in text
    assert err.value.exit_code == 2  # a wrong --model is the operator's to fix in the command


def test_cli_port_in_use(run_cli, tmp_path):
    ckpt = _checkpoint(tmp_path / "c")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = str(sock.getsockname()[1])
        proc = run_cli("serve", "--profile", "tiny-cpu", "--model", str(ckpt), "--port", port)
    assert proc.returncode == 1
    assert f"port {port} on 127.0.0.1 is already in use" in proc.stderr and "pass --port N" in proc.stderr


def test_cli_missing_checkpoint(run_cli, tmp_path):
    proc = run_cli("serve", "--profile", "tiny-cpu", "--model", str(tmp_path / "nope"))
    assert proc.returncode == 2
    assert f"checkpoint directory {tmp_path / 'nope'} does not exist" in proc.stderr


def test_a_context_longer_than_the_checkpoint_allows_is_refused(tmp_path):
    ckpt = _checkpoint(tmp_path / "c")
    (ckpt / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 4096}}))
    prof = launch_files.with_paths(profiles.load("tiny-cpu"), model=ckpt)  # max_model_len 8192
    with pytest.raises(preflight.PreflightError) as err:
        preflight.run(launch_files.render(prof, port=0))
    assert "max_model_len 8,192 is longer than" in err.value.message and "max_position_embeddings 4,096" in err.value.message
    assert err.value.exit_code == 2


def test_cli_invalid_profile(run_cli, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("extends: tiny-cpu\nmax_num_seqs: -1\n")
    proc = run_cli("serve", "--profile", str(bad), "--model", str(tmp_path))
    assert proc.returncode == 2
    assert "is not a valid serving profile" in proc.stderr and "max_num_seqs" in proc.stderr
    proc = run_cli("serve", "--profile", "no-such-profile")
    assert proc.returncode == 2 and "glmctl profile ls" in proc.stderr


def test_cli_unknown_licence_id(run_cli, tmp_path):
    proc = run_cli("serve", "--profile", "tiny-cpu", "--model", str(tmp_path), "--accept-license", "wtfpl-9")
    assert proc.returncode == 2 and "no such licence id" in proc.stderr


def test_cli_dry_run_runs_the_real_preflight_and_writes_nothing(run_cli, tmp_path):
    """A dry run refuses what a real start refuses, with the same sentence and exit code."""
    home = tmp_path / "home"
    env = {"GLMCTL_HOME": str(home), "GLMCTL_CACHE": str(tmp_path / "cache")}
    args = ["serve", "--profile", "commercial", "--model", str(tmp_path / "nonexistent"), "--port", "8123",
            "--accept-license", "shapleymcg-1.0"]
    dry = run_cli(*args, "--dry-run", "--json", env=env)
    real = run_cli(*args, env={"GLMCTL_HOME": str(tmp_path / "home2"), "GLMCTL_CACHE": str(tmp_path / "cache2")})
    assert dry.returncode == real.returncode == 2, dry.stderr
    assert f"checkpoint directory {tmp_path / 'nonexistent'} does not exist" in dry.stderr
    assert dry.stdout == "" and [ln for ln in dry.stderr.splitlines() if "- checkpoint" in ln] == \
        [ln for ln in real.stderr.splitlines() if "- checkpoint" in ln]
    unaccepted = run_cli("serve", "--profile", "commercial", "--model", str(tmp_path), "--dry-run", env=env)
    assert unaccepted.returncode == 2 and "--accept-license shapleymcg-1.0" in unaccepted.stderr
    assert not (tmp_path / "cache").exists() and not (home / "licenses").exists()


def test_dry_run_that_passes_prints_the_launch_masked_and_records_nothing(tmp_path, capsys, monkeypatch):
    from glmctl import paths
    from glmctl.serving import vllm_args
    from tests.unit.cli_inproc import run_glmctl

    ckpt = _checkpoint(tmp_path / "ckpt")
    root = paths.user_profiles()
    root.mkdir(parents=True, exist_ok=True)
    (root / "mine.yaml").write_text("extends: tiny-cpu\nenv:\n  HF_TOKEN: hf_abcdef\n"
                                    "vllm_args:\n  api-key: sk-live-123\n")
    calls = []
    monkeypatch.setattr(vllm_args, "check", lambda text, env=None, timeout=300: calls.append(text) or
                        vllm_args.VllmCheck(vllm_version="0.30.0", platform="cpu", plugin_registered=True))
    from glmctl.serving.server import free_port

    port = str(free_port())
    run = run_glmctl(capsys, "serve", "--profile", "mine", "--model", ckpt, "--port", port, "--dry-run", "--json")
    assert run.code == 0, run.err
    data = json.loads(run.out)
    assert calls and "sk-live-123" in calls[0]  # vLLM's parser saw the real config
    assert data["config"]["api-key"] == "***" and data["env"]["HF_TOKEN"] == "***"
    assert "sk-live-123" not in run.text and "hf_abcdef" not in run.text
    assert any("shards" in line for line in data["preflight"]["passed"])
    human = run_glmctl(capsys, "serve", "--profile", "mine", "--model", ckpt, "--port", port, "--dry-run")
    assert human.code == 0 and "api-key: '***'" in human.out and "HF_TOKEN='***'" in human.out
    assert "every preflight check passed" in human.out and "sk-live" not in human.text
    assert not paths.cache().joinpath("serve").exists()


@pytest.mark.parametrize(
    ("profile", "quantization", "expected"),
    [
        ("commercial", None, "planned for exl3 weights, but"),
        ("latency", {"quant_method": "glmctl_exl3", "experts": {"tp_degrees": [8]}}, "planned for fp8 weights"),
        ("commercial", {"quant_method": "glmctl_exl3", "experts": {"tp_degrees": [1, 2, 4]}},
         "converted for tensor-parallel sizes [1, 2, 4], not 8"),
    ],
)
def test_the_checkpoint_must_be_the_one_the_profile_is_planned_for(tmp_path, profile, quantization, expected):
    from glmctl.hub import licenses

    ckpt = _checkpoint(tmp_path / "c")
    config = {"max_position_embeddings": 1 << 20}
    if quantization:
        config["quantization_config"] = quantization
    (ckpt / "config.json").write_text(json.dumps(config))
    for lic in ("shapleymcg-1.0",):
        licenses.user_store().accept(licenses.get_license(lic), "flag")
    prof = launch_files.with_paths(profiles.load(profile), model=ckpt)
    with pytest.raises(preflight.PreflightError) as err:
        preflight.run(launch_files.render(prof, port=0))
    assert expected in err.value.message and err.value.exit_code == 2
