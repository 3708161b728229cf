"""Top-k over pooled indexer logits, expanded to token indices, with the always-selected tail.

``kpool_topk(logits, seq_lens, out, *, kpool, select_pools, row_starts=None)`` and
``kpool_topk_ref`` (same arguments). For each row (query token):

* ``seq_lens[row]``: int32, the token's visible length in tokens (``position + 1``); the row has
  ``n = seq_lens[row] // kpool`` complete pools, scored at ``logits[row, row_starts[row] + p]``
  for ``p < n`` (``row_starts`` = 0 for decode rows, vLLM's ``cu_seqlen_ks`` for prefill).
* selection: the ``min(select_pools, n)`` best pools; ties go to the lower pool index; the
  chosen pools are listed in ascending pool order (a set: attention does not depend on it, and
  a short row then comes out exactly as vLLM's causal fill ``0, 1, 2, ...``).
* ``out[row]`` (int32, width ``>= select_pools * kpool + kpool - 1``; vLLM's buffer is 2176):
  columns ``[0, select_pools * kpool)`` hold ``kpool * p + o`` for the j-th chosen pool ``p`` at
  ``kpool * j + o``, then -1; columns ``[select_pools * kpool, + kpool - 1)`` hold the tail tokens
  ``kpool * n + i`` for ``i < seq_len - kpool * n``, then -1; every later column is -1. These are
  request-logical token positions, as vLLM's ``expand_pools_and_append_tail`` writes them.
"""

from __future__ import annotations

import torch


def kpool_topk_ref(logits: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor, *,
                   kpool: int, select_pools: int,
                   row_starts: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference (stable sort: deterministic, lower index first on ties)."""
    num_rows, width = logits.shape
    history = select_pools * kpool
    assert out.shape[1] >= history + kpool - 1
    seq = seq_lens.reshape(-1)[:num_rows].long().clamp_min(0)
    npools = seq // kpool
    out.fill_(-1)
    if num_rows == 0:
        return out
    span = max(1, int(npools.max().item()))
    rel = torch.arange(span, device=logits.device)
    start = torch.zeros_like(seq) if row_starts is None else row_starts.reshape(-1)[:num_rows].long()
    cols = (start[:, None] + rel[None, :]).clamp(0, width - 1)
    visible = rel[None, :] < npools[:, None]
    scores = torch.where(visible, logits.gather(1, cols).float(), float("-inf"))
    # Invisible columns score -inf and have the highest indices, so the stable sort ranks them
    # after every visible pool (a visible -inf logit included).
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    take = min(select_pools, span)
    chosen = order[:, :take]
    chosen_ok = chosen < npools[:, None]
    chosen = torch.where(chosen_ok, chosen, span + chosen)  # push invalid picks to the end
    chosen = torch.sort(chosen, dim=1).values
    valid = chosen < span
    tokens = chosen[:, :, None] * kpool + torch.arange(kpool, device=logits.device)
    tokens = torch.where(valid[:, :, None], tokens, -1).reshape(num_rows, take * kpool)
    out[:, : take * kpool] = tokens.to(out.dtype)
    tail = torch.arange(kpool - 1, device=logits.device)
    tail_tok = npools[:, None] * kpool + tail[None, :]
    out[:, history : history + kpool - 1] = torch.where(
        tail_tok < seq[:, None], tail_tok, -1).to(out.dtype)
    return out
