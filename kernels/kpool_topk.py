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

Decode rows: ``kpool_topk_decode(logits, positions, context_pools, out, *, kpool, select_pools,
valid_rows=None)`` and ``kpool_topk_decode_ref``: the same selection with each row's length
computed from vLLM's metadata, ``min(positions[row] + 1, (context_pools[row] + 1) * kpool - 1)``
(int64 positions, int32 pool-granular context lengths: a row's complete pools never exceed the
context whose logits were written), and the rows from ``valid_rows`` on (CUDA-graph padding)
written -1 in full: every row of ``out`` is written, so the buffer needs no fill first.

Kernels (graph safe: lengths read on the device, no allocation, one program per row or per
slice, every grid fixed by the row count). The default is the packed-counter kernel of
:mod:`.kpool_topk_packed` (:data:`PACKED_CONFIG`): two passes over a row, then an exact select
among a few hundred candidates, each radix step a single block-wide reduction, with the radix
select (:mod:`.kpool_topk_select`) as its fallback for rows whose candidates overflow. A
:class:`.kpool_topk_threshold.ThresholdTopkConfig` (:data:`THRESHOLD_CONFIG`) selects the
threshold kernel, the same algorithm with 16-bin tensors per step (the previous default).
``config=RADIX`` selects the radix kernels: logits map to
order-preserving 32-bit keys, and four passes histogram one 8-bit digit each among the keys
matching the digits chosen so far, which yields the ``select_pools``-th largest key; a last pass
in index order keeps the keys above it and the first ties, so the result is deterministic and
sorted by pool. Every path gives the same output:

* without a workspace: one program per row does it all;
* with :func:`kpool_topk_workspace` (decode, few rows): stage 1 splits each row of more than
  ``direct_max`` pools into ``slices`` programs that each keep their slice's best
  ``select_pools`` (value, pool) candidates; stage 2 selects among the candidates (shorter rows
  are selected in one pass by stage 2; the choice is made per row on the device). The best pools
  of a row are among its slices' best, and ties still go to the lowest pools.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .kpool_topk_packed import (
    PACKED_CONFIG,
    PackedTopkConfig,
    launch_kpool_topk_packed,
    packed_capacity,
)
from .kpool_topk_select import _order_key, _select_and_write, _threshold, _write_tail_and_padding
from .kpool_topk_threshold import (
    ThresholdTopkConfig,
    launch_kpool_topk_threshold,
    threshold_capacity,
)

# (BLOCK, num_warps); compiled for sm_89 in tests/unit/test_kernels_sm89.py.
TOPK_CONFIG = (1024, 4)
# With a workspace, rows of at most this many pools still take the one-pass path (stage 2 alone):
# measured on the H200, splitting pays only above ~64k tokens (4096 pools).
DIRECT_MAX_POOLS = 4096
# kpool_topk(config=RADIX): the radix kernels below (one pass, or two stages with a workspace).
RADIX = "radix"


