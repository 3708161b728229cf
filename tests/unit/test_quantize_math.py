"""Block-FP8 maths: round-trip error bounds on awkward shapes, scales, stripes, edge values."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from glmctl.quantize.fp8 import (  # noqa: E402
    FP8_MAX,
    ErrorStats,
    dequantize_block_fp8,
    quantize_block_fp8,
    scale_shape,
)

AWKWARD = [(1, 1), (3, 5), (7, 300), (127, 129), (128, 128), (129, 128), (300, 257), (1000, 64), (64, 1000)]


def _scales_per_element(scale_inv, shape, block):
    return scale_inv.repeat_interleave(block, 0)[: shape[0]].repeat_interleave(block, 1)[:, : shape[1]]


@pytest.mark.parametrize("shape", AWKWARD)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_error_is_within_half_an_fp8_step(shape, dtype):
    """Every element: |w - w'| <= max(|w| 2^-4, s 2^-10) (+ fp32 slack).

    e4m3 has 3 mantissa bits, so rounding to nearest is off by at most half a step, 2^-4 relative
    to the value's binade floor (hence to |w|) for normal values; below the normal range the step
    is the smallest subnormal 2^-9 times the block's scale s.
    """
    g = torch.Generator().manual_seed(hash(shape) % 2**31)
    # Heavy-tailed values over ~6 decades: exercises normals, subnormals and the block maximum.
    w = (torch.randn(shape, generator=g) * torch.exp(3 * torch.randn(shape, generator=g)))
    w = w.clamp(-60000, 60000).to(dtype)  # within fp16's range
    q, s = quantize_block_fp8(w, 128)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and tuple(s.shape) == scale_shape(shape, 128)
    approx = dequantize_block_fp8(q, s, 128)
    ref = w.float()
    bound = torch.maximum(ref.abs() * 2**-4, _scales_per_element(s, shape, 128) * 2**-10) * (1 + 1e-6)
    assert bool(((approx - ref).abs() <= bound).all())


@pytest.mark.parametrize("shape", [(256, 512), (300, 257), (129, 1000)])
def test_gaussian_weights_lose_about_31_db(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    q, s = quantize_block_fp8(w, 128)
    stats = ErrorStats()
    stats.add(w, dequantize_block_fp8(q, s, 128))
    assert 0.02 < stats.rel_rms < 0.032, stats.rel_rms  # ~0.027 measured
    assert 30 < stats.snr_db < 34
    assert stats.numel == w.numel()


def test_each_block_maximum_maps_to_448_and_scale_is_amax_over_448():
    w = torch.randn(300, 260, generator=torch.Generator().manual_seed(2))
    q, s = quantize_block_fp8(w, 128)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            qb = q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float()
            assert math.isclose(float(s[i, j]), float(blk.abs().max()) / FP8_MAX, rel_tol=1e-6)
            assert float(qb.abs().max()) == FP8_MAX


def test_zero_blocks_get_scale_one_and_stay_zero():
    w = torch.zeros(256, 256)
    w[:128, :128] = torch.randn(128, 128)
    q, s = quantize_block_fp8(w, 128)
    assert s[1, 1] == 1 and s[0, 1] == 1 and s[0, 0] != 1
    assert bool((q[128:, :].float() == 0).all())


def test_stripes_of_block_rows_give_the_whole_matrix_bit_for_bit():
    w = torch.randn(1000, 384, generator=torch.Generator().manual_seed(3)).bfloat16()
    q, s = quantize_block_fp8(w, 128)
    parts = [quantize_block_fp8(w[r:r + 256], 128) for r in range(0, 1000, 256)]
    assert torch.equal(torch.cat([p[0] for p in parts]).view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(torch.cat([p[1] for p in parts]), s)


def test_input_is_not_modified_including_fp32():
    w = torch.randn(130, 256)
    before = w.clone()
    quantize_block_fp8(w, 128)
    assert torch.equal(w, before)


def test_nan_or_inf_is_refused():
    w = torch.randn(128, 128)
    w[5, 7] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        quantize_block_fp8(w, 128)
    w[5, 7] = float("inf")
    with pytest.raises(ValueError):
        quantize_block_fp8(w, 128)


def test_torch_cast_saturates_at_448_and_rounds_ties_to_even():
    """The converter relies on this cast behaviour of torch (no clamp before the cast)."""
    x = torch.tensor([448.0, 448.00003, 463.9, 500.0, -1e6, 2**-10, 3 * 2**-10, 17.0, 19.0])
    got = x.to(torch.float8_e4m3fn).float().tolist()
    # 2^-10 is half the smallest subnormal (2^-9): tie -> even (0); 3*2^-10 -> 2*2^-9 (even);
    # 17 is halfway between 16 and 18 (step 2 in [16, 32)) -> 16; 19 -> 20 (even mantissas).
    assert got == [448.0, 448.0, 448.0, 448.0, -448.0, 0.0, 2**-8, 16.0, 20.0]


def test_error_stats_exact_and_degenerate_cases():
    a = torch.ones(4, 4)
    stats = ErrorStats()
    stats.add(a, a)
    assert stats.rel_rms == 0 and stats.snr_db == math.inf and stats.max_abs == 0
    stats.add(a, a * 1.1)
    assert stats.max_abs == pytest.approx(0.1, rel=1e-6)
    assert stats.snr_db == pytest.approx(10 * math.log10(32 / (16 * 0.01)), rel=1e-6)
