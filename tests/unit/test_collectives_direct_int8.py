"""The direct path's INT8 two-shot all-reduce (`direct_int8_kernels`, `direct.py`) under
TRITON_INTERPRET=1, every rank in this one thread: the kernels run as their announce half for
every rank, then their collect half for every rank (the order a real group's waits allow), on
one shared buffer that stands for the segment's direct area. Repeated calls walk the epochs
through both parities, and the ranks' results must agree bit for bit. (The threaded end-to-end
run with the real flag protocol and fences: `test_collectives_datapath_sim.py`.)"""

from __future__ import annotations

import pytest

from tests.unit import collectives_interp

torch = pytest.importorskip("torch")

_MODULES = collectives_interp.load()
_PRELOADED = _MODULES is None
kernels, _, direct_int8_kernels, _, _ = _MODULES or (None,) * 5

from glmctl.collectives.call_plan import (  # noqa: E402
    DirectLimits,
    direct_result_offset,
    plan_all_reduce,
)
from glmctl.collectives.segment import DIRECT_PROGRAMS  # noqa: E402
from glmctl.collectives.staging import DirectArea  # noqa: E402
from tests.int8_codec_ref import direct_two_shot_int8_ref  # noqa: E402

interpreted = pytest.mark.skipif(_PRELOADED, reason="triton was imported before: test_fresh_process")
CAP = 32 * 1024  # bytes per direct slot
# The INT8 bounds the barrier paths are held to: relative RMS error to the exact sum at most 1%
# (the thread rig's #wrong rule), and within one quantization step plus one 16-bit ulp of the
# torch reference of what the kernels compute, relative to the result's largest element
RMS_LIMIT = 0.01
STEP_LIMIT = 1 / 127 + 2**-7


@pytest.mark.skipif(not _PRELOADED, reason="ran in this process")
def test_fresh_process():
    collectives_interp.rerun_fresh(__file__)


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


class Area:
    """One buffer for the group's slots (2 parities x world) and flag lines, and each rank's own
    words and epoch counters; `area(r)` is rank r's `DirectArea` over it."""

    def __init__(self, world: int):
        self.world = world
        self.slots = torch.full((2 * world * CAP,), 0x5A, dtype=torch.uint8)  # stale bytes
        self.flags = torch.zeros(2 * world * 16, dtype=torch.int32)
        self.words = torch.zeros(world, 4, dtype=torch.int32)  # status, epoch word, abort, -
        self.epochs = [torch.zeros(DIRECT_PROGRAMS, dtype=torch.int32) for _ in range(world)]
        self.base = {}

    def area(self, r: int) -> DirectArea:
        w = self.words[r]
        return DirectArea(ll_slots=0, slots=self.slots.data_ptr(), capacity=CAP,
                          flags=self.flags.data_ptr(), abort=w[2:].data_ptr(),
                          status=w[0:].data_ptr(), epoch_word=w[1:].data_ptr(),
                          epochs=self.epochs[r])

    def tensor(self, p):
        """A MappedPtr into one of the buffers, as a CPU view the interpreter reads and writes."""
        for t in (self.slots, self.flags, self.words):
            lo = t.data_ptr()
            hi = lo + t.numel() * t.element_size()
            if lo <= p.address < hi:
                raw = t.view(-1).view(torch.uint8)[p.address - lo:]
                return raw.view(p.dtype)
        raise AssertionError(f"address {p.address:#x} is in no buffer")


def _launch(group: Area, kernel, args, meta):
    conv = [group.tensor(a) if isinstance(a, kernels.MappedPtr) else a for a in args]
    kernel[(DIRECT_PROGRAMS,)](*conv, **meta)


def _all_reduce_every_rank(group: Area, plan, xs, outs):
    """One call on every rank: publish, round 0, round 1 (each round announced by every rank
    before any rank collects), as `direct.py` enqueues them (the fences order nothing here)."""
    k = direct_int8_kernels
    world, res_off = group.world, direct_result_offset(plan)
    common = [dict(numel=plan.numel, rank=r, world=world, layout=plan.layout) for r in range(world)]
    for r in range(world):
        _launch(group, k._publish_int8_kernel, *k.publish_args(xs[r], group.area(r), **common[r]))
    for round_ in (0, 1):
        for phase in (1, 2):
            for r in range(world):
                kw = dict(round_=round_, res_off=res_off, bump=round_ == 1, phase=phase, **common[r])
                _launch(group, k._collect_int8_kernel,
                        *k.collect_args(xs[r], outs[r], group.area(r), **kw))


