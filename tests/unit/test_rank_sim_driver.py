"""bench/rank_sim.py's machinery on CPU: the steady-window rule against the fake server (every
prefill done, all sessions decoding, then the client stops them; the profile runs inside the
window), a stale server's port refused, the whole process group ended, and the facts read from a
vLLM log (boot timeline, memory split, kernels, autotuning)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from glmctl.evals import serving_bench as b
from glmctl.evals.client import OpenAIServer
from glmctl.evals.corpus import stdlib_text
from glmctl.evals.tokenizer import ServerTokenizer
from tests.conftest import REPO
from tests.fake_server import FakeEngine, FakeServer

sys.path.insert(0, str(REPO / "bench"))
import rank_sim  # noqa: E402
import rank_sim_server  # noqa: E402


@pytest.fixture
def fake():
    made = []

    def start(**kw):
        engine = FakeEngine(**({"max_model_len": 200_000, "decode_tok_s": 200.0, "prefill_tok_s": 20_000.0} | kw))
        cm = FakeServer(engine)
        client = OpenAIServer(cm.__enter__())
        client.connect()
        made.append((client, cm))
        return client, engine

    yield start
    for client, cm in made:
        client.close()
        cm.__exit__(None, None, None)


def _prompts(server):
    return b.PromptSource(ServerTokenizer(server), stdlib_text())


def test_cell_stops_its_sessions_once_the_window_is_measured_and_profiles_inside_it(fake):
    server, engine = fake()
    seen = {}

    def profile():
        sample = b.scrape(server, 0.0)
        seen.update(running=sample.running, waiting=sample.waiting, prompt=sample.prompt_tokens)
        return {"started": time.time(), "seconds": 0.0}

    t0 = time.monotonic()
    cell = rank_sim.run_cell(server, _prompts(server), 3, 1500, decode_budget=100_000, window_s=1.0,
                             time_limit_s=60.0, profile=profile)
    # 100,000 tokens at 200 tok/s would take 500 s: the client stopped every session after the window
    assert time.monotonic() - t0 < 20 and cell["stopped_by_client"] == 3, cell
    assert cell["decode_tok_s"] > 0 and cell["window_s"] >= 0.5 and cell["steps_per_s"] > 0, cell
    assert len(cell["ttft_s"]) == 3 and all(t is not None for t in cell["ttft_s"])
    # the profile ran with every prefill done, all three decoding and nothing waiting
    assert (seen["running"], seen["waiting"], seen["prompt"]) == (3, 0, 4500) and "profile" in cell
    assert all(q["max_tokens"] == 100_000 for q in engine.requests if q["path"] == "/v1/completions")
    time.sleep(0.5)
    assert b.scrape(server, 0.0).running == 0  # the aborted streams freed their slots


def test_cell_without_a_window_stops_at_its_time_limit_and_says_so(fake):
    server, _ = fake(max_num_seqs=2)  # three sessions never run together
    t0 = time.monotonic()
    cell = rank_sim.run_cell(server, _prompts(server), 3, 500, decode_budget=100_000, window_s=1.0,
                             time_limit_s=3.0)
    assert time.monotonic() - t0 < 15
    assert "time limit" in cell["no_window"] and "decode_tok_s" not in cell


def _args(port: int) -> argparse.Namespace:
    return argparse.Namespace(port=port, plugin="on", env=None, kv_cache_gib=1.0, model="m", kv="fp8",
                              max_model_len=4096, max_num_seqs=2, chunk=256, max_capture=8, no_compile=True,
                              profile_steps=2, mtp=0, enforce_eager=False)


def test_a_port_that_already_answers_is_refused(tmp_path):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        server = rank_sim_server.Server(_args(port), tmp_path / "v.log", tmp_path / "prof")
        with pytest.raises(RuntimeError, match=f"port {port} already answers"):
            server.start(deadline=time.monotonic() + 5)
        assert server.proc is None  # nothing was started


def test_end_group_ends_every_process_of_the_group():
    leader = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                               "time.sleep(60)"], start_new_session=True)
    time.sleep(1.0)
    rank_sim_server.end_group(leader.pid, grace_s=5.0)
    leader.wait(5)
    with pytest.raises(ProcessLookupError):
        os.killpg(leader.pid, 0)


def test_end_group_kills_what_ignores_sigterm():
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                 "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"],
                                start_new_session=True)
    time.sleep(0.5)
    rank_sim_server.end_group(stubborn.pid, grace_s=1.0)
    assert stubborn.wait(5) == -signal.SIGKILL


# A vLLM 0.30 start, the lines as its format strings write them (numbers made up)
LOG = """\
vllm serve /tmp/rank-exl3 ...
(APIServer pid=1529) INFO 12-01 22:32:15 [activation.py:144] glmctl plugin: active for GLM-5.3-Flash (on)
(EngineCore pid=1661) INFO 12-01 22:32:43 [activation.py:144] glmctl plugin: active for GLM-5.3-Flash (inherited)
(EngineCore pid=1661) INFO 12-01 22:32:48 [interface.py:933] Setting attention block size to 1536 tokens to ensure that attention page size is >= mamba page size.
(EngineCore pid=1661) INFO 12-01 22:32:50 [gpu_model_runner.py:5318] Starting to load model /tmp/rank-exl3...
(EngineCore pid=1661) INFO 12-01 22:32:55 [__init__.py:794] Selected MarlinFP8ScaledMMLinearKernel for Fp8LinearMethod
(EngineCore pid=1661) INFO 12-01 22:33:20 [exl3_method.py:99] glmctl exl3: warmed up 10 batch sizes (1..48 tokens) in 1.5 s
(EngineCore pid=1661) INFO 12-01 22:33:21 [gpu_model_runner.py:5417] Model loading took 20.34 GiB memory and 31.000000 seconds
Triton autotuning for function chunk_fwd_kernel_o finished after 12.50s; best config selected: BK: 64;
Triton autotuning for function chunk_gated_delta_rule_fwd_kernel_h finished after 30.25s; best config selected: BV: 32;
(EngineCore pid=1661) INFO 12-01 22:35:40 [gpu_worker.py:641] Available KV cache memory: 22.49 GiB
(EngineCore pid=1661) INFO 12-01 22:35:41 [gpu_model_runner.py:6697] Profiling CUDA graph memory: FULL=6 (largest=48)
(EngineCore pid=1661) INFO 12-01 22:36:02 [kv_cache_utils.py:2396] GPU KV cache size: 3,587,383 tokens, Maximum concurrency for 262,144 tokens per request: 13.68x
(EngineCore pid=1661) INFO 12-01 22:36:05 [gpu_model_runner.py:6930] Graph capturing finished in 3 secs, took 0.19 GiB
(EngineCore pid=1661) INFO 12-01 22:36:05 [gpu_worker.py:888] Free memory on device (139.0/139.8 GiB) on startup. Desired GPU memory utilization is (0.3176, 44.4 GiB). Actual usage is 20.9 GiB for consumed memory (weights + non-torch), 0.82 GiB for peak activation, and 0.19 GiB for CUDAGraph memory. Replace ...
(EngineCore pid=1661) INFO 12-01 22:36:06 [core.py:380] init engine (profile, create kv cache, warmup model) took 180.10 s
(APIServer pid=1529) INFO 12-01 22:36:10 [api_server.py:100] Starting vLLM API server 0 on http://127.0.0.1:8011
"""


def test_log_facts_read_the_boot_timeline_memory_split_and_kernels():
    facts = rank_sim_server.log_facts(LOG)
    assert (facts["kv_tokens"], facts["weights_gib"], facts["load_model_s"]) == (3_587_383, 20.34, 31.0)
    assert (facts["consumed_gib"], facts["peak_activation_gib"], facts["cudagraph_gib"]) == (20.9, 0.82, 0.19)
    assert (facts["engine_init_s"], facts["graph_capture_s"], facts["max_concurrency"]) == (180.1, 3.0, 13.68)
    assert facts["triton_autotune"]["count"] == 2 and facts["triton_autotune"]["seconds"] == 42.8
    assert facts["triton_autotune"]["slowest"][0][0] == "chunk_gated_delta_rule_fwd_kernel_h"
    assert any("MarlinFP8" in ln for ln in facts["kernel_lines"])
    t = facts["boot_timeline_s"]
    assert t["api_server_plugin"] == 0 and t["engine_core_plugin"] == 28 and t["api_ready"] == 235
    assert t["phase_seconds"]["load_model_done->kv_memory"] == 139  # the profiling run
    assert any("1536 tokens" in ln for ln in facts["block_lines"])