@triton.jit
def _kpool_topk_slices_kernel(
    logits_ptr, logits_stride, starts_ptr, seq_ptr, cand_val_ptr, cand_idx_ptr,
    HAS_STARTS: tl.constexpr, KPOOL: tl.constexpr, SELECT: tl.constexpr,
    SLICES: tl.constexpr, DIRECT_MAX: tl.constexpr, BLOCK: tl.constexpr,
):
    """Stage 1: the best SELECT (value, pool) of one slice of a row, in pool order."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    n = tl.maximum(tl.load(seq_ptr + row), 0) // KPOOL
    if n > DIRECT_MAX:  # shorter rows are selected whole by stage 2
        span = (n + SLICES - 1) // SLICES
        lo = part * span
        size = tl.maximum(tl.minimum(lo + span, n) - lo, 0)
        base = logits_ptr + row * logits_stride + lo
        if HAS_STARTS:
            base += tl.load(starts_ptr + row)
        cand_v = cand_val_ptr + (row * SLICES + part) * SELECT
        cand_i = cand_idx_ptr + (row * SLICES + part) * SELECT
        lane = tl.arange(0, BLOCK)
        if size <= SELECT:
            for c0 in range(0, SELECT, BLOCK):
                offs = c0 + lane
                ok = offs < size
                vals = tl.load(base + offs, mask=ok, other=float("-inf"))
                tl.store(cand_v + offs, vals, mask=offs < SELECT)
                tl.store(cand_i + offs, tl.where(ok, lo + offs, -1), mask=offs < SELECT)
        else:
            prefix, remaining = _threshold(base, cand_i, size, SELECT, False, BLOCK)
            written = tl.zeros([], tl.int32)
            ties_seen = tl.zeros([], tl.int32)
            for c0 in range(0, size, BLOCK):
                offs = c0 + lane
                inside = offs < size
                vals = tl.load(base + offs, mask=inside, other=0.0)
                key = _order_key(vals)
                tie = (inside & (key == prefix)).to(tl.int32)
                take = (inside & (key > prefix)) | ((tie > 0) & (ties_seen + tl.cumsum(tie, axis=0)
                                                                - tie < remaining))
                pos = written + tl.cumsum(take.to(tl.int32), axis=0) - 1
                tl.store(cand_v + pos, vals, mask=take)
                tl.store(cand_i + pos, lo + offs, mask=take)
                written += tl.sum(take.to(tl.int32), axis=0)
                ties_seen += tl.sum(tie, axis=0)


@triton.jit
def _kpool_topk_kernel(
    logits_ptr, logits_stride, starts_ptr, seq_ptr, cand_val_ptr, cand_idx_ptr,
    out_ptr, out_stride, out_width,
    HAS_STARTS: tl.constexpr, MERGE: tl.constexpr, CAND: tl.constexpr, DIRECT_MAX: tl.constexpr,
    KPOOL: tl.constexpr, SELECT: tl.constexpr, BLOCK: tl.constexpr, TAIL: tl.constexpr,
):
    """One row: select among the row's logits (or, with MERGE and more than DIRECT_MAX pools,
    among its stage-1 candidates), expand the chosen pools to tokens, append the tail, pad -1."""
    row = tl.program_id(0).to(tl.int64)
    seq = tl.maximum(tl.load(seq_ptr + row), 0)
    n = seq // KPOOL
    out_row = out_ptr + row * out_stride
    lane = tl.arange(0, BLOCK)
    row_logits = logits_ptr + row * logits_stride
    if HAS_STARTS:
        row_logits += tl.load(starts_ptr + row)

    if n <= SELECT:
        for c0 in range(0, SELECT * KPOOL, BLOCK):
            col = c0 + lane
            tl.store(out_row + col, tl.where(col < n * KPOOL, col, -1), mask=col < SELECT * KPOOL)
    elif MERGE:
        if n > DIRECT_MAX:
            _select_and_write(cand_val_ptr + row * CAND, cand_idx_ptr + row * CAND, CAND,
                              out_row, True, KPOOL, SELECT, BLOCK)
        else:
            _select_and_write(row_logits, cand_idx_ptr, n, out_row, False, KPOOL, SELECT, BLOCK)
    else:
        _select_and_write(row_logits, cand_idx_ptr, n, out_row, False, KPOOL, SELECT, BLOCK)

    _write_tail_and_padding(out_row, n, seq, out_width, KPOOL, SELECT, TAIL, BLOCK)


@dataclass(frozen=True)
class KpoolTopkWorkspace:
    """Stage-1 candidates: values ``[rows, slices, select]`` fp32 and pools (int32)."""

    values: torch.Tensor
    pools: torch.Tensor

    @property
    def slices(self) -> int:
        return self.values.shape[1]


def kpool_topk_workspace(max_rows: int, select_pools: int, num_sms: int,
                         device: torch.device | str, slices: int | None = None
                         ) -> KpoolTopkWorkspace:
    """Workspace for the two-stage path: enough slices that ``max_rows`` rows give about two
    programs per SM (at most 16). Allocate before graph capture; reuse for fewer rows."""
    if slices is None:
        slices = max(1, min(16, -(-2 * num_sms // max(1, max_rows))))
    return KpoolTopkWorkspace(
        torch.empty((max_rows, slices, select_pools), dtype=torch.float32, device=device),
        torch.empty((max_rows, slices, select_pools), dtype=torch.int32, device=device),
    )


def kpool_topk(logits: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor, *, kpool: int,
               select_pools: int, row_starts: torch.Tensor | None = None,
               workspace: KpoolTopkWorkspace | None = None,
               direct_max: int = DIRECT_MAX_POOLS, config=None) -> torch.Tensor:
    """Triton kernels; same contract as :func:`kpool_topk_ref` (see module doc). ``config``:
    a :class:`.kpool_topk_packed.PackedTopkConfig` (default :data:`PACKED_CONFIG`), a
    :class:`.kpool_topk_threshold.ThresholdTopkConfig`, or :data:`RADIX` for the radix kernels,
    with which a workspace splits rows of more than ``direct_max`` pools into slices first (the
    other kernels need no workspace)."""
    num_rows = logits.shape[0]
    assert out.dtype == torch.int32 and out.stride(1) == 1 and logits.stride(1) == 1
    assert out.shape[1] >= select_pools * kpool + kpool - 1 and kpool & (kpool - 1) == 0
    if num_rows == 0:
        return out
    config = DEFAULT_CONFIG if config is None else config
    if isinstance(config, PackedTopkConfig):
        cap = packed_capacity(config, select_pools, kpool)
        if cap:
            return launch_kpool_topk_packed(logits, out[:num_rows], kpool=kpool,
                                            select_pools=select_pools, config=config, cap=cap,
                                            seq_lens=seq_lens, row_starts=row_starts)
        config = RADIX
    if config is not RADIX:
        cap = threshold_capacity(config, select_pools, kpool)
        if cap:
            return launch_kpool_topk_threshold(logits, seq_lens, out, kpool=kpool,
                                               select_pools=select_pools,
                                               row_starts=row_starts, config=config, cap=cap)
    block, num_warps = TOPK_CONFIG
    starts = row_starts if row_starts is not None else seq_lens
    merge = workspace is not None
    if merge:
        assert workspace.values.shape[0] >= num_rows and workspace.values.shape[2] == select_pools
        _kpool_topk_slices_kernel[(num_rows, workspace.slices)](
            logits, logits.stride(0), starts, seq_lens, workspace.values, workspace.pools,
            HAS_STARTS=row_starts is not None, KPOOL=kpool, SELECT=select_pools,
            SLICES=workspace.slices, DIRECT_MAX=max(direct_max, select_pools), BLOCK=block,
            num_warps=num_warps,
        )
    cand_v = workspace.values if merge else logits
    cand_i = workspace.pools if merge else seq_lens
    _kpool_topk_kernel[(num_rows,)](
        logits, logits.stride(0), starts, seq_lens, cand_v, cand_i, out, out.stride(0),
        out.shape[1],
        HAS_STARTS=row_starts is not None, MERGE=merge,
        CAND=workspace.slices * select_pools if merge else 1,
        DIRECT_MAX=max(direct_max, select_pools), KPOOL=kpool, SELECT=select_pools,
        BLOCK=block, TAIL=max(2, triton.next_power_of_2(kpool - 1)), num_warps=num_warps,
    )
    return out


def kpool_topk_decode(logits: torch.Tensor, positions: torch.Tensor,
                      context_pools: torch.Tensor, out: torch.Tensor, *, kpool: int,
                      select_pools: int, valid_rows: int | None = None, config=None,
                      workspace: KpoolTopkWorkspace | None = None) -> torch.Tensor:
    """Decode rows (see module doc): one launch of the packed kernel, which reads the positions
    and context lengths itself and writes every row of ``out``. Another ``config`` (threshold or
    radix, with its ``workspace``) computes the lengths with torch ops and fills the padding
    rows, as the indexer did."""
    assert out.dtype == torch.int32 and out.stride(1) == 1 and logits.stride(1) == 1
    assert out.shape[1] >= select_pools * kpool + kpool - 1 and kpool & (kpool - 1) == 0
    rows = out.shape[0]
    valid = rows if valid_rows is None else min(valid_rows, rows)
    assert positions.numel() >= valid and context_pools.numel() >= valid
    assert logits.shape[0] >= valid
    if rows == 0:
        return out
    config = DEFAULT_CONFIG if config is None else config
    cap = packed_capacity(config, select_pools, kpool) if isinstance(config,
                                                                      PackedTopkConfig) else 0
    if cap:
        return launch_kpool_topk_packed(
            logits, out, kpool=kpool, select_pools=select_pools, config=config, cap=cap,
            positions=positions.reshape(-1).contiguous(),
            context_pools=context_pools.reshape(-1).contiguous(), valid_rows=valid)
    seq = decode_seq_lens(positions.reshape(-1)[:valid], context_pools.reshape(-1)[:valid], kpool)
    kpool_topk(logits[:valid], seq, out[:valid], kpool=kpool, select_pools=select_pools,
               config=config, workspace=workspace)
    out[valid:] = -1
    return out


def decode_seq_lens(positions: torch.Tensor, context_pools: torch.Tensor,
                    kpool: int) -> torch.Tensor:
    """Decode rows' lengths in tokens (int32), as the packed kernel computes them."""
    seq = torch.minimum(positions.long() + 1, (context_pools.long() + 1) * kpool - 1)
    return seq.clamp_min(0).to(torch.int32)


