"""The one-launch mHC decode block (``glmctl.kernels.mhc_decode``) under TRITON_INTERPRET=1
against the torch references of ``mhc_pre_post``, at small shapes: every named config, a config
that loops (several chunks per split and several finisher chunks, the last ones partial), single,
odd and full token groups, with and without the post block and the norm; and the arrival
counters, which every launch must leave at zero for the next one. The interpreter runs the
programs one after another, so the last program of each group is the one that finishes it; the
GPU lane covers concurrent arrival."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.unit.interpreted_kernels import interpreted_kernels  # noqa: E402

_modules, interpreted, test_in_fresh_process, _interpreter = interpreted_kernels(
    __file__, "glmctl.kernels.mhc_pre_post", "glmctl.kernels.mhc_decode")


mhc, dec = _modules if _modules else (None, None)

GATES = dict(rms_eps=1e-6, hc_pre_eps=1e-6, hc_sinkhorn_eps=1e-6, hc_post_mult_value=2.0,
             sinkhorn_repeat=20)


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


def _close_bf16(a, b):
    """Within a few bf16 steps: the interpreter truncates fp32 -> bf16 (see test_kernels_mhc)."""
    diff = (a.float() - b.float()).abs()
    tol = 2 ** -5 * b.float().abs() + 1e-3
    assert torch.all(diff <= tol), f"max excess {(diff - tol).max().item():.3g}"


def _looping():
    # hidden 100 in 16-column chunks: 7 chunks over 2 splits (4 + 3, the last one partial);
    # finisher chunks of 32 columns: 4, the last partial.
    return dec.FusedConfig("looping", block_t=2, block_h=16, splits=2, fin_h=32, num_warps=4)


# (config name, tokens, streams, hidden)
CASES = [("t1", 1, 4, 64), ("t1", 2, 4, 64), ("t2", 4, 4, 64), ("t2", 7, 3, 40),
         ("t4", 32, 4, 64), ("t4", 5, 4, 200), ("t8", 13, 4, 64), ("looping", 5, 4, 100),
         ("looping", 1, 3, 100)]


def _config(name):
    return _looping() if name == "looping" else {c.name: c for c in dec.FUSED_CONFIGS}[name]


@interpreted
@pytest.mark.parametrize("name,t,n,h", CASES)
@pytest.mark.parametrize("with_post", [True, False])
@pytest.mark.parametrize("with_norm", [True, False])
def test_block_matches_reference(name, t, n, h, with_post, with_norm):
    residual, x, fn, scale, base, post_in, comb_in, weight = _inputs(t, n, h, seed=3 * t + h)
    norm = dict(norm_weight=weight, norm_eps=1e-5) if with_norm else {}
    cfg = _config(name)
    if with_post:
        cur, post, comb, lin = mhc.mhc_fused_post_pre(x, residual, post_in, comb_in, fn, scale,
                                                      base, **GATES, **norm, decode=cfg)
        _close_bf16(cur, mhc.mhc_post_ref(x, residual, post_in, comb_in))
    else:
        cur = residual
        post, comb, lin = mhc.mhc_pre(residual, fn, scale, base, **GATES, **norm, decode=cfg)
    # The pre block reads the bf16 residual_cur the post block stored.
    post_r, comb_r, lin_r = mhc.mhc_pre_ref(cur, fn, scale, base, **GATES, **norm)
    assert post.shape == (t, n, 1) and comb.shape == (t, n, n) and lin.shape == (t, h)
    torch.testing.assert_close(post, post_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(comb, comb_r, rtol=1e-5, atol=1e-5)
    _close_bf16(lin, lin_r)
    torch.testing.assert_close(comb.sum(-2), torch.ones(t, n), rtol=1e-4, atol=1e-4)
    assert not dec.counters(residual.device).any()


@interpreted
def test_counters_are_reset_by_every_launch():
    """Each group's last program sets its counter back to 0: repeated launches of different
    sizes and configs all finish (a counter left behind would stop the next launch's group from
    ever finishing, leaving its outputs unwritten) and repeat bit for bit."""
    count = dec.counters(torch.device("cpu"))
    assert count.dtype == torch.int32 and count.numel() == dec.MAX_GROUPS
    runs = [(1, "t1"), (7, "t2"), (32, "t4"), (5, "looping"), (7, "t2"), (1, "t1")]
    first = {}
    for t, name in runs:
        residual, x, fn, scale, base, post_in, comb_in, weight = _inputs(t, 4, 100, seed=t)
        out = mhc.mhc_fused_post_pre(x, residual, post_in, comb_in, fn, scale, base, **GATES,
                                     norm_weight=weight, norm_eps=1e-5, decode=_config(name))
        assert not count.any(), f"counters left non-zero after {t} tokens ({name})"
        ref = mhc.mhc_pre_ref(out[0], fn, scale, base, **GATES, norm_weight=weight,
                              norm_eps=1e-5)
        torch.testing.assert_close(out[2], ref[1], rtol=1e-5, atol=1e-5)
        if (t, name) in first:
            for a, b in zip(out, first[(t, name)], strict=True):
                assert torch.equal(a, b), f"repeat of {t} tokens ({name}) differs"
        first[(t, name)] = out


@interpreted
def test_default_path_takes_the_fused_block_at_decode_sizes(monkeypatch):
    calls = []
    real = dec.fused_block

    def spy(*args):
        calls.append(args[-2].name)
        return real(*args)

    monkeypatch.setattr(dec, "fused_block", spy)
    for t in (1, 3, 9, 33):
        residual, x, fn, scale, base, post_in, comb_in, _ = _inputs(t, 4, 32, seed=t)
        mhc.mhc_fused_post_pre(x, residual, post_in, comb_in, fn, scale, base, **GATES)
    mhc.mhc_pre(residual[:1], fn, scale, base, **GATES, decode="split")
    assert calls == ["t1", "t2", "t4", "t8"]


def test_config_table():
    from glmctl.kernels import mhc_decode

    picks = {t: getattr(mhc_decode.pick_config(t), "name", None)
             for t in (1, 2, 3, 8, 9, 32, 33, 64, 65)}
    assert picks == {1: "t1", 2: "t1", 3: "t2", 8: "t2", 9: "t4", 32: "t4", 33: "t8",
                     64: "t8", 65: None}
    for most, cfg in mhc_decode.FUSED_BY_TOKENS:
        splits, chunks = cfg.plan(4096)
        assert splits * chunks * cfg.block_h >= 4096 > (splits * chunks - chunks) * cfg.block_h
        # about one program per SM at the row's largest batch (GLM-5.3-Flash's hidden size)
        assert -(-most // cfg.block_t) * splits <= 128, cfg
        assert -(-most // cfg.block_t) <= mhc_decode.MAX_GROUPS


def test_too_many_groups_raise():
    from glmctl.kernels import mhc_decode

    t = mhc_decode.MAX_GROUPS + 1
    residual = torch.zeros(t, 4, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="counters"):
        mhc_decode.fused_block(residual, None, None, None, torch.zeros(24, 64), torch.ones(3),
                               torch.zeros(24), *GATES.values(), None, 0.0,
                               mhc_decode.FUSED_T1, torch.zeros(mhc_decode.MAX_GROUPS,
                                                                dtype=torch.int32))
