"""Host-staged collectives wired into vLLM 0.30's own classes, on CPU.

The real `CudaCommunicator.__init__` runs (its NCCL, FlashInfer and custom all-reduce objects are
stubbed: no CUDA here) with the glmctl wrapper around it, and a fake `HostStagedCommunicator`
plays rank 0 of a two-rank group: rank j's data is rank 0's with every byte XORed with j, so a
gather shows whose bytes landed where, and an all-reduce returns twice the input. Calls reach the
fake exactly as vLLM makes them: `GroupCoordinator.all_reduce` / `all_gather` / `graph_capture`,
`LogitsProcessor._gather_logits`, `CudaCommunicator.custom_all_gather` / `all_gatherv`.
"""

from __future__ import annotations

import contextlib

import pytest

from glmctl.errors import ConfigError

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.distributed import parallel_state  # noqa: E402
from vllm.distributed.device_communicators import (  # noqa: E402
    custom_all_reduce,
    flashinfer_all_reduce,
    pynccl,
)
from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator  # noqa: E402

from glmctl.plugin.distributed import tp_communicator as cw  # noqa: E402

MiB = 1 << 20
FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def peer(t, j: int):
    """Rank j's tensor in the fake group: this rank's bytes XOR j (rank 0 is this rank)."""
    return (t.contiguous().view(torch.uint8) ^ j).view(t.dtype)


class FakeHostStaged:
    def __init__(self, *, rank, world_size, group_id, max_bytes, device, cpu_group, timeout_s,
                 on_error):
        assert rank == 0
        self.world_size, self.max_bytes, self.device = world_size, max_bytes, torch.device(device)
        self.group_id, self.timeout_s, self.on_error = group_id, timeout_s, on_error
        self.disabled, self.closed = False, False
        self.calls: list[tuple] = []
        self.copy_engines = "fake"

    def all_reduce(self, x, *, out, int8=None):
        assert x.is_contiguous() and out.is_contiguous() and out.shape == x.shape
        assert x.dtype in FLOATS  # larger than max_bytes: the communicator cuts it into calls
        self.calls.append(("all_reduce", x.numel() * x.element_size(), int8))
        out.copy_((x.float() * self.world_size).to(x.dtype))
        return out

    def all_gather(self, x, dim, *, int8=None):
        assert x.dtype in FLOATS
        self.calls.append(("all_gather", x.numel() * x.element_size(), int8))
        return torch.cat([peer(x, j) for j in range(self.world_size)], dim)

    @contextlib.contextmanager
    def capture(self):
        self.calls.append(("capture",))
        yield

    def close(self):
        self.closed = True


class VllmStub:
    """PyNccl / FlashInfer / CustomAllreduce as they are on a GPU node without P2P: disabled."""

    disabled = True

    def __init__(self, *args, **kwargs):
        self.closed = False

    def close(self):
        self.closed = True

    destroy = close


class CpuGroup:
    def rank(self):
        return 0

    def size(self):
        return 2


def _tp(monkeypatch, env: dict | None = None, *, name="tp:0", facts=None, group=None):
    """A real CudaCommunicator built through the glmctl wrapper; returns (communicator, fake)."""
    for module, attr in ((pynccl, "PyNcclCommunicator"), (custom_all_reduce, "CustomAllreduce"),
                         (flashinfer_all_reduce, "FlashInferAllReduce")):
        monkeypatch.setattr(module, attr, VllmStub)
    made: list[FakeHostStaged] = []

    def make(**kw):
        made.append(FakeHostStaged(**kw))
        return made[-1]

    monkeypatch.setattr(cw, "make_communicator", make)
    monkeypatch.setattr(cw, "group_facts", lambda dc: group or cw.GroupFacts(stateless=False))
    monkeypatch.setattr(cw, "model_facts", lambda cfg: facts)
    stock = getattr(CudaCommunicator.__init__, "__wrapped__", CudaCommunicator.__init__)
    monkeypatch.setattr(CudaCommunicator, "__init__", stock)  # restored after the test
    settings = cw.settings_from_env({"GLMCTL_COLLECTIVES": "host-staged", **(env or {})})
    cw.patch_cuda_communicator(CudaCommunicator, settings)
    dc = CudaCommunicator(CpuGroup(), device=torch.device("cpu"), unique_name=name,
                          global_ranks=[0, 1], global_world_size=2)
    return dc, (made[0] if made else None)