def _plan(numel, dtype, world):
    eb = torch.empty(0, dtype=dtype).element_size()
    lim = DirectLimits(two_shot_max_bytes=CAP, capacity=CAP)
    plan = plan_all_reduce(numel, eb, world, int8=True, direct=lim)
    assert (plan.algorithm, plan.int8) == ("direct_2s", True)
    return plan


def _check(got: list, xs: list, dtype):
    first = got[0].view(torch.int16 if got[0].element_size() == 2 else torch.int32)
    for r, o in enumerate(got[1:], 1):
        assert torch.equal(o.view(first.dtype), first), f"rank {r} differs from rank 0"
    exact = sum(t.double() for t in xs)
    rms = float((got[0].double() - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt())
    assert rms <= RMS_LIMIT, rms
    want = direct_two_shot_int8_ref(xs).double()
    step = float((got[0].double() - want).abs().max() / (want.abs().max() + 1e-30))
    assert step <= STEP_LIMIT, step
    return rms


@interpreted
@pytest.mark.parametrize("world,numel,dtype", [
    (2, 4096, torch.bfloat16),  # 1 token x 4096: the smallest decode all-reduce
    (3, 1001, torch.float32),  # odd: chunks of 384, the last one short
    (4, 5, torch.float16),  # chunks past the message: ranks 1-3 reduce nothing
    (8, 2 * 4096 + 8, torch.bfloat16),  # 8 ranks, one chunk partly past the message
])
def test_ranks_agree_bitwise_and_stay_within_the_int8_bound(world, numel, dtype):
    group, plan = Area(world), _plan(numel, dtype, world)
    for call in range(3):  # epochs 1, 2, 3: both parities, one slot reused
        g = torch.Generator().manual_seed(100 * call + world)
        xs = [(torch.randn(numel, generator=g) * (1 + j)).to(dtype) for j in range(world)]
        outs = [torch.full_like(x, float("nan")) for x in xs]
        _all_reduce_every_rank(group, plan, [x.clone() for x in xs], outs)
        _check(outs, xs, dtype)
        for r in range(world):
            assert torch.all(group.epochs[r] == call + 1)
            assert int(group.words[r, 1]) == call + 1  # the epoch word the watchdog compares
        from glmctl.collectives.direct_kernels import DONE_STATUS
        assert torch.all(group.words[:, 0] == DONE_STATUS)


@interpreted
def test_in_place_and_the_own_chunk_stays_native():
    """out may be x; the reducer adds its own elements unquantized, so a message only one rank
    contributes to comes back as that rank's elements re-encoded once (one step), not twice."""
    world, numel = 4, 3000
    group, plan = Area(world), _plan(numel, torch.float32, world)
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(numel, generator=g) for _ in range(world)]
    ins = [x.clone() for x in xs]
    _all_reduce_every_rank(group, plan, ins, ins)  # in place
    _check(ins, xs, torch.float32)
    # only rank 1 non-zero: its own chunk is exact before the one re-encoding
    zs = [torch.zeros(numel) for _ in range(world)]
    zs[1] = torch.randn(numel, generator=g)
    outs = [torch.empty(numel) for _ in range(world)]
    _all_reduce_every_rank(group, plan, zs, outs)
    lo, n = plan.chunk_span(1)
    from tests.int8_codec_ref import int8_round_trip_ref
    assert torch.equal(outs[0][lo:lo + n], int8_round_trip_ref(zs[1][lo:lo + n]))


@interpreted
def test_a_rank_that_publishes_wrong_records_fails_the_checks():
    """The checks can fail: rank 2 encodes an empty message (all-zero records) in place of its
    own, and the result leaves the error bound."""
    world, numel = 4, 2048
    group, plan = Area(world), _plan(numel, torch.bfloat16, world)
    g = torch.Generator().manual_seed(9)
    xs = [torch.randn(numel, generator=g).to(torch.bfloat16) for _ in range(world)]
    outs = [torch.empty_like(x) for x in xs]
    k = direct_int8_kernels
    real = k.publish_args

    def zero_rank2(x, area, **kw):
        args, meta = real(x, area, **kw)
        return (args[:4] + (0,) + args[5:], meta) if kw["rank"] == 2 else (args, meta)  # numel 0

    k.publish_args = zero_rank2
    try:
        _all_reduce_every_rank(group, plan, xs, outs)
    finally:
        k.publish_args = real
    with pytest.raises(AssertionError):
        _check(outs, xs, torch.bfloat16)
