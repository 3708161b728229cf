"""The block-FP8 W8A16 linear (glmctl.kernels.fp8_block_linear) under TRITON_INTERPRET=1 against
its fp32 reference at small shapes: decode and prefill tiles, split-K summed by the last arrival
and by the second kernel (the same bits), partial blocks in N and K, bias, and the counters left
at zero for the next call. Fresh random inputs every case; outputs are allocated by the kernel, so
an unwritten element shows up as garbage against the reference."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.unit.interpreted_kernels import interpreted_kernels  # noqa: E402

_modules, interpreted, test_in_fresh_process, _interpreter = interpreted_kernels(
    __file__, "glmctl.kernels.fp8_block_linear")
fbl = _modules[0] if _modules else None


def _weights(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=g) * 0.5).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-n // 128), -(-k // 128), generator=g) * 0.02 + 0.005
    return weight, scale


def _x(m, k, seed):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _close(out, ref):
    """Within two bf16 steps: the interpreter truncates fp32 -> bf16 (one step) and its fp32 dot
    sums in another order than the reference."""
    assert out.dtype == torch.bfloat16
    assert torch.isfinite(out.float()).all()
    diff = (out.float() - ref).abs()
    tol = 2 ** -7 * ref.abs() + 1e-3 * ref.abs().max()
    assert torch.all(diff <= tol), f"max excess {(diff - tol).max().item():.3g}"


@interpreted
@pytest.mark.parametrize("m,n,k", [(1, 64, 512), (5, 200, 600), (16, 96, 520), (33, 64, 1024), (64, 32, 512)])
def test_decode_matches_reference_with_and_without_counters(m, n, k):
    weight, scale = _weights(n, k, seed=m * 7 + n)
    x = _x(m, k, seed=n + k)
    bias = torch.randn(n).to(torch.bfloat16)
    p = fbl.plan(m, n, k)
    assert p.config.block_m >= min(m, 16) and p.split_k > 1  # these shapes all split K
    counters = fbl.new_counters("cpu")
    one = fbl.fp8_block_linear(x, weight, scale, bias, counters=counters)
    two = fbl.fp8_block_linear(x, weight, scale, bias)
    ref = fbl.fp8_block_linear_ref(x, weight, scale, bias)
    _close(one, ref)
    assert torch.equal(one, two)  # the last arrival sums in the reduce kernel's order
    assert counters.count_nonzero() == 0  # reset for the next call


@interpreted
def test_counters_reset_across_calls_and_shapes():
    counters = fbl.new_counters("cpu")
    for i, (m, n, k) in enumerate([(8, 96, 512), (2, 160, 256), (8, 96, 512)]):
        weight, scale = _weights(n, k, seed=100 + i)
        x = _x(m, k, seed=200 + i)
        _close(fbl.fp8_block_linear(x, weight, scale, counters=counters),
               fbl.fp8_block_linear_ref(x, weight, scale))
        assert counters.count_nonzero() == 0


@interpreted
def test_no_split_and_leading_dims():
    n, k = 64, 128  # one K block: no split
    weight, scale = _weights(n, k, seed=3)
    assert fbl.plan(4, n, k).split_k == 1
    x = _x(6, k, seed=4).view(2, 3, k)
    out = fbl.fp8_block_linear(x, weight, scale, counters=fbl.new_counters("cpu"))
    assert out.shape == (2, 3, n)
    _close(out.view(6, n), fbl.fp8_block_linear_ref(x.view(6, k), weight, scale))


@interpreted
def test_prefill_tiles_over_several_m_tiles():
    m, n, k = 130, 136, 512  # three 64-row tiles, a partial 128-wide N tile, two K splits
    weight, scale = _weights(n, k, seed=5)
    x = _x(m, k, seed=6)
    p = fbl.plan(m, n, k)
    assert p.config is fbl.PREFILL and p.grid(m, n)[2] == 3 and p.split_k == 2
    counters = fbl.new_counters("cpu")
    out = fbl.fp8_block_linear(x, weight, scale, counters=counters)
    _close(out, fbl.fp8_block_linear_ref(x, weight, scale))
    assert counters.count_nonzero() == 0


@interpreted
def test_strided_rows_and_empty_batch():
    n, k = 64, 256
    weight, scale = _weights(n, k, seed=8)
    wide = _x(4, 2 * k, seed=9)
    x = wide[:, :k]  # row stride 2k, unit column stride
    _close(fbl.fp8_block_linear(x, weight, scale), fbl.fp8_block_linear_ref(x, weight, scale))
    assert fbl.fp8_block_linear(_x(0, k, seed=1), weight, scale).shape == (0, n)


@interpreted
@pytest.mark.parametrize("m", [3, 32])
def test_bit_move_conversion(m):
    """e4m3 -> bf16 by bit moves (value x 2^-120, undone in the scale), subnormals included."""
    n, k = 96, 512
    weight, scale = _weights(n, k, seed=m)
    weight[:, :64] = (torch.randn(n, 64) * 2 ** -8).to(torch.float8_e4m3fn)  # subnormal e4m3 values
    weight[0, 0] = torch.tensor(-448.0).to(torch.float8_e4m3fn)
    x = _x(m, k, seed=m + 3)
    p = fbl.plan(m, n, k, fp8_bits=True)
    assert p.config.fp8_bits and p.config.name.endswith("_bits")
    out = fbl.fp8_block_linear(x, weight, scale, counters=fbl.new_counters("cpu"), config=p)
    _close(out, fbl.fp8_block_linear_ref(x, weight, scale))


@interpreted
@pytest.mark.parametrize("m", [1, 8, 32])
def test_bf16_weights_fp32_out(m):
    n, k = 288, 512  # the router's shape, narrowed in K
    g = torch.Generator().manual_seed(m)
    weight = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = _x(m, k, seed=m + 1)
    counters = fbl.new_counters("cpu")
    out = fbl.bf16_linear(x, weight, counters=counters)
    ref = fbl.bf16_linear_ref(x, weight)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-4)  # fp32 sums, no rounding
    assert torch.equal(out, fbl.bf16_linear(x, weight))  # two-launch split: the same bits
    assert counters.count_nonzero() == 0
    with pytest.raises(ValueError, match="bf16 weight"):
        fbl.bf16_linear(x, weight.float())


def test_plan_rules():
    from glmctl.kernels import fp8_block_linear as plan_mod

    for m in (1, 8, 16, 17, 32, 33, 64, 65, 2048):
        for n, k in ((512, 4096), (4096, 256), (1024, 128), (3072, 4096), (2048, 1536)):
            p = plan_mod.plan(m, n, k)
            tiles = p.grid(m, n)[0] * p.grid(m, n)[2]
            k_blocks = -(-k // plan_mod.BLOCK)
            assert 1 <= p.split_k <= plan_mod.MAX_SPLIT_K
            assert (p.split_k - 1) * p.blocks_per_split < k_blocks <= p.split_k * p.blocks_per_split
            if p.split_k > 1:  # the counters always cover a split launch's tiles
                assert tiles < plan_mod.TARGET_PROGRAMS
                assert p.blocks_per_split >= plan_mod.MIN_BLOCKS_PER_SPLIT
            assert p.config.block_m >= min(m, 16) if m <= plan_mod.DECODE_MAX_M else p.config is plan_mod.PREFILL
            assert p.config.shared_bytes <= 99 * 1024
    with pytest.raises(ValueError):
        plan_mod.plan(0, 64, 128)


def test_shape_errors():
    from glmctl.kernels import fp8_block_linear as mod

    weight = torch.zeros(64, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="block grid"):
        mod.fp8_block_linear(torch.zeros(2, 256, dtype=torch.bfloat16), weight, torch.ones(1, 1))
    with pytest.raises(ValueError, match="K-contiguous"):
        mod.fp8_block_linear(torch.zeros(2, 64, dtype=torch.bfloat16), weight.t(), torch.ones(2, 1))
