"""DFlash drafting on vLLM's CPU platform: the proposer's input kernel in torch.

vLLM CPU rebinds `copy_and_expand_dflash_inputs_kernel` to a C++ version by module name, but
`DFlashProposer` launches it through the dispatcher `_copy_and_expand_dflash_inputs`, bound at
import to the Triton kernel (the same issue `glmctl.plugin.platforms.cpu.cpu_mtp` handles for MTP). The
function here writes what the kernel writes, from the same keyword arguments.
"""

from __future__ import annotations

import torch

from glmctl.plugin.platforms.cpu.cpu_mtp import WithoutWarmup


def install() -> str:
    from vllm.v1.spec_decode import dflash

    dflash._copy_and_expand_dflash_inputs = WithoutWarmup(copy_and_expand_dflash_inputs)
    return "DFlash inputs (torch)"


def copy_and_expand_dflash_inputs(*, next_token_ids_ptr, target_positions_ptr, out_input_ids_ptr,
                                  out_context_positions_ptr, out_query_positions_ptr,
                                  out_context_slot_mapping_ptr, out_query_slot_mapping_ptr,
                                  out_token_indices_ptr, block_table_ptr, query_start_loc_ptr,
                                  num_rejected_tokens_ptr, block_table_stride, parallel_drafting_token_id,
                                  block_size, num_query_per_req, num_speculative_tokens, total_input_tokens,
                                  has_num_rejected=False, **_launch):
    """DFlash's first-pass inputs (vLLM's `copy_and_expand_dflash_inputs_kernel` semantics).

    Per request: the context positions are copied; the 1 + N query positions follow the last
    accepted context position (the context minus `num_rejected` when given); input ids are
    [next token, mask, ..., mask]; context and query slots come from the request's block table;
    the N mask positions are the ones to sample.
    """
    starts = query_start_loc_ptr[:-1].long()
    ends = query_start_loc_ptr[1:].long()
    reqs = starts.shape[0]
    device = target_positions_ptr.device
    total = int(ends[-1]) if reqs else 0
    table = block_table_ptr.long()

    def slots(req: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        block = (pos // block_size).clamp_max(block_table_stride - 1)
        return table[req, block] * block_size + pos % block_size

    ctx_pos = target_positions_ptr[:total].long()
    ctx_req = torch.repeat_interleave(torch.arange(reqs, device=device), ends - starts, output_size=total)
    out_context_positions_ptr[:total] = ctx_pos.to(out_context_positions_ptr.dtype)
    out_context_slot_mapping_ptr[:total] = slots(ctx_req, ctx_pos).to(out_context_slot_mapping_ptr.dtype)

    valid_end = ends - (num_rejected_tokens_ptr.long() if has_num_rejected else 0)
    last = target_positions_ptr[valid_end - 1].long()
    offsets = torch.arange(num_query_per_req, device=device)
    q_pos = last[:, None] + 1 + offsets  # [reqs, 1 + N]
    q_req = torch.arange(reqs, device=device)[:, None].expand_as(q_pos)
    n = reqs * num_query_per_req
    out_query_positions_ptr[:n] = q_pos.flatten().to(out_query_positions_ptr.dtype)
    out_query_slot_mapping_ptr[:n] = slots(q_req, q_pos).flatten().to(out_query_slot_mapping_ptr.dtype)
    ids = torch.full_like(q_pos, parallel_drafting_token_id)
    ids[:, 0] = next_token_ids_ptr[:reqs].long()
    out_input_ids_ptr[:n] = ids.flatten().to(out_input_ids_ptr.dtype)
    sample = torch.arange(reqs, device=device)[:, None] * num_query_per_req + 1 + offsets[:num_speculative_tokens]
    out_token_indices_ptr[: reqs * num_speculative_tokens] = sample.flatten().to(out_token_indices_ptr.dtype)
