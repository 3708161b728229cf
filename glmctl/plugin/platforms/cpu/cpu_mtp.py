"""MTP speculative decoding on vLLM's CPU platform: the draft-step and verification kernels.

vLLM CPU rebinds these Triton kernels to C++ versions by module name, but the drafter and the
rejection sampler call them through names and dispatchers bound at import, so on CPU they would
still launch Triton. Each function here computes what the kernel it replaces writes (same
arguments as vLLM's dispatch functions), in torch:

  draft step        `eagle_step_update_slot_mapping_and_metadata` (positions, slots, seq lens)
  greedy verify     `_rejection_greedy_sample`
  sampled verify    `_rejection_random_sample`, `_sample_recovered_tokens` and `_expand`
                    (temperature > 0; vLLM's C++ expand would write an int64 copy of the float
                    temperatures)
"""

from __future__ import annotations

import torch


def install() -> None:
    _install_eagle_step_kernel()
    _install_rejection_sampling()


def eagle_step_update_slot_mapping_and_metadata(positions_1d, block_table_tensor, seq_lens,
                                                 block_size, max_model_len, out_clamped_positions,
                                                 out_slot_mapping, input_batch_size=None):
    """One autoregressive draft step: position + 1 (0 past max_model_len), its slot, seq_len + 1.

    Same outputs as vLLM's Triton kernel; slots past the batch (graph padding) get -1.
    """
    batch = positions_1d.shape[0]
    input_batch_size = batch if input_batch_size is None else input_batch_size
    new = positions_1d + 1
    exceeds = new >= max_model_len
    clamped = torch.where(exceeds, torch.zeros_like(new), new)
    block = (clamped // block_size).clamp_max(block_table_tensor.shape[1] - 1)
    blocks = block_table_tensor[torch.arange(batch, device=block.device), block].to(torch.int64)
    slots = torch.where(exceeds, -1, blocks * block_size + clamped % block_size)
    out_clamped_positions[:batch] = clamped.to(out_clamped_positions.dtype)
    out_slot_mapping[:batch] = slots.to(out_slot_mapping.dtype)
    out_slot_mapping[batch:input_batch_size] = -1
    new_lens = torch.where(exceeds, torch.ones_like(seq_lens[:batch]), seq_lens[:batch] + 1)
    seq_lens[:batch] = new_lens.clamp_max(max_model_len)


def _install_eagle_step_kernel() -> None:
    """vLLM CPU swaps a C++ version of the draft-step kernel in under a module name the drafter
    no longer calls (and with a stale signature); give the drafter a torch version by name."""
    from vllm.v1.spec_decode import llm_base_proposer

    llm_base_proposer.eagle_step_update_slot_mapping_and_metadata = (
        eagle_step_update_slot_mapping_and_metadata
    )


def rejection_greedy_sample(output_token_ids, cu_num_draft_tokens, draft_token_ids, target_argmax,
                            bonus_token_ids, is_greedy, max_spec_len, uniform_probs,
                            synthetic_conditional_rates):
    """Greedy verification of draft tokens (vLLM's kernel semantics): per request, emit the
    target's argmax at each draft position up to and including the first mismatch; if every
    draft matched, append the bonus token."""
    if synthetic_conditional_rates is not None:
        raise NotImplementedError("synthetic acceptance rates on vLLM CPU")
    ends = cu_num_draft_tokens.tolist()
    for req, end in enumerate(ends):
        if is_greedy is not None and not bool(is_greedy[req]):
            continue
        start = ends[req - 1] if req else 0
        drafts = draft_token_ids[start:end].to(torch.int64)
        target = target_argmax[start:end].to(torch.int64)
        mismatch = (drafts != target).nonzero()
        keep = int(mismatch[0]) + 1 if mismatch.numel() else end - start
        output_token_ids[req, :keep] = target[:keep].to(output_token_ids.dtype)
        if not mismatch.numel():
            output_token_ids[req, keep] = bonus_token_ids[req].to(output_token_ids.dtype)


def rejection_random_sample(output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs,
                            target_probs, bonus_token_ids, recovered_token_ids, uniform_probs,
                            is_greedy, max_spec_len, synthetic_conditional_rates):
    """Speculative sampling (vLLM's `rejection_random_sample_kernel` semantics) for the
    non-greedy requests: draft `d` at a position is accepted iff `d >= 0`, its draft probability
    `q` (1 without draft probabilities) is > 0 and `p / q >= u` (`p`: target probability, `u`:
    the position's uniform sample); the first rejected position emits its recovered token and
    ends the request's output; if every draft is accepted the bonus token follows."""
    if synthetic_conditional_rates is not None:
        raise NotImplementedError("synthetic acceptance rates on vLLM CPU")
    num_tokens = draft_token_ids.shape[0]
    if num_tokens == 0:
        return
    drafts = draft_token_ids.to(torch.int64)
    rows = torch.arange(num_tokens, device=drafts.device)
    safe = drafts.clamp_min(0)
    p = target_probs[rows, safe]
    q = torch.ones_like(p) if draft_probs is None else draft_probs[rows, safe]
    accepted = (drafts >= 0) & (q > 0) & (p / q >= uniform_probs)
    ends = cu_num_draft_tokens.tolist()
    for req, end in enumerate(ends):
        if bool(is_greedy[req]):
            continue
        start = ends[req - 1] if req else 0
        rejected = (~accepted[start:end]).nonzero()
        keep = int(rejected[0]) if rejected.numel() else end - start
        out = output_token_ids[req]
        out[:keep] = drafts[start : start + keep].to(out.dtype)
        if rejected.numel():
            out[keep] = recovered_token_ids[start + keep].to(out.dtype)
        else:
            out[keep] = bonus_token_ids[req].to(out.dtype)


def sample_recovered_tokens(output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs,
                            target_probs, inv_q, *, max_spec_len):
    """The token a rejected draft position falls back to (vLLM's
    `sample_recovered_tokens_kernel`): argmax over the vocabulary of `max(p - q, 0) / e`, `e`
    the request's exponential noise (`inv_q = 1 / e`), i.e. a sample from the normalised
    residual; without draft probabilities, `p` with the draft token's entry zeroed."""
    num_tokens = draft_token_ids.shape[0]
    if num_tokens == 0:
        return
    counts = torch.diff(cu_num_draft_tokens.to(torch.int64),
                        prepend=cu_num_draft_tokens.new_zeros(1).to(torch.int64))
    req = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts,
                                  output_size=num_tokens)
    if draft_probs is None:
        prob = target_probs.clone()
        drafts = draft_token_ids.to(torch.int64)
        valid = (drafts >= 0) & (drafts < prob.shape[1])
        prob[torch.arange(num_tokens)[valid], drafts[valid]] = 0
    else:
        prob = (target_probs - draft_probs).clamp_min(0)
    score = prob.to(inv_q.dtype) * inv_q[req]
    output_token_ids[:num_tokens] = score.argmax(dim=-1).to(output_token_ids.dtype)