def _coordinator(dc):
    """vLLM's GroupCoordinator for the TP group, minus the process groups it would create."""
    gc = parallel_state.GroupCoordinator.__new__(parallel_state.GroupCoordinator)
    gc.unique_name, gc.world_size, gc.rank_in_group = dc.unique_name, 2, 0
    gc.device_communicator, gc.use_custom_op_call = dc, False
    return gc


def test_switch_off_or_cpu_platform_leaves_vllm_untouched(monkeypatch):
    stock = CudaCommunicator.__init__
    for env in ({}, {"GLMCTL_COLLECTIVES": "vllm"},
                {"GLMCTL_COLLECTIVES": "host-staged", "GLMCTL_PLUGIN": "off"},
                {"GLMCTL_COLLECTIVES": "host-staged"},  # this machine is vLLM's CPU platform
                {"GLMCTL_COLLECTIVES": "auto", "GLMCTL_COLLECTIVES_INT8": "prefill"},
                {"GLMCTL_COLLECTIVES": "sometimes"}):  # logged, not installed
        assert cw.install_collectives(env) is False
    assert CudaCommunicator.__init__ is stock


def test_settings_name_the_bad_variable():
    s = cw.settings_from_env({"GLMCTL_COLLECTIVES": "host-staged", "GLMCTL_COLLECTIVES_INT8": "prefill"})
    assert s.mode == "host-staged" and s.int8_prefill
    s = cw.settings_from_env({})
    assert (s.mode, s.int8_prefill, s.int8_min_bytes, s.max_bytes) == ("vllm", False, 4 * MiB, None)
    s = cw.settings_from_env({"GLMCTL_COLLECTIVES": "Host-Staged", "GLMCTL_COLLECTIVES_INT8": "prefill",
                              "GLMCTL_COLLECTIVES_INT8_MIN_MIB": "0.5", "GLMCTL_COLLECTIVES_MAX_MIB": "8"})
    assert (s.mode, s.int8_prefill, s.int8_min_bytes, s.max_bytes) == ("host-staged", True, MiB // 2,
                                                                       8 * MiB)
    s = cw.settings_from_env({"GLMCTL_COLLECTIVES": "host-staged", "GLMCTL_COLLECTIVES_INT8": "all"})
    assert (s.int8_prefill, s.int8_decode) == (True, True)
    assert not cw.settings_from_env({"GLMCTL_COLLECTIVES_INT8": "prefill"}).int8_decode
    for env, name in (({"GLMCTL_COLLECTIVES": "nccl2"}, "GLMCTL_COLLECTIVES="),
                      ({"GLMCTL_COLLECTIVES_INT8": "decode"}, "GLMCTL_COLLECTIVES_INT8="),
                      ({"GLMCTL_COLLECTIVES_MAX_MIB": "0.5"}, "GLMCTL_COLLECTIVES_MAX_MIB="),
                      ({"GLMCTL_COLLECTIVES_TIMEOUT_S": "soon"}, "GLMCTL_COLLECTIVES_TIMEOUT_S=")):
        with pytest.raises(ConfigError, match=name):
            cw.settings_from_env(env)


def test_sizes_from_the_model_config():
    facts = cw.ModelFacts(hidden_size=4096, elem_bytes=2, max_batched_tokens=8192,
                          capture_sizes=(1, 8, 48), timeout_s=None)
    s = cw.settings_from_env({"GLMCTL_COLLECTIVES": "host-staged"})
    assert cw.max_message_bytes(s, facts) == 32 * MiB  # 64 MiB prefill chunks go in two pieces
    assert cw.max_message_bytes(s, cw.ModelFacts(64, 2, 16)) == MiB
    assert cw.timeout_s(s, facts) == cw.DEFAULT_TIMEOUT_S
    assert cw.int8_threshold(s, facts) is None  # INT8 not asked for
    s = cw.settings_from_env({"GLMCTL_COLLECTIVES": "host-staged", "GLMCTL_COLLECTIVES_INT8": "prefill",
                              "GLMCTL_COLLECTIVES_INT8_MIN_MIB": "0.01"})
    # never INT8 inside a captured decode graph (48 tokens x 4096 x bf16), whatever the minimum
    assert cw.int8_threshold(s, facts) == 48 * 4096 * 2 + 1
    assert cw.int8_threshold(s, None) == int(0.01 * MiB)
    # `all`: every all-reduce, captured decode sizes included, whatever the minimum
    s = cw.settings_from_env({"GLMCTL_COLLECTIVES": "host-staged", "GLMCTL_COLLECTIVES_INT8": "all",
                              "GLMCTL_COLLECTIVES_INT8_MIN_MIB": "8"})
    assert cw.int8_threshold(s, facts) == 0 and cw.int8_threshold(s, None) == 0


