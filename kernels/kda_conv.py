"""The short causal convolution in front of KDA, decode/verify step, in torch.

Semantics of vLLM 0.30's `causal_conv1d_update` (the Triton kernel), which the prefill path's
`causal_conv1d_fn` pairs with. Per sequence, the conv state [dim, state_len] holds the most
recent inputs, oldest first, with state_len = width - 1 (+ num_spec with MTP).

- Plain decode: window = state[:, :width-1]; new window = the window shifted left by the
  sequence's token count, the new tokens appended, written over columns 0 .. width-2 (a state
  sized for MTP keeps its further columns).
- Spec decode (num_accepted_tokens given): the sequence's window starts at column
  a - 1 (a = accepted tokens of the previous step), and the new state is
  state[:, a : a + width - 2] followed by all of this step's tokens, written from column 0,
  so the next step can start from whichever prefix gets accepted.

Weights are taken as stored by the checkpoint ([dim, width] fp32): no CPU prepack. The taps are
summed in the kernel's order (bias, then tap 0 .. width-1, each product rounded to fp32), so the
reference's fp32 sums, and the bf16 outputs rounded from them, are the kernel's bit for bit where
no fused multiply-add is used.
"""

from __future__ import annotations

import torch


def _taps(full: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, length: int) -> torch.Tensor:
    """out[:, t] = b + sum_j w[:, j] * full[:, t + j], summed in j order (fp32)."""
    acc = (torch.zeros(full.shape[0], length, dtype=torch.float32, device=full.device) if b is None
           else b[:, None].expand(-1, length))
    for j in range(w.shape[1]):
        acc = acc + full[:, j : j + length] * w[:, j : j + 1]
    return acc


def causal_conv1d_update_ref(x, conv_state, weight, bias=None, activation=None,
                             conv_state_indices=None, num_accepted_tokens=None,
                             query_start_loc=None, max_query_len: int = -1,
                             null_block_id: int = 0, out=None, **_unused):
    """x: [num_tokens, dim] (varlen with query_start_loc) or [batch, dim]; conv_state
    [slots, dim, state_len] (updated in place); weight [dim, width]. Returns y like x."""
    if isinstance(activation, bool):
        activation = "silu" if activation else None
    width = weight.shape[1]
    if query_start_loc is None:
        bounds = list(range(x.shape[0] + 1))
    else:
        bounds = query_start_loc.tolist()
    y = torch.empty_like(x) if out is None else out
    w = weight.float()
    b = bias.float() if bias is not None else None
    for n in range(len(bounds) - 1):
        start, end = bounds[n], bounds[n + 1]
        if start == end:
            continue
        slot = int(conv_state_indices[n]) if conv_state_indices is not None else n
        if conv_state_indices is not None and slot == null_block_id:
            continue
        seq = x[start:end].float().t()  # [dim, L]
        first = int(num_accepted_tokens[n]) - 1 if num_accepted_tokens is not None else 0
        state = conv_state[slot].float()
        window = state[:, first : first + width - 1]
        full = torch.cat([window, seq], dim=1)  # [dim, width - 1 + L]
        res = _taps(full, w, b, end - start)
        if activation in ("silu", "swish"):
            res = res / (1.0 + torch.exp(-res))  # silu as the kernel writes it
        y[start:end] = res.t().to(y.dtype)
        if num_accepted_tokens is not None:
            keep = state[:, first + 1 : first + width - 1]
            new = torch.cat([keep, seq], dim=1)
            conv_state[slot, :, : new.shape[1]] = new.to(conv_state.dtype)
        else:
            new = torch.cat([window, seq], dim=1)[:, -(width - 1):]
            conv_state[slot, :, : width - 1] = new.to(conv_state.dtype)
    return y
