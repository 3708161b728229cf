"""The INT8 payload codec (torch reference): error bounds, groups, chunked records, odd sizes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from glmctl.collectives.call_plan import int8_layout  # noqa: E402
from tests.int8_codec_ref import (  # noqa: E402
    all_reduce_int8_ref,
    dequantize_int8_ref,
    int8_round_trip_ref,
    quantize_int8_ref,
)


def _group_amax(x: torch.Tensor, layout) -> torch.Tensor:
    """amax of the group each element belongs to, element by element."""
    padded = torch.zeros(layout.chunks * layout.chunk_elems)
    padded[: x.numel()] = x.reshape(-1).float()
    amax = padded.view(-1, layout.group).abs().amax(dim=1)
    return amax.repeat_interleave(layout.group)[: x.numel()]


@pytest.mark.parametrize("numel", [1, 127, 128, 129, 1000, 4099, 3 * 128])
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("chunks", [1, 4])
def test_round_trip_error_is_at_most_half_a_step(numel, group, chunks):
    g = torch.Generator().manual_seed(numel * group + chunks)
    x = torch.randn(numel, generator=g) * torch.logspace(-3, 3, numel)  # groups of very different scale
    layout = int8_layout(numel, chunks, group)
    y = dequantize_int8_ref(quantize_int8_ref(x, layout), layout, numel)
    bound = _group_amax(x, layout) / 254 * (1 + 1e-5) + 1e-30
    assert torch.all((y - x).abs() <= bound)


def test_zeros_and_exact_values_survive():
    x = torch.zeros(300)
    assert torch.equal(int8_round_trip_ref(x), x)
    x = torch.tensor([127.0, -127.0, 0.0, 1.0, -64.0] + [0.0] * 123)  # amax 127: scale exactly 1
    assert torch.equal(int8_round_trip_ref(x), x)


def test_groups_are_independent():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(512, generator=g)
    layout = int8_layout(512, 1, 128)
    base = quantize_int8_ref(x, layout)
    x2 = x.clone()
    x2[128:256] *= 1000  # only group 1 changes
    other = quantize_int8_ref(x2, layout)
    q0, q1 = base[:512].view(torch.int8), other[:512].view(torch.int8)
    assert torch.equal(q0[:128], q1[:128]) and torch.equal(q0[256:], q1[256:])
    s0 = base[512 : 512 + 16].view(torch.float32)
    s1 = other[512 : 512 + 16].view(torch.float32)
    assert s0[0] == s1[0] and s0[2] == s1[2] and s0[3] == s1[3]
    assert s1[1].item() == pytest.approx(s0[1].item() * 1000, rel=1e-5)


def test_record_layout_and_chunks():
    numel, chunks, group = 1000, 4, 128
    layout = int8_layout(numel, chunks, group)
    assert layout.chunk_elems == 256 and layout.chunk_elems % group == 0
    assert layout.record_bytes % 256 == 0 and layout.record_bytes >= 256 + 4 * 2
    x = torch.randn(numel, generator=torch.Generator().manual_seed(4))
    rec = quantize_int8_ref(x, layout).view(chunks, layout.record_bytes)
    # chunk 3 holds elements 768..999 and zero padding; its record equals encoding that slice alone
    alone = int8_layout(256, 1, group)
    tail = torch.zeros(256)
    tail[: numel - 768] = x[768:]
    assert torch.equal(rec[3, : alone.record_bytes], quantize_int8_ref(tail, alone)[: alone.record_bytes])
    assert torch.all(rec[3, numel - 768 : 256] == 0)


@pytest.mark.parametrize("world,two_shot", [(2, False), (4, False), (4, True), (8, True)])
def test_int8_all_reduce_error_within_one_percent_of_rms(world, two_shot):
    g = torch.Generator().manual_seed(world)
    xs = [torch.randn(1 << 16, generator=g).to(torch.bfloat16) for _ in range(world)]
    exact = sum(x.double() for x in xs)
    got = all_reduce_int8_ref(xs, two_shot=two_shot).double()
    rel = ((got - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()).item()
    assert rel <= 0.01, rel
    # and it is a real quantization, not a pass-through: error well above bf16 rounding alone
    assert rel > 0.002
