"""`glmctl serve` and the profiles against real vLLM 0.30 (CPU): the shipped profiles pass vLLM's
own parser, a rejected argument is a clear exit 2, and `glmctl serve --profile tiny-cpu` serves,
answers, and stops on SIGTERM with nothing left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from glmctl.serving import launch_files, profiles, vllm_args
from glmctl.serving import server as srv
from tests.conftest import REPO
from tests.vllm.held_process import group_gone, profile_file, read_ready

pytestmark = pytest.mark.vllm


def test_tiny_server_answers_completions_and_metrics(tiny_served):
    tiny_server = tiny_served
    models = httpx.get(f"{tiny_server.api_url}/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == [tiny_server.model]
    resp = httpx.post(
        f"{tiny_server.api_url}/completions",
        json={"model": tiny_server.model, "prompt": "def main():", "max_tokens": 4, "logprobs": 1,
              "temperature": 0},
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert len(choice["logprobs"]["tokens"]) == 4 and resp.json()["usage"]["completion_tokens"] == 4
    metrics = httpx.get(f"{tiny_server.base_url}/metrics", timeout=30).text
    generated = [ln for ln in metrics.splitlines() if ln.startswith("vllm:generation_tokens_total")]
    assert generated and float(generated[0].rsplit(" ", 1)[1]) >= 4


def test_shipped_profiles_pass_vllms_parser_and_problems_are_named(tmp_path):
    from glmctl.serving.validation import with_placeholders

    launches = [launch_files.render(with_placeholders(profiles.load(s.name))) for s in profiles.summaries()]
    bad = launch_files.render(with_placeholders(profiles.load("tiny-cpu")))
    bad.config = {**bad.config, "no-such-flag": 1, "disable-log-stats": False,
                  "speculative-config": {"method": "mtp", "num_speculative_token": 3}}
    *shipped, rejected = vllm_args.check_many([launch.config_yaml() for launch in [*launches, bad]])
    for launch, check in zip(launches, shipped, strict=True):
        assert check.ok, (launch.profile.name, check)
        assert check.vllm_version.startswith("0.30.0") and check.platform == "cpu"
        assert check.plugin_registered and check.plugin_error is None
    assert rejected.problems == [
        "'no-such-flag' is not a `vllm serve` option",
        "'disable-log-stats: false' would be ignored by vLLM (the flag has no --no- form): remove it",
        "speculative-config.num_speculative_token is not a SpeculativeConfig field",
    ]


def test_serve_refuses_an_argument_vllm_rejects(run_cli, tmp_path, tiny_launch_target):
    kind, ckpt = tiny_launch_target
    profile = profile_file(tmp_path, kind, "vllm_args:\n  max-logprobs: lots\n")
    proc = run_cli("serve", "--profile", profile, "--model", str(ckpt), "--port", str(srv.free_port()),
                   timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "vLLM rejects the rendered config: argument --max-logprobs: invalid int value: 'lots'" in proc.stderr
    assert "fix vllm_args in profile" in proc.stderr


def test_glmctl_serve_tiny_cpu_serves_and_stops_cleanly_on_sigterm(tiny_launch_target, tmp_path):
    kind, ckpt = tiny_launch_target
    profile = "tiny-cpu" if kind == "glm" else profile_file(tmp_path, kind)
    port = srv.free_port()
    env = {**os.environ, "GLMCTL_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "glmctl", "serve", "--profile", profile, "--model", str(ckpt),
         "--port", str(port), "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, cwd=REPO, env=env,
    )
    try:
        ready = read_ready(proc, 900)
        assert ready["endpoint"] == f"http://127.0.0.1:{port}/v1"
        assert ready["kv_cache_tokens"] > 0 and ready["kv_cache_source"].startswith("vLLM start-up log")
        if kind == "glm":  # the planner predicts vLLM's own KV arithmetic for the tiny checkpoint
            assert ready["planned_kv_cache_tokens"] is not None, ready["plan_note"]
            assert abs(ready["planned_kv_cache_tokens"] / ready["kv_cache_tokens"] - 1) < 0.02, ready
        resp = httpx.post(f"{ready['endpoint']}/completions",
                          json={"model": ready["model"], "prompt": "import os", "max_tokens": 2}, timeout=120)
        assert resp.status_code == 200, resp.text
        assert "vllm:prompt_tokens_total" in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        vllm_pgid = ready["pid"]  # vLLM runs in its own process group, led by this pid
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, err
    assert "vLLM stopped (exit status 0)" in err
    assert group_gone(vllm_pgid), "vLLM processes outlived glmctl serve"
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    run_dir = tmp_path / "cache" / "serve"
    [rendered] = list(run_dir.iterdir())
    assert {"vllm.yaml", "vllm.env", "command.sh", "vllm.log"} <= {p.name for p in rendered.iterdir()}


def test_vllm_dying_during_startup_exits_nonzero_with_its_last_lines(run_cli, tmp_path, tiny_launch_target):
    kind, ckpt = tiny_launch_target
    # Passes vLLM's parser and every preflight check, then fails when vLLM loads the tokenizer.
    missing = tmp_path / "no-tokenizer-here"
    profile = profile_file(tmp_path, kind, f"vllm_args:\n  tokenizer: {missing}\n")
    proc = run_cli("serve", "--profile", profile, "--model", str(ckpt), "--port", str(srv.free_port()),
                   env={"GLMCTL_CACHE": str(tmp_path / "cache")}, timeout=600)
    assert proc.returncode not in (0, 2), proc.stderr
    assert "vLLM exited with status" in proc.stderr and "during start-up" in proc.stderr
    assert str(missing) in proc.stderr  # vLLM's own reason, from the last log lines
    assert "the whole log is in" in proc.stderr and "vllm.log" in proc.stderr
    [log] = (tmp_path / "cache" / "serve").glob("*/vllm.log")
    assert str(missing) in log.read_text()
