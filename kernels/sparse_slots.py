"""Request-logical top-k token positions -> flat latent-cache rows (what sparse MLA reads).

``sparse_rows(token_indices, req_id_per_token, block_table, block_size, rows_per_block)``
(Triton, one launch) and ``sparse_rows_ref`` (torch): vLLM 0.30's
``triton_convert_req_index_to_global_index`` without DCP or the prefill workspace.

* ``token_indices``: ``[T, K]`` int32 request-logical positions, -1 = none (any row stride).
* ``req_id_per_token``: ``[T]`` int32; ``block_table``: ``[R, max_blocks]`` int32.
* ``rows_per_block``: ``kv_cache.stride(0) // kv_cache.stride(1)`` (= block_size when blocks are
  contiguous). Result ``[T, K]`` int32:
  ``block_table[req, pos // block_size] * rows_per_block + pos % block_size``, -1 where the
  position is negative or its block is outside the table.

The kernel: programs ``(token, column block)``, each maps ``BLOCK`` positions; graph safe (the
output is allocated by the call, as the attention backends' outputs are; no host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SPARSE_ROWS_BLOCK = 512  # positions per program (a 2176-wide row: 5 programs)
SPARSE_ROWS_WARPS = 4


@triton.jit
def _sparse_mla_rows_kernel(idx_ptr, idx_stride, req_ptr, bt_ptr, bt_stride, bt_width, out_ptr,
                        out_stride, width, block_size, rows_per_block, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = col < width
    pos = tl.load(idx_ptr + token * idx_stride + col, mask=inside, other=-1)
    block = pos // block_size
    ok = inside & (pos >= 0) & (block < bt_width)
    req = tl.load(req_ptr + token).to(tl.int64)
    base = tl.load(bt_ptr + req * bt_stride + block, mask=ok, other=0)
    rows = base * rows_per_block + pos % block_size
    tl.store(out_ptr + token * out_stride + col, tl.where(ok, rows, -1), mask=inside)


def sparse_rows(token_indices: torch.Tensor, req_id_per_token: torch.Tensor,
                block_table: torch.Tensor, block_size: int,
                rows_per_block: int | None = None) -> torch.Tensor:
    """Triton kernel; same contract as :func:`sparse_rows_ref` (see module doc)."""
    rows_per_block = block_size if rows_per_block is None else rows_per_block
    num_tokens, width = token_indices.shape
    assert token_indices.dtype == torch.int32 and token_indices.stride(1) == 1
    assert block_table.stride(1) == 1 and req_id_per_token.is_contiguous()
    out = torch.empty((num_tokens, width), dtype=torch.int32, device=token_indices.device)
    if num_tokens == 0 or width == 0:
        return out
    grid = (num_tokens, triton.cdiv(width, SPARSE_ROWS_BLOCK))
    _sparse_mla_rows_kernel[grid](
        token_indices, token_indices.stride(0), req_id_per_token, block_table,
        block_table.stride(0), block_table.shape[1], out, out.stride(0), width, block_size,
        rows_per_block, BLOCK=SPARSE_ROWS_BLOCK, num_warps=SPARSE_ROWS_WARPS,
    )
    return out


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
