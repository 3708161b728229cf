"""Routed experts of one MoE layer at prefill sizes (T > MAX_TOKENS), EXL3 4-bit weights, in Triton:
glmctl.kernels.exl3_moe_decode's launches with 32- or 64-slot runs, over slices of at most
`PREFILL_TOKENS` tokens.

Why: at a 2,048-token chunk each of the 288 experts holds ~57 (token, expert) slots (T x 8 / 288).
A run of up to 64 slots decodes an expert's weights once and feeds all its slots through the
tensor cores ([64, 64] x [64, 64] products), so a chunk decodes each touched expert's weights
about once per slice and does its 2 x T x 8 x 3 x H x I FLOPs on MMA. exllamav3's `exl3_moe`
(the default prefill path) took 3.32 ms per layer at 2,048 tokens on the H200, ~0.25 s of the
rank's ~0.27 s prefill chunk (bench/results/exl3-prefill-h200.json).

What differs from decode batches (measured there at 2,048 tokens, first version: prologue 1.13 ms,
combine 0.69 ms, gate/up 0.53, down 0.35, finish 0.04):
  * the run table: above exl3_moe_rotate.SORT_IN_KERNEL slots, torch sorts the slots by expert
    (stable) and counts them before the prologue, whose one table program then only cuts runs;
  * the output rotation (`DecodeConfig.rotate_in_down`): the down kernel rotates its [rows, 128]
    blocks, scales them by svh and the routing weight, and the token's picks are summed after it
    (torch, a fixed-order reduction) instead of a per-token combine launch;
  * the finish kernel takes a long run in 16-row pieces (grid axis 2), as registers allow.

Slices: the workspace's rotated inputs and slot outputs scale with the slice's slots, so a call
is cut into slices of `slice_tokens` (default PREFILL_TOKENS) tokens; every launch of a slice is
sized from its token count alone (no host sync, no data-dependent shape). Workspace at
GLM-5.3-Flash's TP8 shape and 2,048 tokens (16,384 slots): rotated inputs 268 MB (fp16, gate and
up), slot outputs 268 MB (fp32), partials 34 MB, activations 8 MB.
"""

from __future__ import annotations

import torch

from .exl3_moe_decode import DECODE_CONFIGS, DecodeConfig, DecodeWorkspace, exl3_moe_decode

PREFILL_TOKENS = 2048  # tokens per slice: vLLM's prefill chunk on the rank
# 32-slot runs: on mma.sync (an H100 under DISABLE_MMA_V3=1, 2026-12-06) 2.90 ms per layer at 2,048
# tokens against prefill_r64's 3.81 (10.19 against 14.61 at 8,192; bench/results/quick-round-h100-2026-12-06.json)
DEFAULT_PREFILL = "prefill_r32"
PREFILL_CONFIGS = tuple(name for name, c in DECODE_CONFIGS.items() if c.rows > 16)


def prefill_workspace(device, hidden: int, intermediate: int, top_k: int, experts: int,
                      slice_tokens: int = PREFILL_TOKENS) -> DecodeWorkspace:
    """One slice's scratch (one split: the prefill configs split neither K nor the down columns)."""
    return DecodeWorkspace(device, hidden, intermediate, top_k, experts, max_tokens=slice_tokens, splits=1)


def exl3_moe_prefill(x, topk_ids, topk_weights, gate, up, down, act_limit: float, clamped: torch.Tensor,
                     ws: DecodeWorkspace, config: DecodeConfig | None = None) -> torch.Tensor:
    """Routed-expert output [T, H] in x's dtype, any T, in slices of the workspace's tokens
    (arguments as glmctl.kernels.exl3_moe_decode.exl3_moe_decode)."""
    cfg = config or DECODE_CONFIGS[DEFAULT_PREFILL]
    tokens, top_k = x.shape[0], topk_ids.shape[1]
    step = ws.slots // top_k
    if tokens <= step:
        return exl3_moe_decode(x, topk_ids, topk_weights, gate, up, down, act_limit, clamped, ws, cfg)
    out = torch.empty_like(x)
    for t0 in range(0, tokens, step):
        t1 = min(t0 + step, tokens)
        out[t0:t1] = exl3_moe_decode(x[t0:t1], topk_ids[t0:t1], topk_weights[t0:t1], gate, up, down,
                                     act_limit, clamped, ws, cfg)
    return out
