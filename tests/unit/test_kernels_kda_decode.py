"""The one-launch KDA decode / MTP-verify kernel (glmctl.kernels.kda_decode) under TRITON_INTERPRET=1
at small shapes: against its torch reference (vLLM's conv update, recurrence and gated norm as
glmctl.kernels.kda / kda_conv state them) with speculative state columns, accepted-token offsets,
short and empty (padded) sequences, null (0) and -1 slots, plain decode, bf16 state, every config
(one program a head, and heads split over 2 or 4 programs with the last arrival's conv-state and
norm work); and against the plain token-by-token recurrence across two verify steps where only a
prefix of the drafts is accepted. The kernel rounds to bf16 by bit arithmetic, so outside the
recurrence's summation order it reproduces the reference's bits even in the interpreter."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.unit.interpreted_kernels import interpreted_kernels  # noqa: E402

_modules, interpreted, test_in_fresh_process, _interpreter = interpreted_kernels(
    __file__, "glmctl.kernels.kda_decode")
kd = _modules[0] if _modules else None

H, D, W, SPEC = 2, 32, 4, 3
LB = -5.0


def _layer(seed, tokens, slots=16, cols=W - 1 + SPEC, state_dtype=torch.float32):
    """Inputs as vLLM's layer holds them: row-strided slices of wider projection buffers, the
    conv state as the transposed view of an SD-layout cache, the state cache padded per slot."""
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(tokens, 3 * H * D + H + 7, generator=g).to(torch.bfloat16)
    cache_sd = torch.randn(slots, cols, 3 * H * D, generator=g).to(torch.bfloat16)
    state_pool = (torch.randn(slots, H * D * D + 64, generator=g) * 0.3).to(state_dtype)
    return dict(
        qkv=proj[:, : 3 * H * D], raw_beta=proj[:, 3 * H * D : 3 * H * D + H],
        conv_state=cache_sd.transpose(1, 2), conv_weight=torch.randn(3 * H * D, W, generator=g) * 0.5,
        raw_g=torch.randn(tokens, H * D, generator=g).to(torch.bfloat16),
        a_log=torch.randn(1, 1, H, 1, generator=g) * 0.3, g_bias=torch.randn(H * D, generator=g) * 0.2,
        state=state_pool[:, : H * D * D].view(slots, H, D, D),
        norm_gate=torch.randn(tokens, H, D, generator=g).to(torch.bfloat16),
        norm_weight=(torch.rand(D, generator=g) + 0.5).to(torch.bfloat16),
    )


def _clone(layer):
    out = dict(layer)
    for key in ("conv_state", "state"):
        out[key] = layer[key].clone()
    return out


def _run_both(layer, cu, idx, acc, config, norm, sentinel=3.0):
    tokens = layer["qkv"].shape[0]
    a, b = _clone(layer), _clone(layer)
    if not norm:
        for x in (a, b):
            x.pop("norm_gate"), x.pop("norm_weight")
    counters = kd.new_counters(cu.numel() - 1, H, "cpu")
    out_a = torch.full((tokens, H, D), sentinel, dtype=torch.bfloat16)
    out_b = out_a.clone()
    kd.kda_decode(cu_seqlens=cu, state_indices=idx, lower_bound=LB, num_accepted_tokens=acc, out=out_a,
                  counters=counters, config=kd.CONFIGS[config], **a)
    kd.kda_decode_ref(cu_seqlens=cu, state_indices=idx, lower_bound=LB, num_accepted_tokens=acc, out=out_b, **b)
    assert counters.count_nonzero().item() == 0
    return (out_a, a), (out_b, b)


def _assert_matches(got, ref, state_tol=1e-5):
    (out_a, a), (out_b, b) = got, ref
    # the recurrence's dot products sum in another order: a bf16 step either way at most
    diff = (out_a.float() - out_b.float()).abs()
    assert torch.all(diff <= 2 ** -7 * out_b.float().abs() + 1e-4), diff.max()
    assert torch.equal(a["conv_state"], b["conv_state"])
    torch.testing.assert_close(a["state"].float(), b["state"].float(), rtol=state_tol, atol=state_tol)


@interpreted
@pytest.mark.parametrize("config", ["v8w1", "v16w2", "v32w4"])
@pytest.mark.parametrize("norm", [False, True])
def test_mtp_verify_matches_reference(config, norm):
    # 4 sequences: full verify (accepted 2), 2 tokens (accepted 1, drafts' slots -1 / 0),
    # full verify resuming from the last column (accepted 4), and a padded empty sequence
    cu = torch.tensor([0, 4, 6, 10, 10], dtype=torch.int32)
    idx = torch.tensor([[1, 2, 3, 4], [5, 6, -1, 0], [7, 8, 9, 10], [0, 0, 0, 0]], dtype=torch.int32)
    acc = torch.tensor([2, 1, 4, 1], dtype=torch.int32)
    layer = _layer(seed=11, tokens=12)
    got, ref = _run_both(layer, cu, idx, acc, config, norm)
    _assert_matches(got, ref)
    # rows no sequence covers keep what was there; slot 0 and untouched slots are unchanged
    assert torch.all(got[0][10:].float() == 3.0)
    for slot in (0, 11, 15):
        assert torch.equal(got[1]["state"][slot], layer["state"][slot])
        assert torch.equal(got[1]["conv_state"][slot], layer["conv_state"][slot])


@interpreted
def test_null_state_slot_skips_the_recurrence_not_the_conv():
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    # sequence 1 resumes from column 1, whose slot is null: vLLM skips its recurrence (no state,
    # no output) but its conv kernel still slides the window of conv slot 5
    idx = torch.tensor([[1, 2, 3, 4], [5, 0, 6, 7]], dtype=torch.int32)
    acc = torch.tensor([1, 2], dtype=torch.int32)
    layer = _layer(seed=5, tokens=6)
    got, ref = _run_both(layer, cu, idx, acc, "v8w1", norm=True)
    _assert_matches(got, ref)
    assert torch.all(got[0][3:].float() == 3.0)
    for slot in (5, 6, 7):
        assert torch.equal(got[1]["state"][slot], layer["state"][slot])
    assert not torch.equal(got[1]["conv_state"][5], layer["conv_state"][5])


@interpreted
@pytest.mark.parametrize("config", ["v8w1", "v32w4"])
def test_plain_decode_matches_reference(config):
    cu = torch.tensor([0, 1, 2, 2, 3], dtype=torch.int32)
    idx = torch.tensor([3, 9, 0, 4], dtype=torch.int32)
    layer = _layer(seed=2, tokens=4, cols=W - 1)
    got, ref = _run_both(layer, cu, idx, None, config, norm=True)
    _assert_matches(got, ref)


@interpreted
def test_bf16_state_cache():
    cu = torch.tensor([0, 4, 7], dtype=torch.int32)
    idx = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=torch.int32)
    acc = torch.tensor([3, 1], dtype=torch.int32)
    layer = _layer(seed=8, tokens=7, state_dtype=torch.bfloat16)
    got, ref = _run_both(layer, cu, idx, acc, "v16w2", norm=False)
    _assert_matches(got, ref, state_tol=2 ** -7)


@interpreted
def test_two_verify_steps_equal_the_accepted_tokens_run_straight():
    """Step 1 verifies 4 tokens from slot 1 (states to slots 1..4); 2 are accepted; step 2
    verifies 3 more from column 1. Outputs of the accepted tokens and of step 2 equal one torch
    recurrence over conv(history + accepted tokens + step 2's tokens)."""
    from glmctl.kernels.kda import kda_gate, kda_recurrent

    torch.manual_seed(0)
    hist = torch.randn(3 * H * D, W - 1).to(torch.bfloat16)
    layer = _layer(seed=21, tokens=7)
    conv_state = torch.zeros(3, W - 1 + SPEC, 3 * H * D, dtype=torch.bfloat16).transpose(1, 2)
    conv_state[1, :, : W - 1] = hist
    state = torch.zeros(6, H, D, D)
    state[1] = torch.randn(H, D, D) * 0.3
    start = state[1].clone()
    common = dict(conv_weight=layer["conv_weight"], a_log=layer["a_log"], g_bias=layer["g_bias"],
                  conv_state=conv_state, state=state, lower_bound=LB,
                  counters=kd.new_counters(1, H, "cpu"), config=kd.CONFIGS["v8w1"])
    idx = torch.tensor([[1, 2, 3, 4]], dtype=torch.int32)
    rows1, rows2 = slice(0, 4), slice(4, 7)
    out1 = kd.kda_decode(layer["qkv"][rows1], raw_g=layer["raw_g"][rows1], raw_beta=layer["raw_beta"][rows1],
                         cu_seqlens=torch.tensor([0, 4], dtype=torch.int32), state_indices=idx,
                         num_accepted_tokens=torch.tensor([1], dtype=torch.int32), **common)
    out2 = kd.kda_decode(layer["qkv"][rows2], raw_g=layer["raw_g"][rows2], raw_beta=layer["raw_beta"][rows2],
                         cu_seqlens=torch.tensor([0, 3], dtype=torch.int32), state_indices=idx,
                         num_accepted_tokens=torch.tensor([2], dtype=torch.int32), **common)
    # straight through tokens 0, 1 (accepted) and 4, 5, 6 (step 2)
    keep = torch.tensor([0, 1, 4, 5, 6])
    seq = torch.cat([hist.float(), layer["qkv"][keep].float().t()], dim=1)
    w = layer["conv_weight"]
    conv = torch.stack([(seq[:, t : t + W] * w).sum(-1) for t in range(len(keep))], 1)
    qkv = torch.nn.functional.silu(conv).t().to(torch.bfloat16).float().reshape(len(keep), 3, H, D)
    g = kda_gate(layer["raw_g"][keep].reshape(-1, H, D), layer["a_log"], layer["g_bias"], LB)
    beta = torch.sigmoid(layer["raw_beta"][keep].float())
    ref = kda_recurrent(qkv[:, 0], qkv[:, 1], qkv[:, 2], g, beta, D ** -0.5, start.clone())
    got = torch.cat([out1[:2], out2]).float()
    assert torch.all((got - ref).abs() <= 2 ** -7 * ref.abs() + 1e-4)
    # and the conv state holds the window the next step would start from after accepting all 3
    torch.testing.assert_close(conv_state[1, :, 2 : 2 + W - 1].float(), seq[:, -(W - 1) :])


@interpreted
@pytest.mark.parametrize("spec", [True, False])
def test_the_gpu_benchs_layer_layout_runs_on_the_kernel(monkeypatch, spec):
    """bench/gpu/kda_bench.py's layers (what the GPU test and bench feed both kernels) at small
    shapes on the CPU: the kernel against the reference on them."""
    import sys

    from tests.conftest import REPO

    monkeypatch.syspath_prepend(str(REPO / "bench" / "gpu"))
    sys.modules.pop("kda_bench", None)
    import kda_bench as kb

    monkeypatch.setattr(kb, "H", H)
    monkeypatch.setattr(kb, "D", D)
    layer = kb.make_layer(3, seed=4, tokens_per_seq=4 if spec else 1, spec=spec, device="cpu")
    ours, ref = kb.clone_caches(layer), kb.clone_caches(layer)
    ours["out"].zero_(), ref["out"].zero_()
    kb.glmctl_step(ours)
    kd.kda_decode_ref(ref["qkv"], ref["conv_state"], ref["conv_w"], ref["g1"], ref["beta"][0], ref["a_log"],
                      ref["g_bias"], ref["state"], ref["cu"], ref["idx"], kb.LOWER_BOUND,
                      num_accepted_tokens=ref["acc"], out=ref["out"][0], norm_gate=ref["norm_gate"],
                      norm_weight=ref["norm_w"], norm_eps=kb.EPS)
    _assert_matches((ours["out"], ours), (ref["out"], ref))
    assert kb.step_bytes(layer) > layer["state"][0].numel() * 4 * 3


def test_config_choice_fills_the_gpu_at_both_decode_cells():
    assert kd is None or kd.choose_config(8 * 8).name == "v32w4"
    assert kd is None or kd.choose_config(1 * 8).name == "v8w1"


@interpreted
def test_launcher_refuses_what_it_cannot_run():
    layer = _layer(seed=1, tokens=5)
    for key in ("norm_gate", "norm_weight"):
        layer.pop(key)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="at most"):
        kd.kda_decode(cu_seqlens=cu, state_indices=torch.ones(1, 5, dtype=torch.int32), lower_bound=LB,
                      num_accepted_tokens=torch.ones(1, dtype=torch.int32), **layer)
    with pytest.raises(ValueError, match="num_accepted_tokens"):
        kd.kda_decode(cu_seqlens=cu, state_indices=torch.ones(1, 4, dtype=torch.int32), lower_bound=LB, **layer)
    with pytest.raises(ValueError, match="counters"):
        kd.kda_decode(cu_seqlens=cu, state_indices=torch.ones(1, 4, dtype=torch.int32), lower_bound=LB,
                      num_accepted_tokens=torch.ones(1, dtype=torch.int32), config=kd.CONFIGS["v8w1"], **layer)