def kpool_topk_decode_ref(logits: torch.Tensor, positions: torch.Tensor,
                          context_pools: torch.Tensor, out: torch.Tensor, *, kpool: int,
                          select_pools: int, valid_rows: int | None = None) -> torch.Tensor:
    """Torch reference of :func:`kpool_topk_decode`."""
    rows = out.shape[0]
    valid = rows if valid_rows is None else min(valid_rows, rows)
    out.fill_(-1)
    if valid:
        seq = decode_seq_lens(positions.reshape(-1)[:valid], context_pools.reshape(-1)[:valid],
                              kpool)
        kpool_topk_ref(logits[:valid], seq, out[:valid], kpool=kpool, select_pools=select_pools)
    return out


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


def _threshold_configs():
    C = ThresholdTopkConfig

    # A 16-bit column-maximum bound (t0_steps=4): 27.6 / 27.8 us at 8 / 32 rows x 240k on the
    # H200 against 31.3 / 31.4 us for the exact one (bench/results/kernels-h200.md); the final
    # select stays exact, so the output is the same.
    shipped = C("thr-r8-c512-cap512-w8-t4", rows=8, cols=512, cap=512, num_warps=8, t0_steps=4)
    candidates = [
        shipped,
        C("thr-r8-c512-cap512-w8", rows=8, cols=512, cap=512, num_warps=8),
        C("thr-r8-c512-cap512-w16", rows=8, cols=512, cap=512, num_warps=16),
        C("thr-r16-c256-cap512-w8", rows=16, cols=256, cap=512, num_warps=8),
        C("thr-r4-c1024-cap1024-w16", rows=4, cols=1024, cap=1024, num_warps=16),
        C("thr-r16-c512-cap512-w16", rows=16, cols=512, cap=512, num_warps=16),
        C("thr-r8-c256-cap256-w4", rows=8, cols=256, cap=256, num_warps=4),
    ]
    return shipped, candidates


# The threshold kernel's configuration and what the bench sweeps (each compiled for sm_89 in
# tests/unit/test_kernels_sm89.py).
THRESHOLD_CONFIG, TOPK_CANDIDATES = _threshold_configs()
# What kpool_topk and kpool_topk_decode run without a config; the named choices the plugin's
# kernel table offers (GLMCTL_INDEXER_TOPK, `kernel_table.indexer_topk`).
DEFAULT_CONFIG = PACKED_CONFIG
NAMED_CONFIGS = {"packed": PACKED_CONFIG, "threshold": THRESHOLD_CONFIG, "radix": RADIX}
