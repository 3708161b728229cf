"""KDA and its short conv in torch (glmctl.kernels.kda*), against transformers' glm5_next maths and
against each other, including vLLM's varlen / state-slot / MTP conventions."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from glmctl.kernels.kda import (  # noqa: E402
    chunk_kda_varlen,
    fused_recurrent_kda_varlen,
    kda_chunked,
    kda_gate,
    kda_recurrent,
)
from glmctl.kernels.kda_conv import causal_conv1d_update_ref  # noqa: E402

H, K = 3, 16


def _inputs(t: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(t, H, K, generator=g) for _ in range(3))
    raw_g = torch.randn(t, H, K, generator=g)
    a_log = torch.randn(H, generator=g) * 0.5
    bias = torch.randn(H * K, generator=g) * 0.1
    beta = torch.rand(t, H, generator=g)
    return q, k, v, kda_gate(raw_g, a_log, bias, -5.0), beta, (raw_g, a_log, bias)


def test_gate_is_bounded_by_the_lower_bound():
    raw = torch.randn(50, H, K) * 10
    g = kda_gate(raw, torch.zeros(H), None, -5.0)
    assert (g >= -5.0).all() and (g <= 0).all() and g.min() < -4.9


def test_recurrent_matches_transformers_reference():
    from transformers.models.glm5_next.modeling_glm5_next import recurrent_kimi_delta_attention

    q, k, v, g, beta, _ = _inputs(37, 0)
    state0 = torch.randn(H, K, K)  # [H, V, K] (vLLM's layout)
    state = state0.clone()
    ours = kda_recurrent(q, k, v, g, beta, K ** -0.5, state)
    ref, ref_state = recurrent_kimi_delta_attention(
        q[None], k[None], v[None], g[None], beta[None],
        initial_state=state0.transpose(-1, -2)[None].clone(),  # transformers keeps [H, K, V]
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(ours, ref[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state, ref_state[0].transpose(-1, -2), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("t, chunk", [(1, 64), (5, 4), (64, 64), (100, 32), (130, 64)])
def test_chunked_equals_recurrent(t, chunk):
    q, k, v, g, beta, _ = _inputs(t, t)
    s1, s2 = torch.randn(H, K, K), None
    s2 = s1.clone()
    a = kda_recurrent(q, k, v, g, beta, K ** -0.5, s1)
    b = kda_chunked(q, k, v, g, beta, K ** -0.5, s2, chunk=chunk)
    torch.testing.assert_close(b, a, rtol=2e-4, atol=2e-5)
    torch.testing.assert_close(s2, s1, rtol=2e-4, atol=2e-5)


def test_varlen_prefill_then_decode_equals_one_pass():
    """vLLM conventions: prefill (chunk) writes each sequence's state, decode continues it."""
    lens = [7, 12]
    seqs = [_inputs(n + 3, 10 + i) for i, n in enumerate(lens)]
    a_log, bias = seqs[0][5][1], seqs[0][5][2]
    # prefill: the first lens[i] tokens of each sequence
    q = torch.cat([s[0][: n] for s, n in zip(seqs, lens, strict=True)])[None]
    k = torch.cat([s[1][: n] for s, n in zip(seqs, lens, strict=True)])[None]
    v = torch.cat([s[2][: n] for s, n in zip(seqs, lens, strict=True)])[None]
    rg = torch.cat([s[5][0][: n] for s, n in zip(seqs, lens, strict=True)])[None]
    beta = torch.cat([s[4][: n] for s, n in zip(seqs, lens, strict=True)])[None]
    cu = torch.tensor([0, lens[0], sum(lens)])
    out_pf, final = chunk_kda_varlen(q, k, v, rg, beta, a_log, bias,
                                     torch.zeros(2, H, K, K), cu, -5.0)
    cache = torch.zeros(4, H, K, K)
    cache[torch.tensor([2, 3])] = final  # slots 2, 3 (slot 0 is vLLM's null block)
    # decode: one token per sequence, beta as logits
    qd = torch.stack([s[0][n] for s, n in zip(seqs, lens, strict=True)])[None]
    kd = torch.stack([s[1][n] for s, n in zip(seqs, lens, strict=True)])[None]
    vd = torch.stack([s[2][n] for s, n in zip(seqs, lens, strict=True)])[None]
    gd = torch.stack([s[5][0][n] for s, n in zip(seqs, lens, strict=True)])[None]
    bd = torch.logit(torch.stack([s[4][n] for s, n in zip(seqs, lens, strict=True)]))[None]
    out_d, _ = fused_recurrent_kda_varlen(qd, kd, vd, gd, bd, a_log, bias, cache,
                                          torch.tensor([0, 1, 2]), torch.tensor([2, 3]), -5.0)
    for i, (s, n) in enumerate(zip(seqs, lens, strict=True)):
        g = kda_gate(s[5][0][: n + 1], a_log, bias, -5.0)
        ref = kda_recurrent(s[0][: n + 1], s[1][: n + 1], s[2][: n + 1], g, s[4][: n + 1],
                            K ** -0.5, torch.zeros(H, K, K))
        start = sum(lens[:i])
        torch.testing.assert_close(out_pf[0, start : start + n], ref[:n], rtol=2e-4, atol=2e-5)
        torch.testing.assert_close(out_d[0, i], ref[n], rtol=2e-4, atol=2e-5)


