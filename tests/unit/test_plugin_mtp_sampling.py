"""MTP verification on vLLM CPU (`glmctl.plugin.platforms.cpu.cpu_mtp`): the torch stand-ins for vLLM's
rejection-sampler kernels follow the kernels' per-request semantics, and speculative sampling
with them leaves the target distribution unchanged. No vLLM needed; fresh random inputs."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from glmctl.plugin.platforms.cpu.cpu_mtp import (  # noqa: E402
    expand_to_tokens,
    rejection_greedy_sample,
    rejection_random_sample,
    sample_recovered_tokens,
)

PLACEHOLDER = -1


def _kernel_semantics(cu, drafts, draft_probs, target_probs, bonus, recovered, uniform, is_greedy,
                      max_spec_len):
    """vLLM's rejection_random_sample_kernel, one request and one position at a time."""
    out = torch.full((len(cu), max_spec_len + 1), PLACEHOLDER, dtype=torch.int32)
    start = 0
    for req, end in enumerate(cu.tolist()):
        if not is_greedy[req]:
            rejected = False
            for pos in range(end - start):
                t = start + pos
                d = int(drafts[t])
                if d < 0:
                    ok = False
                else:
                    q = 1.0 if draft_probs is None else float(draft_probs[t, d])
                    ok = q > 0 and float(target_probs[t, d]) / q >= float(uniform[t])
                out[req, pos] = d if ok else int(recovered[t])
                if not ok:
                    rejected = True
                    break
            if not rejected:
                out[req, end - start] = int(bonus[req])
        start = end
    return out


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_rejection_random_sample_follows_the_kernel(with_draft_probs):
    vocab, counts = 7, [3, 0, 3, 2, 1, 3]
    cu = torch.tensor(counts).cumsum(0).int()
    n = int(cu[-1])
    target = torch.softmax(torch.randn(n, vocab) * 2, -1)
    drafts = torch.randint(0, vocab, (n,)).int()
    drafts[4] = -1  # padded draft: always rejected
    draft_probs = torch.softmax(torch.randn(n, vocab), -1) if with_draft_probs else None
    if draft_probs is not None:
        draft_probs[6, drafts[6]] = 0  # zero draft probability: rejected, never a division
    uniform = torch.rand(n, dtype=torch.float64)
    uniform[0] = 0.0  # always accepted
    bonus = torch.randint(0, vocab, (len(counts),))
    recovered = torch.randint(0, vocab, (n,)).int()
    is_greedy = torch.tensor([False, False, False, True, False, False])
    got = torch.full((len(counts), 4), PLACEHOLDER, dtype=torch.int32)
    rejection_random_sample(got, cu, drafts, draft_probs, target, bonus, recovered, uniform,
                            is_greedy, 3, None)
    want = _kernel_semantics(cu, drafts, draft_probs, target, bonus, recovered, uniform,
                             is_greedy, 3)
    assert torch.equal(got, want)
    assert got[3].eq(PLACEHOLDER).all()  # greedy request: left to the greedy kernel


def test_rejection_greedy_sample_stops_after_the_first_mismatch():
    cu = torch.tensor([3, 6, 8]).int()
    drafts = torch.tensor([5, 6, 7, 1, 2, 3, 4, 4]).int()
    argmax = torch.tensor([5, 6, 7, 1, 9, 3, 4, 0])
    bonus = torch.tensor([11, 12, 13])
    out = torch.full((3, 4), PLACEHOLDER, dtype=torch.int32)
    rejection_greedy_sample(out, cu, drafts, argmax, bonus, None, 3, None, None)
    assert out.tolist() == [[5, 6, 7, 11], [1, 9, -1, -1], [4, 0, -1, -1]]


def test_recovered_tokens_sample_the_residual_and_expand_repeats_per_request():
    vocab = 6
    cu = torch.tensor([2, 2, 5]).int()
    target = torch.softmax(torch.randn(5, vocab), -1)
    drafts = torch.tensor([1, 3, 0, 5, 2]).int()
    inv_q = 1 / torch.empty(3, vocab).exponential_()
    out = torch.empty(5, dtype=torch.int32)
    sample_recovered_tokens(out, cu, drafts, None, target, inv_q, max_spec_len=3)
    req = [0, 0, 2, 2, 2]
    for t in range(5):
        score = target[t] * inv_q[req[t]]
        score[drafts[t]] = 0  # the draft token is never its own fallback
        assert int(out[t]) == int(score.argmax()) != int(drafts[t])
    draft_probs = torch.softmax(torch.randn(5, vocab), -1)
    sample_recovered_tokens(out, cu, drafts, draft_probs, target, inv_q, max_spec_len=3)
    residual = (target - draft_probs).clamp_min(0) * inv_q[req]
    assert torch.equal(out.long(), residual.argmax(-1))
    temps = torch.tensor([0.7, -1.0, 2.0])
    expanded = torch.full((5,), float("nan"))
    expand_to_tokens(expanded, temps, cu, -1.0, 1.0)  # greedy (-1) -> 1, as vLLM's kernel does
    assert expanded.tolist() == pytest.approx([0.7, 0.7, 2.0, 2.0, 2.0])


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_speculative_sampling_keeps_the_target_distribution(with_draft_probs):
    """One draft per request, N requests: the first emitted token is distributed as the target,
    whatever the draft distribution (the point of rejection sampling)."""
    vocab, n = 5, 20000
    p = torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1])
    proposal = torch.tensor([0.6, 0.1, 0.1, 0.1, 0.1])  # far from the target
    drafts = torch.multinomial(proposal, n, replacement=True).int()
    target = p.expand(n, vocab).contiguous()
    draft_probs = proposal.expand(n, vocab).contiguous() if with_draft_probs else None
    cu = torch.arange(1, n + 1).int()
    inv_q = 1 / torch.empty(n, vocab).exponential_()
    recovered = torch.empty(n, dtype=torch.int32)
    sample_recovered_tokens(recovered, cu, drafts, draft_probs, target, inv_q, max_spec_len=1)
    out = torch.full((n, 2), PLACEHOLDER, dtype=torch.int32)
    rejection_random_sample(out, cu, drafts, draft_probs, target, torch.zeros(n, dtype=torch.long),
                            recovered, torch.rand(n, dtype=torch.float64),
                            torch.zeros(n, dtype=torch.bool), 1, None)
    freq = torch.bincount(out[:, 0].long(), minlength=vocab).double() / n
    # With draft probabilities q this is exact speculative sampling. Without them vLLM treats each
    # draft as certain (q = 1): keep d with probability p(d), else draw from p without d, so
    # P(v) = r(v) p(v) + sum_{d != v} r(d) (1 - p(d)) p(v) / (1 - p(d)) = p(v) for any r.
    assert torch.allclose(freq, p.double(), atol=4 * (0.25 / n) ** 0.5)
