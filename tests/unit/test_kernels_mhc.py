"""mHC Triton kernels under TRITON_INTERPRET=1 against their torch references (and against vLLM
0.30's own torch mHC functions where vLLM is importable), at small shapes. Outputs are compared
after fresh random inputs every run; the kernels allocate their outputs, so an unwritten element
shows up as garbage against the reference."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.unit.interpreted_kernels import interpreted_kernels  # noqa: E402

_modules, interpreted, test_in_fresh_process, _interpreter = interpreted_kernels(
    __file__, "glmctl.kernels.mhc_pre_post", "glmctl.kernels.mhc_decode")


mhc = _modules[0] if _modules else None


def _inputs(t, n, h, seed):
    g = torch.Generator().manual_seed(seed)
    residual = torch.randn(t, n, h, generator=g).to(torch.bfloat16)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    n3 = n * (n + 2)
    fn = torch.randn(n3, n * h, generator=g) * (1.0 / (n * h) ** 0.5)
    scale = torch.rand(3, generator=g) + 0.5
    base = torch.randn(n3, generator=g) * 0.3
    post = torch.rand(t, n, 1, generator=g) * 2
    comb = torch.softmax(torch.randn(t, n, n, generator=g), dim=-1)
    weight = (1 + 0.2 * torch.randn(h, generator=g)).to(torch.bfloat16)
    return residual, x, fn, scale, base, post, comb, weight


GATES = dict(rms_eps=1e-6, hc_pre_eps=1e-6, hc_sinkhorn_eps=1e-6, hc_post_mult_value=2.0,
             sinkhorn_repeat=20)


def _close_bf16(a, b):
    """bf16 outputs within a few bf16 steps of the reference: the interpreter truncates fp32 ->
    bf16 instead of rounding to nearest (checked: every conversion equals the truncated value),
    which costs up to one step per rounding, and the normed output is rounded three times. The
    GPU lane holds the kernels to one step."""
    diff = (a.float() - b.float()).abs()
    tol = 2 ** -5 * b.float().abs() + 1e-3
    assert torch.all(diff <= tol), f"max excess {(diff - tol).max().item():.3g}"


# (tokens, streams, hidden): a decode batch, a prefill tile boundary, a hidden size that is no
# multiple of the tile, and a stream count that is not a power of two. Decode batches run both
# paths: one launch per block (fused, the default) and the two-launch pair (split).
SHAPES = [(3, 4, 64), (129, 4, 40), (5, 4, 200), (4, 3, 64)]
CASES = [(*shape, decode) for shape in SHAPES for decode in ("fused", "split")
         if shape[0] <= 64 or decode == "split"]


@interpreted
@pytest.mark.parametrize("t,n,h,decode", CASES)
@pytest.mark.parametrize("with_norm", [True, False])
def test_mhc_pre_matches_reference(t, n, h, with_norm, decode):
    residual, _, fn, scale, base, _, _, weight = _inputs(t, n, h, seed=t * 31 + h)
    norm = dict(norm_weight=weight, norm_eps=1e-5) if with_norm else {}
    post, comb, lin = mhc.mhc_pre(residual, fn, scale, base, **GATES, **norm, decode=decode)
    post_r, comb_r, lin_r = mhc.mhc_pre_ref(residual, fn, scale, base, **GATES, **norm)
    assert post.shape == (t, n, 1) and comb.shape == (t, n, n) and lin.shape == (t, h)
    torch.testing.assert_close(post, post_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(comb, comb_r, rtol=1e-5, atol=1e-5)
    _close_bf16(lin, lin_r)
    # Sinkhorn leaves comb doubly stochastic (to its epsilon).
    torch.testing.assert_close(comb.sum(-2), torch.ones(t, n), rtol=1e-4, atol=1e-4)


@interpreted
@pytest.mark.parametrize("t,n,h,decode", CASES)
def test_mhc_fused_post_pre_matches_reference(t, n, h, decode):
    residual, x, fn, scale, base, post_in, comb_in, weight = _inputs(t, n, h, seed=7 * t + h)
    args = (x, residual, post_in, comb_in, fn, scale, base)
    got = mhc.mhc_fused_post_pre(*args, **GATES, norm_weight=weight, norm_eps=1e-5, decode=decode)
    _close_bf16(got[0], mhc.mhc_post_ref(x, residual, post_in, comb_in))
    # The pre block reads the bf16 residual_cur the post block stored, as the unfused pair does.
    ref = mhc.mhc_pre_ref(got[0], fn, scale, base, **GATES, norm_weight=weight, norm_eps=1e-5)
    torch.testing.assert_close(got[1], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2], ref[1], rtol=1e-5, atol=1e-5)
    _close_bf16(got[3], ref[2])


@interpreted
@pytest.mark.parametrize("t,n,h", SHAPES)
def test_mhc_post_matches_reference(t, n, h):
    residual, x, _, _, _, post_in, comb_in, _ = _inputs(t, n, h, seed=t + 3 * h)
    _close_bf16(mhc.mhc_post(x, residual, post_in, comb_in),
                mhc.mhc_post_ref(x, residual, post_in, comb_in))


@interpreted
def test_empty_batch_returns_empty_outputs():
    residual, x, fn, scale, base, post_in, comb_in, _ = _inputs(0, 4, 64, seed=1)
    post, comb, lin = mhc.mhc_pre(residual, fn, scale, base, **GATES)
    assert post.shape == (0, 4, 1) and comb.shape == (0, 4, 4) and lin.shape == (0, 64)
    assert mhc.mhc_post(x, residual, post_in, comb_in).shape == (0, 4, 64)


@interpreted
def test_references_match_vllm_torch_functions():
    """Our references are vLLM's semantics: its torch mHC functions + its RMSNorm."""
    kernels = pytest.importorskip("vllm.model_executor.kernels.mhc.torch")
    residual, x, fn, scale, base, post_in, comb_in, weight = _inputs(6, 4, 64, seed=11)
    post_v, comb_v, lin_v = kernels.mhc_pre_torch(residual, fn, scale, base, **GATES)
    post_r, comb_r, lin_r = mhc.mhc_pre_ref(residual, fn, scale, base, **GATES)
    torch.testing.assert_close(post_r, post_v, rtol=0, atol=0)
    torch.testing.assert_close(comb_r, comb_v, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(lin_r, lin_v, rtol=0, atol=0)
    torch.testing.assert_close(mhc.mhc_post_ref(x, residual, post_in, comb_in),
                               kernels.mhc_post_torch(x, residual, post_in, comb_in),
                               rtol=0, atol=0)
    from vllm.ir.ops.layernorm import rms_norm

    torch.testing.assert_close(mhc.rms_norm_ref(lin_r, weight, 1e-5),
                               rms_norm(lin_r, weight, 1e-5), rtol=0, atol=0)


def test_rejects_wrong_shapes():
    from glmctl.kernels import mhc_pre_post as mod

    with pytest.raises(ValueError, match="residual must be"):
        mod.mhc_pre(torch.zeros(2, 4, 8), torch.zeros(24, 32), torch.ones(3), torch.zeros(24),
                    **GATES)
    with pytest.raises(ValueError, match="fn must be"):
        mod.mhc_pre(torch.zeros(2, 4, 8, dtype=torch.bfloat16), torch.zeros(24, 31),
                    torch.ones(3), torch.zeros(24), **GATES)
    with pytest.raises(ValueError, match="decode='fast' is not one of fused, split"):
        mod.mhc_pre(torch.zeros(2, 4, 8, dtype=torch.bfloat16), torch.zeros(24, 32),
                    torch.ones(3), torch.zeros(24), **GATES, decode="fast")