def test_spec_decode_stores_a_state_per_draft_token_and_resumes_from_the_accepted_one():
    q, k, v, g, beta, (raw, a_log, bias) = _inputs(6, 3)
    logits = torch.logit(beta)
    cache = torch.zeros(8, H, K, K)
    cache[1] = torch.randn(H, K, K)
    start = cache[1].clone()
    # step 1: verify 4 tokens from column 0 (num_accepted 1), states go to slots 1..4
    idx = torch.tensor([[1, 2, 3, 4]])
    out, _ = fused_recurrent_kda_varlen(q[None, :4], k[None, :4], v[None, :4], raw[None, :4],
                                        logits[None, :4], a_log, bias, cache, torch.tensor([0, 4]),
                                        idx, -5.0, num_accepted_tokens=torch.tensor([1]))
    states: list = []
    ref = kda_recurrent(q[:4], k[:4], v[:4], g[:4], beta[:4], K ** -0.5, start.clone(), states)
    torch.testing.assert_close(out[0], ref, rtol=2e-4, atol=2e-5)
    for col in range(4):
        torch.testing.assert_close(cache[idx[0, col]], states[col], rtol=2e-4, atol=2e-5)
    # step 2: 2 tokens were accepted -> resume from the state after token 1 (column 1)
    idx2 = idx
    out2, _ = fused_recurrent_kda_varlen(q[None, 4:6], k[None, 4:6], v[None, 4:6], raw[None, 4:6],
                                         logits[None, 4:6], a_log, bias, cache,
                                         torch.tensor([0, 2]), idx2, -5.0,
                                         num_accepted_tokens=torch.tensor([2]))
    ref2 = kda_recurrent(q[4:6], k[4:6], v[4:6], g[4:6], beta[4:6], K ** -0.5, states[1].clone())
    torch.testing.assert_close(out2[0], ref2, rtol=2e-4, atol=2e-5)


def test_null_slot_sequences_are_skipped():
    q, k, v, g, beta, (raw, a_log, bias) = _inputs(2, 4)
    cache = torch.randn(3, H, K, K)
    before = cache.clone()
    out, _ = fused_recurrent_kda_varlen(q[None], k[None], v[None], raw[None], torch.logit(beta)[None],
                                        a_log, bias, cache, torch.tensor([0, 1, 2]),
                                        torch.tensor([0, 2]), -5.0)
    assert torch.equal(cache[:2], before[:2]) and not torch.equal(cache[2], before[2])
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))


def _conv_ref(history: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    full = torch.cat([history, x], dim=1)
    out = torch.stack([(full[:, t : t + w.shape[1]] * w).sum(-1) for t in range(x.shape[1])], 1)
    return torch.nn.functional.silu(out)


def test_conv_update_plain_decode_slides_the_window():
    dim, width = 6, 4
    w = torch.randn(dim, width)
    state = torch.zeros(3, dim, width - 1)
    state[1] = torch.randn(dim, width - 1)
    hist = state[1].clone()
    x = torch.randn(1, dim)
    y = causal_conv1d_update_ref(x, state, w, activation="silu", conv_state_indices=torch.tensor([1]))
    torch.testing.assert_close(y[0], _conv_ref(hist, x.t(), w)[:, 0])
    torch.testing.assert_close(state[1], torch.cat([hist[:, 1:], x.t()], dim=1))


def test_conv_update_spec_decode_keeps_every_draft_for_the_next_step():
    dim, width, spec = 5, 4, 3
    w = torch.randn(dim, width)
    state = torch.zeros(2, dim, width - 1 + spec)
    hist = torch.randn(dim, width - 1)
    state[1, :, : width - 1] = hist
    x = torch.randn(spec + 1, dim)
    qsl = torch.tensor([0, spec + 1])
    y = causal_conv1d_update_ref(x, state, w, activation="silu", conv_state_indices=torch.tensor([1]),
                                 num_accepted_tokens=torch.tensor([1]), query_start_loc=qsl,
                                 max_query_len=spec + 1)
    torch.testing.assert_close(y, _conv_ref(hist, x.t(), w).t())
    # accept 2 tokens: the next step's window is the last width-1 inputs up to x[1]
    expected = torch.cat([hist, x.t()], dim=1)[:, 2 : 2 + width - 1]
    got = state[1, :, 1 : 1 + width - 1]  # window starts at column accepted - 1 = 1
    torch.testing.assert_close(got, expected)