def test_tp_group_routes_all_reduce_out_of_place(monkeypatch):
    dc, fake = _tp(monkeypatch)
    assert isinstance(dc.ca_comm, cw.HostStagedCustomAllreduce) and dc.ca_comm.comm is fake
    assert fake.group_id == "vllm-tp:0" and fake.on_error is cw.stop_this_worker
    gc = _coordinator(dc)
    for dtype in FLOATS:
        x = torch.randn(3, 40).to(dtype)
        before = x.clone()
        y = gc.all_reduce(x)
        assert torch.equal(y, (before.float() * 2).to(dtype)) and torch.equal(x, before)
        assert y.data_ptr() != x.data_ptr()
    strided = torch.randn(40, 3).t()
    assert torch.equal(gc.all_reduce(strided), strided * 2)
    assert not dc.ca_comm.should_custom_ar(torch.ones(4, dtype=torch.int32))  # vLLM's path
    assert all(c == ("all_reduce", c[1], False) for c in fake.calls)


def test_other_groups_keep_vllm(monkeypatch):
    dc, fake = _tp(monkeypatch, name="dp:0")
    assert fake is None and isinstance(dc.ca_comm, type(None) | VllmStub)
    assert "all_reduce" not in vars(dc) and "all_gather" not in vars(dc)


