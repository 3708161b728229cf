"""The supervisor, against a fake vLLM (tests/unit/fake_vllm.py): start-up followed, KV capacity
read from the log, death during start-up reported with the last lines and vLLM's status, signals
forwarded, and the whole process group gone afterwards (including a child that ignores SIGTERM)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import pytest

from glmctl.serving import launch_files, profiles, server
from glmctl.serving.launch import ServerStartError, VllmProcess, exit_status, parse_kv_capacity

FAKE = Path(__file__).with_name("fake_vllm.py")


def _fake(tmp_path, *extra: str) -> tuple[VllmProcess, str]:
    port = server.free_port()
    proc = VllmProcess([sys.executable, str(FAKE), "--port", str(port), *extra], {}, tmp_path / "vllm.log")
    return proc, f"http://127.0.0.1:{port}"


def test_kv_capacity_line_of_vllm_030():
    line = ("(EngineCore pid=15936) INFO 11-29 10:18:36 [kv_cache_utils.py:2395] GPU KV cache size: "
            "2,847,055 tokens, Maximum concurrency for 262,144 tokens per request: 10.86x")
    kv = parse_kv_capacity(line)
    assert (kv.tokens, kv.max_model_len, kv.max_concurrency, kv.device) == (2847055, 262144, 10.86, "gpu")
    assert parse_kv_capacity("INFO something else") is None


def test_exit_status_of_a_signalled_child_is_shell_style():
    assert exit_status(-signal.SIGTERM) == 143 and exit_status(3) == 3


def test_healthy_start_then_stop_leaves_no_process(tmp_path):
    proc, url = _fake(tmp_path)
    proc.start()
    try:
        proc.wait_healthy(url, timeout_s=60)
        assert proc.phase == "ready" and proc.shards == (1, 2)
        assert proc.kv is not None and proc.kv.tokens == 2_097_152
    finally:
        status = proc.stop(grace_s=10)
    assert status == 0
    assert not proc.group_alive()  # the SIGTERM-ignoring child was killed with the group
    assert "Application startup complete" in (tmp_path / "vllm.log").read_text()


def test_death_during_startup_reports_status_and_last_lines(tmp_path):
    proc, url = _fake(tmp_path, "--die-after", "0.2", "--exit-code", "3")
    proc.start()
    with pytest.raises(ServerStartError) as err:
        proc.wait_healthy(url, timeout_s=60)
    assert err.value.exit_code == 3
    assert "exited with status 3" in err.value.message and "simulated start-up failure" in err.value.message
    assert str(tmp_path / "vllm.log") in err.value.hint
    proc.stop(grace_s=1)
    assert not proc.group_alive()


def test_startup_timeout_is_an_error_with_the_phase(tmp_path):
    proc, url = _fake(tmp_path, "--never-healthy")
    proc.start()
    try:
        with pytest.raises(ServerStartError, match="did not become healthy within 1 s"):
            proc.wait_healthy(url, timeout_s=1)
    finally:
        proc.stop(grace_s=1)
    assert not proc.group_alive()


def test_run_foreground_forwards_sigterm_and_returns_vllms_status(tmp_path, monkeypatch):
    prof = launch_files.with_paths(profiles.load("tiny-cpu"), model=tmp_path)
    launch = launch_files.render(prof, port=server.free_port())
    launch.argv = lambda config: [sys.executable, str(FAKE), "--port", str(launch.port)]
    srv = server.Server(launch, tmp_path / "run")
    ready = []
    before = signal.getsignal(signal.SIGTERM)

    def on_ready(info):
        ready.append(info)
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()

    status = server.run_foreground(srv, timeout_s=60, on_ready=on_ready, grace_s=10)
    assert status == 0
    [info] = ready
    assert info.base_url == launch.base_url and info.kv.tokens == 2_097_152
    assert (tmp_path / "run" / "vllm.yaml").is_file() and (tmp_path / "run" / "command.sh").is_file()
    assert "shutting down on signal 15" in info.log_path.read_text()
    assert not srv.process.group_alive()
    assert signal.getsignal(signal.SIGTERM) is before  # handlers restored


def test_a_profiles_switches_are_what_the_plugin_reads():
    from glmctl.plugin.distributed.tp_communicator import settings_from_env
    from glmctl.serving import plugin_switches

    env = plugin_switches.profile_switches(profiles.load("commercial"))
    settings = settings_from_env(env)
    assert env and (settings.mode, settings.int8_prefill) == ("host-staged", True)


def test_the_plugins_hand_over_variables_are_not_inherited(tmp_path, monkeypatch):
    monkeypatch.setenv("GLMCTL_PLUGIN_ACTIVE", "glm5_next")
    monkeypatch.setenv("GLMCTL_FP8_ATTENTION_ACTIVE", "1")
    out = tmp_path / "env.txt"
    code = ("import os, sys; open(sys.argv[1], 'w').write(' '.join(os.environ.get(k, 'unset') for k in "
            "('GLMCTL_PLUGIN_ACTIVE', 'GLMCTL_FP8_ATTENTION_ACTIVE', 'GLMCTL_SUPERVISOR_PID')))")
    proc = VllmProcess([sys.executable, "-c", code, str(out)], {"X": "1"}, tmp_path / "log")
    proc.start()
    assert proc.wait(timeout=60) == 0
    assert out.read_text() == f"unset unset {os.getpid()}"
