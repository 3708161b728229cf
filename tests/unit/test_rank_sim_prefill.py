"""bench/rank_sim.py's prefill cell on CPU: the context read from KV-usage readings, the profiler
windows placed around the targets (a simulated engine on a fake clock), a trace split into engine
iterations at vLLM's step annotations, and the server's detailed annotations only with the cell.
Every number is made up for the test."""

from __future__ import annotations

import argparse
import sys
import threading

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import rank_sim_prefill as rsp  # noqa: E402
import rank_sim_profile as prof  # noqa: E402
import rank_sim_server  # noqa: E402

BLOCK, BLOCKS, FIXED = 1536, 2518, 13  # attention block tokens, pool blocks, a request's fixed blocks


def usage(context: int) -> float:
    """vLLM's gauge for one request holding `context` tokens: its attention blocks + fixed blocks."""
    return 0.0 if context <= 0 else (-(-context // BLOCK) + FIXED) / BLOCKS


def test_meter_counts_blocks_after_the_first_chunk():
    meter = rsp.ContextMeter(2048, BLOCK, 3_588_808, baseline=0.0)
    assert meter.context is None
    meter.update(0.0, 0.0)
    assert meter.context is None  # nothing scheduled yet
    for i, c in enumerate(range(2048, 70_000, 2048)):
        meter.update(usage(c), float(i))
        assert abs(meter.context - c) <= BLOCK, (c, meter.context)  # one block's rounding at most
    assert meter.first_t == 0.0 and meter.last_t == float(i)


def test_meter_without_a_block_size_uses_the_kv_capacity():
    meter = rsp.ContextMeter(2048, None, 3_588_808, baseline=0.0)
    meter.update(usage(2048), 0.0)
    meter.update(usage(102_400), 1.0)
    # the capacity spreads the fixed blocks over a request's tokens: the estimate runs ~7 % low
    assert 0.9 * 102_400 < meter.context < 102_400


class Engine:
    """A prefill of `length` tokens, one chunk per `chunk_s` of fake time, none while a trace is
    exported; the clock advances only when the watcher sleeps or calls the server."""

    def __init__(self, length: int, chunk_s: float = 0.25, export_s: float = 3.0) -> None:
        self.t, self.length, self.chunk_s, self.export_s = 0.0, length, chunk_s, export_s
        self.progress, self.profiling, self.profiled = 0.0, False, []  # (context of each profiled chunk)
        self.done = threading.Event()

    def context(self) -> int:
        return min(self.length, int(self.progress / self.chunk_s) * 2048)

    def advance(self, dt: float) -> None:
        before = self.context()
        self.t += dt
        self.progress += dt
        if self.profiling:
            self.profiled += list(range(before, self.context(), 2048))
        if self.context() >= self.length:
            self.done.set()

    def start(self) -> None:
        self.advance(self.chunk_s / 2)  # the engine takes the call between two steps
        self.profiling = True

    def stop(self) -> None:
        self.advance(self.chunk_s / 2)
        self.profiling = False
        self.t += self.export_s  # the engine stands still while the trace is written


def test_windows_are_placed_around_each_target_and_end_before_the_prompt():
    contexts = [8000, 64_000, 240_000]
    length = rsp.prompt_tokens(contexts, 2048, 4)
    engine = Engine(length)
    meter = rsp.ContextMeter(2048, BLOCK, 3_588_808, baseline=0.0)
    w = rsp.PrefillWindows(lambda: usage(engine.context()) if engine.progress > 0.01 else 0.0, engine.start,
                           engine.stop, contexts, 2048, 4, meter, deadline=1e9, done=engine.done,
                           clock=lambda: engine.t, sleep=engine.advance)
    engine.advance(0.02)
    w.run()  # in this thread: the fake clock makes it deterministic
    assert [x["target"] for x in w.windows] == contexts and not any("missed" in x for x in w.windows)
    profiled = engine.profiled
    for target in contexts:
        near = [c for c in profiled if abs(c - target) <= 6 * 2048]
        assert len(near) >= 3, (target, profiled)  # a few chunks around each target
    assert max(profiled) < length - 2048  # the last window ended before the prompt's last chunk
    assert all(x["stop_call_s"] >= 3.0 for x in w.windows)  # the export is timed


def test_a_window_the_prompt_never_reaches_is_missed_not_waited_for():
    engine = Engine(20_480)
    meter = rsp.ContextMeter(2048, BLOCK, None, baseline=0.0)
    w = rsp.PrefillWindows(lambda: usage(engine.context()) if engine.progress > 0.01 else 0.0, engine.start,
                           engine.stop, [8000, 64_000], 2048, 4, meter, deadline=1e9, done=engine.done,
                           clock=lambda: engine.t, sleep=engine.advance)
    engine.advance(0.02)
    w.run()
    assert "missed" not in w.windows[0] and "missed" in w.windows[1]


def test_contexts_and_prompt_length():
    assert rsp.parse_contexts("64k, 8k,240000") == [8000, 64_000, 240_000]
    assert rsp.prompt_tokens([8000, 240_000], 2048, 4) == 240_000 + 4096 + 4 * 2048
    assert rsp.block_tokens({"block_lines": ["... Setting attention block size to 1536 tokens to ensure ..."]}) == 1536
    assert rsp.block_tokens({}) is None


def _trace(layers: int = 2, steps: int = 3, context0: int = 8192) -> list[dict]:
    """Kineto-style events: a step annotation per iteration, a launch per kernel (correlation ids),
    the kernels running later on the GPU; one kernel launched before the first step."""
    kernels = (("_mix_finalize_kernel", 2.0, 2 * layers), ("void exl3_moe_kernel<4>", 100.0, layers),
               ("void marlin::Marlin<256, 1>", 50.0, 3), ("void cub::DeviceRadixSortOnesweepKernel<int>", 5.0, 2),
               ("_indexer_logits_ragged_kernel", 30.0, 1), ("_sparse_mla_kernel", 40.0, 1),
               ("merge_16x16_to_64x64_inverse_kernel", 4.0, 2), ("mystery", 1.0, 1))
    ev, corr, cpu, gpu = [], 0, 1000.0, 1500.0
    ev.append({"cat": "cuda_runtime", "ph": "X", "name": "cudaLaunchKernel", "ts": 10.0, "dur": 1, "args": {"correlation": 0}})
    ev.append({"cat": "kernel", "ph": "X", "name": "early_kernel", "ts": 20.0, "dur": 5.0, "args": {"correlation": 0}})
    for s in range(steps):
        ctx = context0 + s * 2048
        name = (f"execute_2048_context_1(sq2048sk{ctx + 2048}sqsq4194304sqsk{2048 * (ctx + 2048)})"
                "_generation_0(sq0sk0sqsq0sqsk0)")
        ev.append({"cat": "user_annotation", "ph": "X", "name": name, "ts": cpu, "dur": 400.0})
        for kname, dur, count in kernels:
            for _ in range(count):
                corr += 1
                ev.append({"cat": "cuda_runtime", "ph": "X", "name": "cudaLaunchKernel", "ts": cpu,
                           "dur": 1.0, "args": {"correlation": corr}})
                ev.append({"cat": "kernel", "ph": "X", "name": kname, "ts": gpu, "dur": dur, "args": {"correlation": corr}})
                cpu += 2.0
                gpu += dur + 1.0
        cpu += 600.0  # host time before the next step
    return ev


def test_chunk_breakdown_splits_iterations_at_the_step_annotations():
    b = prof.chunk_breakdown(_trace(), layers=2)
    its = b["iterations"]
    assert len(its) == 3 and b["unassigned_kernels"] == 1
    assert [it["context"] for it in its] == [8192, 10240, 12288]
    assert [it["complete"] for it in its] == [True, True, False]  # the last may be cut by the stop
    first = its[0]
    assert first["ctx_tokens"] == 2048 and first["gen_tokens"] == 0 and first["mhc_blocks"] == 4
    kinds = first["us_by_kind"]
    assert kinds["routed_experts"] == 2 * 100.0 + 2 * 5.0  # the routing's sorts count as experts
    assert kinds["fp8_linear"] == 150.0 and kinds["indexer"] == 30.0 and kinds["mla_attention"] == 40.0
    assert kinds["kda"] == 8.0 and kinds["other"] == 1.0
    assert first["busy_us"] == sum(kinds.values()) and first["span_us"] > first["busy_us"]
    assert first["wall_us"] is not None and its[2]["wall_us"] is None
    table = {r["name"]: r for r in b["kernels_table"]}
    assert table["void exl3_moe_kernel<4>"]["calls_per_chunk"] == 2.0
    assert "mystery" not in table  # 1 us per chunk: under the table's floor
    assert b["complete_iterations"] == 2


def test_step_annotations_simple_and_detailed():
    d = prof.parse_step("execute_2080_context_1(sq2048sk10240sqsq1sqsk2)_generation_8(sq32sk9sqsq3sqsk4)")
    assert (d["ctx_requests"], d["ctx_tokens"], d["ctx_seq"], d["gen_requests"], d["gen_tokens"]) == (1, 2048, 10240, 8, 32)
    s = prof.parse_step("execute_context_1(2048)_generation_0(0)")
    assert (s["ctx_tokens"], s["ctx_seq"], s["gen_tokens"]) == (2048, None, 0)
    assert prof.parse_step("something_else") is None


def test_decode_kinds_are_unchanged_by_the_prefill_patterns():
    # a decode step's sorts stay the sampler's; only a prefill chunk's count as the experts'
    name = "void at::native::(anonymous namespace)::searchsorted_cuda_kernel<long, long>"
    assert prof.kind_of(name) == "sampler" and prof.prefill_kind_of(name) == "sampler"
    assert prof.kind_of("void cub::DeviceRadixSortOnesweepKernel<int>") == "sampler"
    assert prof.prefill_kind_of("void cub::DeviceRadixSortOnesweepKernel<int>") == "routed_experts"


@pytest.mark.parametrize("cells,detailed", [("warm,8x22k", False), ("warm,256k,prefill", True)])
def test_server_turns_detailed_step_annotations_on_only_with_the_prefill_cell(tmp_path, cells, detailed):
    a = argparse.Namespace(port=1, plugin="on", env=None, kv_cache_gib=1.0, model="m", kv="fp8", max_model_len=4096,
                           max_num_seqs=2, chunk=256, max_capture=8, no_compile=True, profile_steps=2, mtp=0,
                           enforce_eager=False, cells=cells)
    argv = rank_sim_server.Server(a, tmp_path / "v.log", tmp_path / "prof").argv()
    config = argv[argv.index("--profiler-config") + 1]
    assert ('"detailed_trace_annotation": true' in config) is detailed


def test_the_cell_runs_against_a_server_without_a_profiler_and_reports_what_it_missed(tmp_path):
    """The fake server has no /start_profile and a KV gauge that does not grow with the prompt:
    the cell ends with the prompt, its window marked missed, its admission timed, no trace."""
    from glmctl.evals import serving_bench as b
    from glmctl.evals.client import OpenAIServer
    from glmctl.evals.corpus import stdlib_text
    from glmctl.evals.tokenizer import ServerTokenizer
    from tests.fake_server import FakeEngine, FakeServer

    engine = FakeEngine(max_model_len=8192, prefill_tok_s=20_000.0)
    with FakeServer(engine) as url:
        client = OpenAIServer(url)
        client.connect()
        prompts = b.PromptSource(ServerTokenizer(client), stdlib_text())
        cell = rsp.prefill_cell(client, prompts, url, tmp_path, 2, {"kv_tokens": 100_000}, contexts=[2000],
                                chunk=256, window_chunks=1, time_limit_s=30.0)
        client.close()
    assert cell["prompt_tokens"] == 2000 + 128 + 4 * 256 and cell["profiled_ttft_s"] is not None
    assert "missed" in cell["windows"][0] and cell["traces"] == [] and cell["summary"] == []
    assert cell["admission_s"] >= 0 and cell["usage_polls"] > 0