def expand_to_tokens(output, input, cu_num_tokens, replace_from, replace_to):
    """vLLM's `expand_kernel`: each request's value (`replace_from` -> `replace_to`) repeated
    over its tokens."""
    values = torch.where(input == replace_from, torch.full_like(input, replace_to), input)
    counts = torch.diff(cu_num_tokens.to(torch.int64),
                        prepend=cu_num_tokens.new_zeros(1).to(torch.int64))
    total = int(cu_num_tokens[-1]) if cu_num_tokens.numel() else 0
    output[:total] = torch.repeat_interleave(values, counts, output_size=total).to(output.dtype)


def _install_rejection_sampling() -> None:
    """Same vLLM CPU issue as the draft-step kernel: vLLM CPU rebinds the rejection sampler's
    Triton kernels by module name, but the sampler calls them through dispatchers built at
    import (and its C++ expand writes an int64 copy, losing float temperatures). Greedy and
    random (temperature > 0) verification both get torch versions of the dispatchers."""
    from vllm.v1.sample import rejection_sampler

    rejection_sampler._rejection_greedy_sample = WithoutWarmup(rejection_greedy_sample)
    rejection_sampler._rejection_random_sample = WithoutWarmup(rejection_random_sample)
    rejection_sampler._sample_recovered_tokens = WithoutWarmup(sample_recovered_tokens)
    rejection_sampler._expand = WithoutWarmup(expand_to_tokens)


class WithoutWarmup:
    """A torch function standing in for a vLLM Triton dispatcher (which also takes warmup
    registrations; on CPU there is nothing to warm up)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def register_warmup(self, *args, **kwargs) -> None:
        pass