def test_int8_only_from_the_size_threshold(monkeypatch):
    facts = cw.ModelFacts(hidden_size=64, elem_bytes=2, max_batched_tokens=16384,
                          capture_sizes=(1, 2, 4))
    dc, fake = _tp(monkeypatch, {"GLMCTL_COLLECTIVES_INT8": "prefill",
                                 "GLMCTL_COLLECTIVES_INT8_MIN_MIB": "0.0625",  # 64 KiB
                                 "GLMCTL_COLLECTIVES_MAX_MIB": "1"}, facts=facts)
    gc = _coordinator(dc)
    for numel, want in ((16384, False), (32768 - 1, False), (32768, True), (3 * MiB // 2, True)):
        fake.calls.clear()
        x = torch.randn(numel).to(torch.bfloat16)
        assert torch.equal(gc.all_reduce(x), (x.float() * 2).to(torch.bfloat16))
        assert {c[2] for c in fake.calls} == {want}, numel
    # the 3 MiB message went whole, INT8 (the communicator cuts it: call_plan.message_pieces)
    assert [c[1] for c in fake.calls] == [3 * MiB]
    gathered = gc.all_gather(torch.randn(40000).to(torch.bfloat16), 0)  # gathers are never INT8
    assert gathered.shape == (80000,) and fake.calls[-1][2] is False


def test_int8_all_sends_decode_sizes_as_int8_and_warms_them_up(monkeypatch):
    facts = cw.ModelFacts(hidden_size=64, elem_bytes=2, max_batched_tokens=16384,
                          capture_sizes=(1, 2, 4))
    dc, fake = _tp(monkeypatch, {"GLMCTL_COLLECTIVES_INT8": "all",
                                 "GLMCTL_COLLECTIVES_MAX_MIB": "1"}, facts=facts)
    gc = _coordinator(dc)
    for numel in (64, 4 * 64, 32768, 3 * MiB // 2):
        fake.calls.clear()
        x = torch.randn(numel).to(torch.bfloat16)
        assert torch.equal(gc.all_reduce(x), (x.float() * 2).to(torch.bfloat16))
        assert {c[2] for c in fake.calls} == {True}, numel
    fake.calls.clear()
    with dc.ca_comm.capture():  # the warm-up compiles what the captured calls will run: INT8
        pass
    assert [c[1:] for c in fake.calls if c[0] == "all_reduce"] == [(t * 64 * 2, True) for t in
                                                                   facts.capture_sizes]
    gathered = gc.all_gather(torch.randn(40000).to(torch.bfloat16), 0)  # gathers are never INT8
    assert gathered.shape == (80000,) and fake.calls[-1][2] is False


@pytest.mark.parametrize("shape,dim,dtype", [
    ((3, 5), 0, torch.float32), ((3, 5), 1, torch.float32), ((2, 3, 4), 1, torch.bfloat16),
    ((7,), -1, torch.float16), ((4, 6), -1, torch.int64), ((5,), 0, torch.int32),
    ((4, 6), -1, torch.bool), ((600, 700), -1, torch.float32), ((3, 4000), 0, torch.int64)])
def test_all_gather_matches_cat_along_dim(monkeypatch, shape, dim, dtype):
    dc, fake = _tp(monkeypatch, {"GLMCTL_COLLECTIVES_MAX_MIB": "1"})
    x = (torch.randn(shape) * 100).to(dtype)
    got = _coordinator(dc).all_gather(x, dim)
    want = torch.cat([peer(x, j) for j in range(2)], dim)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # bit for bit


def test_logits_gather_and_sequence_parallel_gathers(monkeypatch):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    dc, fake = _tp(monkeypatch)
    monkeypatch.setattr(parallel_state, "_TP", _coordinator(dc))
    with set_current_vllm_config(VllmConfig()):
        lp = LogitsProcessor(vocab_size=96)
    assert lp.use_all_gather
    logits = torch.randn(5, 48).to(torch.bfloat16)  # [tokens, vocab / tp]
    got = lp._gather_logits(logits)
    assert got.shape == (5, 96) and torch.equal(got, torch.cat([logits, peer(logits, 1)], -1))
    assert fake.calls[-1] == ("all_gather", logits.numel() * 2, False)
    rows = torch.randn(4, 8)
    assert torch.equal(dc.custom_all_gather(rows), torch.cat([rows, peer(rows, 1)]))
    assert torch.equal(dc.all_gatherv(rows, 0, [4, 4]), torch.cat([rows, peer(rows, 1)]))
    pair = dc.all_gatherv([rows, rows[:2]])
    assert [t.shape[0] for t in pair] == [8, 4]


def test_graph_capture_warms_up_then_enters_capture(monkeypatch):
    facts = cw.ModelFacts(hidden_size=64, elem_bytes=2, max_batched_tokens=256,
                          capture_sizes=(1, 2, 4))
    dc, fake = _tp(monkeypatch, facts=facts)
    stream = object()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    gc = _coordinator(dc)
    for _ in range(2):  # vLLM captures twice (memory profiling, then for real)
        with gc.graph_capture(parallel_state.GraphCaptureContext(stream)):
            fake.calls.append(("captured body",))
    warm = [("all_reduce", t * 64 * 2, False) for t in (1, 2, 4)]
    assert fake.calls == [*warm, ("capture",), ("captured body",), ("capture",), ("captured body",)]


def test_destroy_closes_the_host_segment(monkeypatch):
    dc, fake = _tp(monkeypatch)
    dc.destroy()
    assert fake.closed and dc.ca_comm is None and dc.pynccl_comm is None


def test_where_the_group_lives_decides(monkeypatch):
    two_nodes = cw.GroupFacts(stateless=False, one_node=False)
    with pytest.raises(ConfigError, match="one node"):
        _tp(monkeypatch, group=two_nodes)
    assert _tp(monkeypatch, {"GLMCTL_COLLECTIVES": "auto"}, group=two_nodes)[1] is None
    p2p = cw.GroupFacts(stateless=False, lacks_p2p=False)
    assert _tp(monkeypatch, {"GLMCTL_COLLECTIVES": "auto"}, group=p2p)[1] is None
    assert _tp(monkeypatch, {"GLMCTL_COLLECTIVES": "host-staged"}, group=p2p)[1] is not None
    no_p2p = cw.GroupFacts(stateless=False, lacks_p2p=True)
    dc, fake = _tp(monkeypatch, {"GLMCTL_COLLECTIVES": "auto"}, group=no_p2p)
    assert fake is not None and dc.ca_comm.comm is fake
    assert _tp(monkeypatch, {"GLMCTL_COLLECTIVES": "host-staged"},
               group=cw.GroupFacts(stateless=True))[1] is None
