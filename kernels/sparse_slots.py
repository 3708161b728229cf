"""Request-logical top-k token positions -> flat latent-cache rows (what sparse MLA reads).

``sparse_rows_ref(token_indices, req_id_per_token, block_table, block_size, rows_per_block)``:
torch equivalent of vLLM 0.30's ``triton_convert_req_index_to_global_index`` (no DCP, no
prefill workspace) for the CPU path; on CUDA the plugin can keep vLLM's own kernel, whose output
is the same.

* ``token_indices``: ``[T, K]`` int32 request-logical positions, -1 = none.
* ``req_id_per_token``: ``[T]`` int32; ``block_table``: ``[R, max_blocks]`` int32.
* ``rows_per_block``: ``kv_cache.stride(0) // kv_cache.stride(1)`` (= block_size when blocks are
  contiguous). Result ``[T, K]`` int32:
  ``block_table[req, pos // block_size] * rows_per_block + pos % block_size``, -1 where the
  position is negative or its block is outside the table.
"""

from __future__ import annotations

import torch


def sparse_rows_ref(token_indices: torch.Tensor, req_id_per_token: torch.Tensor,
                    block_table: torch.Tensor, block_size: int,
                    rows_per_block: int | None = None) -> torch.Tensor:
    rows_per_block = block_size if rows_per_block is None else rows_per_block
    pos = token_indices.long()
    block = torch.div(pos, block_size, rounding_mode="floor")
    ok = (pos >= 0) & (block < block_table.shape[1])
    req = req_id_per_token.long()[:, None].expand_as(pos)
    base = block_table[req, block.clamp(0, block_table.shape[1] - 1)].long()
    rows = base * rows_per_block + pos % block_size
    return torch.where(ok, rows, -1).to(torch.int32)
