"""GPU lane: glmctl's block-FP8 W8A16 linear (glmctl.kernels.fp8_block_linear) at the TP8 rank's
shapes of GLM-5.3-Flash against the fp32 dequantised product on the same GPU, the one-launch
split-K against the two-launch one (the same bits), CUDA-graph replay with new inputs and its
counters left at zero, and vLLM 0.30's Marlin FP8 on the same weights where vLLM is importable.

Tolerances: the products are exact (bf16 x, e4m3 -> bf16 weights, fp32 accumulation) and the
block scale is applied in fp32, so the output differs from the fp32 reference by its one bf16
rounding and the summation order: half a bf16 step plus a 1e-5 relative allowance. Marlin rounds
the block scales to bf16 first, so against it the bound is two steps."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

# (N, K) of the rank's block-FP8 linears at TP8: KDA qkv, f_b/g_b, o_proj; MLA fused q_a+kv_a,
# q_b, o_proj, indexer wq_b; dense MLP gate_up, down; shared expert gate_up, down
SHAPES = [(3072, 4096), (1024, 128), (4096, 1024), (2048, 4096), (2048, 1536), (4096, 2048),
          (512, 1536), (3072, 4096), (4096, 1536), (512, 4096), (4096, 256)]


@pytest.fixture(scope="module", autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")


def _weights(n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    weight = (torch.randn(n, k, generator=g, device="cuda") * 0.6).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-n // 128), -(-k // 128), generator=g, device="cuda") * 0.02 + 0.004
    return weight, scale


def _x(m, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)


def _poison_allocator():
    """Leave NaN in the caching allocator's free blocks, so an unwritten output shows."""
    junk = torch.full((64 << 20,), float("nan"), device="cuda")
    del junk


def _within(out, ref, steps):
    diff = (out.float() - ref).abs()
    tol = steps * 2 ** -8 * ref.abs() + 1e-5 * ref.abs().max()
    assert torch.isfinite(out.float()).all()
    assert torch.all(diff <= tol), f"max excess {(diff - tol).max().item():.3g}"


@pytest.mark.parametrize("m", [1, 4, 8, 32, 64, 65, 300, 2048])
def test_matches_fp32_reference_at_rank_shapes(m):
    from glmctl.kernels import fp8_block_linear as fbl

    counters = fbl.new_counters("cuda")
    for i, (n, k) in enumerate(SHAPES):
        weight, scale = _weights(n, k, seed=i)
        x = _x(m, k, seed=100 * i + m)
        bias = torch.randn(n, device="cuda").to(torch.bfloat16) if i % 3 == 0 else None
        ref = fbl.fp8_block_linear_ref(x, weight, scale, bias)
        _poison_allocator()
        one = fbl.fp8_block_linear(x, weight, scale, bias, counters=counters)
        _poison_allocator()
        two = fbl.fp8_block_linear(x, weight, scale, bias)
        _within(one, ref, 1)
        assert torch.equal(one, two), (n, k)
        assert counters.count_nonzero().item() == 0


def test_cuda_graph_replay_with_new_inputs():
    from glmctl.kernels import fp8_block_linear as fbl

    layers = [(*_weights(n, k, seed=7 + i), fbl.new_counters("cuda")) for i, (n, k) in enumerate(SHAPES[:4])]
    static = [_x(32, w.shape[1], seed=i) for i, (w, _, _) in enumerate(layers)]
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm-up (JIT) outside the capture
        for x, (w, s, c) in zip(static, layers, strict=True):
            fbl.fp8_block_linear(x, w, s, counters=c)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fbl.fp8_block_linear(x, w, s, counters=c) for x, (w, s, c) in zip(static, layers, strict=True)]
    for round_ in range(3):
        for i, x in enumerate(static):
            x.copy_(_x(32, x.shape[1], seed=1000 * round_ + i))
        graph.replay()
        torch.cuda.synchronize()
        for x, out, (w, s, c) in zip(static, outs, layers, strict=True):
            _within(out, fbl.fp8_block_linear_ref(x, w, s), 1)
            assert c.count_nonzero().item() == 0


def test_deterministic_across_runs():
    from glmctl.kernels import fp8_block_linear as fbl

    weight, scale = _weights(4096, 1024, seed=3)
    x = _x(32, 1024, seed=4)
    counters = fbl.new_counters("cuda")
    first = fbl.fp8_block_linear(x, weight, scale, counters=counters)
    for _ in range(20):
        assert torch.equal(fbl.fp8_block_linear(x, weight, scale, counters=counters), first)


@pytest.mark.parametrize("m", [8, 32, 2048])
def test_agrees_with_vllm_marlin(m):
    pytest.importorskip("vllm")
    from glmctl.kernels import fp8_block_linear as fbl

    marlin = pytest.importorskip("bench.fp8_marlin").MarlinFp8Linear
    for i, (n, k) in enumerate(SHAPES[:6]):
        weight, scale = _weights(n, k, seed=50 + i)
        x = _x(m, k, seed=60 + i)
        ref = fbl.fp8_block_linear_ref(x, weight, scale)
        _within(marlin(weight, scale)(x), ref, 2)
        _within(fbl.fp8_block_linear(x, weight, scale), ref, 1)


@pytest.mark.parametrize("m", [1, 4, 8, 32, 64])
def test_router_logits_match_cublas(m):
    """The router op's GEMV (bf16 gate, fp32 logits) against cuBLAS's bf16 -> fp32 product (vLLM's
    tier) and the fp32 reference: the same exact products summed in another order."""
    from glmctl.kernels import fp8_block_linear as fbl

    g = torch.Generator(device="cuda").manual_seed(m)
    weight = torch.randn(288, 4096, generator=g, device="cuda").to(torch.bfloat16)
    x = _x(m, 4096, seed=m + 5)
    counters = fbl.new_counters("cuda")
    _poison_allocator()
    out = fbl.bf16_linear(x, weight, counters=counters)
    ref = fbl.bf16_linear_ref(x, weight)
    cublas = torch.mm(x, weight.t(), out_dtype=torch.float32)
    scale = ref.abs().max()
    assert (out - ref).abs().max() <= 1e-5 * scale
    assert (cublas - ref).abs().max() <= 1e-5 * scale
    assert counters.count_nonzero().item() == 0


@pytest.mark.parametrize("m", [4, 32])
def test_bit_move_conversion_matches_reference(m):
    """The `_bits` decode tiles (e4m3 -> bf16 by integer bit moves, x 2^-120 folded into the scale)
    against the fp32 reference, subnormal e4m3 weights included: fails if the tensor cores flush
    bf16 subnormal inputs, which would rule the variant out."""
    from glmctl.kernels import fp8_block_linear as fbl

    for i, (n, k) in enumerate(SHAPES[:5]):
        weight, scale = _weights(n, k, seed=80 + i)
        weight[:, :128] = (torch.randn(n, 128, device="cuda") * 2 ** -8).to(torch.float8_e4m3fn)
        x = _x(m, k, seed=90 + i)
        p = fbl.plan(m, n, k, fp8_bits=True)
        out = fbl.fp8_block_linear(x, weight, scale, counters=fbl.new_counters("cuda"), config=p)
        _within(out, fbl.fp8_block_linear_ref(x, weight, scale), 1)
