"""The collectives' Triton kernels under TRITON_INTERPRET=1 against the torch reference codec and
plain torch sums, at small shapes (the gpu lane runs them at real sizes on real host memory)."""

from __future__ import annotations

import pytest

from tests.unit import collectives_interp

torch = pytest.importorskip("torch")

# The interpreter must be chosen before triton is first imported (triton.language's own @jit helpers
# are built at that import). If something imported triton earlier in this process, these tests are
# skipped here and the whole file re-runs in a fresh interpreter process instead.
_MODULES = collectives_interp.load()
_PRELOADED = _MODULES is None
kernels, _, direct_int8_kernels, _, datapath = _MODULES or (None,) * 5

from glmctl.collectives.call_plan import int8_layout  # noqa: E402
from tests.int8_codec_ref import dequantize_int8_ref, quantize_int8_ref  # noqa: E402

interpreted = pytest.mark.skipif(_PRELOADED, reason="triton was imported before: test_fresh_process")


@pytest.mark.skipif(not _PRELOADED, reason="ran in this process")
def test_fresh_process():
    collectives_interp.rerun_fresh(__file__)


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _records(buf: torch.Tensor):
    return buf, buf.view(torch.float32)


def _q_and_scales(rec: torch.Tensor, layout):
    r = rec.view(layout.chunks, layout.record_bytes)
    q = r[:, : layout.chunk_elems].contiguous().view(torch.int8).to(torch.int32)
    s = r[:, layout.scales_offset : layout.scales_offset + 4 * layout.groups_per_chunk]
    return q, s.contiguous().view(torch.float32)


@interpreted
@pytest.mark.parametrize("numel,chunks,group", [(1, 1, 128), (300, 1, 32), (1000, 4, 128), (515, 3, 64)])
def test_quantize_kernel_matches_reference(numel, chunks, group):
    g = torch.Generator().manual_seed(numel)
    x = (torch.randn(numel, generator=g) * 3).to(torch.bfloat16)
    layout = int8_layout(numel, chunks, group)
    ref = quantize_int8_ref(x, layout)
    buf = torch.full((layout.total_bytes,), 0x55, dtype=torch.uint8)
    dup = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    r8, r32 = _records(buf)
    d8, d32 = _records(dup)
    kernels.quantize(x, numel, r8.view(torch.int8), r32, layout, dup8=d8.view(torch.int8), dup32=d32)
    qk, sk = _q_and_scales(buf, layout)
    qr, sr = _q_and_scales(ref, layout)
    assert torch.equal(sk, sr)
    assert (qk - qr).abs().max().item() <= 1  # the GPU may contract x*inv+0.5 into one FMA
    assert torch.equal(buf[: layout.chunk_elems], dup[: layout.chunk_elems])
    assert torch.equal(qk, _q_and_scales(dup, layout)[0])


@interpreted
def test_reduce_kernel_is_the_rank_ordered_fp32_sum():
    world, numel, rank = 3, 5000, 1
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(numel, generator=g).to(torch.bfloat16) for _ in range(world)]
    stride = 5120
    slots = torch.zeros(world * stride, dtype=torch.bfloat16)
    for j, x in enumerate(xs):
        if j != rank:
            slots[j * stride : j * stride + numel] = x
    # fp32 out shows the accumulation exactly (the interpreter truncates fp32 -> bf16 where the GPU
    # rounds to nearest even, so the bf16 cast is checked bitwise in the gpu lane, here to one ulp)
    out = torch.empty(numel, dtype=torch.float32)
    out2 = torch.empty(numel, dtype=torch.float32)
    kernels.reduce_slots(slots, xs[rank], out, numel=numel, slot_stride=stride, rank=rank, world=world,
                         out2=out2)
    acc = torch.zeros(numel, dtype=torch.float32)
    for x in xs:
        acc += x.float()
    assert torch.equal(out, acc)
    assert torch.equal(out2, out)
    out_bf16 = torch.empty(numel, dtype=torch.bfloat16)
    kernels.reduce_slots(slots, xs[rank], out_bf16, numel=numel, slot_stride=stride, rank=rank,
                         world=world)
    torch.testing.assert_close(out_bf16.float(), acc, rtol=2**-7, atol=0)


@interpreted
def test_dequant_reduce_one_shot_and_requant():
    world, numel, group = 3, 700, 128
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(numel, generator=g) for _ in range(world)]
    layout = int8_layout(numel, 1, group)
    stride = layout.total_bytes
    slots = torch.zeros(world * stride, dtype=torch.uint8)
    for j, x in enumerate(xs):
        slots[j * stride : (j + 1) * stride] = quantize_int8_ref(x, layout)
    own = slots[1 * stride : 2 * stride].clone()
    out = torch.empty(numel, dtype=torch.float32)
    s8, s32 = slots.view(torch.int8), slots.view(torch.float32)
    kernels.dequant_reduce(s8, s32, own.view(torch.int8), own.view(torch.float32), out, layout,
                           n_valid=numel, slot_stride=stride, chunk_off=0, rank=1, world=world)
    want = sum(dequantize_int8_ref(slots[j * stride : (j + 1) * stride], layout, numel)
               for j in range(world))
    torch.testing.assert_close(out, want, rtol=0, atol=1e-5)

    res = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    dup = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    out2 = torch.empty(numel, dtype=torch.float32)
    kernels.dequant_reduce(s8, s32, own.view(torch.int8), own.view(torch.float32), out2, layout,
                           n_valid=numel, slot_stride=stride, chunk_off=0, rank=1, world=world,
                           res8=res.view(torch.int8), res32=res.view(torch.float32),
                           dup8=dup.view(torch.int8), dup32=dup.view(torch.float32))
    assert torch.equal(res, dup)
    # the kernel's own output is exactly what any rank decodes from the record it published
    assert torch.equal(out2, dequantize_int8_ref(res, layout, numel))
    assert (out2 - want).abs().max() <= want.abs().max() / 127


@interpreted
def test_dequant_records_skip_and_offsets():
    numel, group, n = 260, 128, 3
    layout = int8_layout(numel, 1, group)
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(numel, generator=g) for _ in range(n)]
    stride = layout.total_bytes + 256
    src = torch.zeros(n * stride, dtype=torch.uint8)
    for j, x in enumerate(xs):
        src[j * stride : j * stride + layout.total_bytes] = quantize_int8_ref(x, layout)
    out = torch.full((n * numel,), -7.0)
    kernels.dequant_records(src.view(torch.int8), src.view(torch.float32), out, layout, n_valid=numel,
                            total=n * numel, records=n, rec_stride=stride, out_stride=numel, skip=1)
    for j in range(n):
        got = out[j * numel : (j + 1) * numel]
        if j == 1:
            assert torch.all(got == -7.0)
        else:
            rec = src[j * stride : j * stride + layout.total_bytes]
            assert torch.equal(got, dequantize_int8_ref(rec, layout, numel))


@interpreted
def test_copy_records_strided_with_skip():
    src = torch.arange(3 * 10, dtype=torch.float16)
    dst = torch.full((3 * 7,), -1.0, dtype=torch.float16)
    kernels.copy_records(src, dst, n_valid=7, total=20, records=3, src_stride=10, dst_stride=7, skip=0)
    assert torch.all(dst[:7] == -1)
    assert torch.equal(dst[7:14], src[10:17])
    assert torch.equal(dst[14:20], src[20:26]) and dst[20] == -1  # `total` clips the last record
