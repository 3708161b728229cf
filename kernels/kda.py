"""Kimi Delta Attention (KDA), GLM-5.3-Flash's linear-attention layer, in torch (fp32 maths).

The recurrence, per head, with state S [V, K] (vLLM's layout), for each token t:

    S   <- S * exp(g_t)                  (per-K-channel decay, g_t < 0)
    u_t  = beta_t * (v_t - S k_t)        (delta rule)
    S   <- S + u_t k_t^T
    o_t  = S q_t

with q, k l2-normalised (eps 1e-6 inside the sqrt, as FLA does) and q scaled by K^-0.5, and
GLM-5.3-Flash's bounded ("safe") gate g = lower_bound * sigmoid(exp(A_log) * (raw_g + dt_bias)).

Two forms compute the same thing:
  - `kda_recurrent`: token by token; decode and MTP verification (a few tokens per sequence).
  - `kda_chunked`: C tokens at a time; the in-chunk delta rule is a unit-lower-triangular solve
    (u = (I + L)^-1 beta (v - S0 (k * e^G))), so prefill costs O(T/C) torch calls, not O(T).
Pairwise decays are formed as exp(G_s - G_r) directly, never exp(G_s) / exp(G_r), because G
falls by up to |lower_bound| per token and exp(G) underflows within a chunk.

The `*_varlen` functions below take vLLM's conventions (packed tokens, cu_seqlens, state slots
with slot 0 = null, spec-decode state columns) so the plugin can hand them vLLM's tensors as is.
"""

from __future__ import annotations

import torch

L2NORM_EPS = 1e-6
CHUNK = 64


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def kda_gate(raw_g: torch.Tensor, a_log: torch.Tensor, g_bias: torch.Tensor | None,
             lower_bound: float) -> torch.Tensor:
    """Bounded log-decay per channel: raw_g [..., H, K] -> [..., H, K] fp32 in (lower_bound, 0)."""
    heads, dim = raw_g.shape[-2:]
    g = raw_g.float()
    if g_bias is not None:
        g = g + g_bias.float().reshape(heads, dim)
    amp = torch.exp(a_log.float().reshape(heads, 1))
    return lower_bound * torch.sigmoid(amp * g)


def kda_recurrent(q, k, v, g, beta, scale: float, state: torch.Tensor,
                  states_out: list | None = None) -> torch.Tensor:
    """One sequence, token by token. q,k [T,H,K]; v [T,H,V]; g [T,H,K]; beta [T,H]; state
    [H,V,K] fp32, updated in place. Appends each token's state to `states_out` if given."""
    q = l2norm(q.float()) * scale
    k = l2norm(k.float())
    v, g, beta = v.float(), g.float(), beta.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(q.shape[0]):
        state.mul_(torch.exp(g[t]).unsqueeze(1))
        u = beta[t].unsqueeze(-1) * (v[t] - torch.einsum("hvk,hk->hv", state, k[t]))
        state.add_(u.unsqueeze(-1) * k[t].unsqueeze(1))
        out[t] = torch.einsum("hvk,hk->hv", state, q[t])
        if states_out is not None:
            states_out.append(state.clone())
    return out


def kda_chunked(q, k, v, g, beta, scale: float, state: torch.Tensor,
                chunk: int = CHUNK) -> torch.Tensor:
    """One sequence, `chunk` tokens at a time; same contract as `kda_recurrent`."""
    q = l2norm(q.float()) * scale
    k = l2norm(k.float())
    v, g, beta = v.float(), g.float(), beta.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for start in range(0, q.shape[0], chunk):
        sl = slice(start, start + chunk)
        out[sl] = _kda_chunk_step(q[sl], k[sl], v[sl], g[sl], beta[sl], state)
    return out


def _kda_chunk_step(q, k, v, g, beta, state):
    # Head-major: [H, C, *].
    q, k, v, g = (x.transpose(0, 1) for x in (q, k, v, g))
    beta = beta.transpose(0, 1)
    c = q.shape[1]
    G = g.cumsum(dim=1)  # [H, C, K], G_t = sum_{s<=t} g_s
    # decay[h, s, r, :] = exp(G_s - G_r) for r <= s (pairs above the diagonal are unused).
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    diff = (G.unsqueeze(2) - G.unsqueeze(1)).masked_fill(~causal[None, :, :, None], float("-inf"))
    decay = torch.exp(diff)
    # L[s, r] = beta_s <k_r * exp(G_s - G_r), k_s> for r < s.
    kk = torch.einsum("hrk,hsrk,hsk->hsr", k, decay, k)
    lower = (kk * beta.unsqueeze(-1)).masked_fill(~causal.tril(-1), 0.0)
    # Right-hand side: beta_s (v_s - S0 (k_s * e^{G_s})).
    carried = torch.einsum("hvk,hsk->hsv", state, k * torch.exp(G))
    rhs = beta.unsqueeze(-1) * (v - carried)
    eye = torch.eye(c, device=q.device).expand_as(lower)
    u = torch.linalg.solve_triangular(eye + lower, rhs, upper=False, unitriangular=True)
    # o_t = S0 (q_t * e^{G_t}) + sum_{r<=t} u_r <k_r * exp(G_t - G_r), q_t>.
    qk = torch.einsum("hrk,htrk,htk->htr", k, decay, q)
    out = torch.einsum("hvk,htk->htv", state, q * torch.exp(G)) + qk @ u
    # S_C = S0 * e^{G_C} + sum_r u_r (k_r * exp(G_C - G_r))^T.
    tail = torch.exp(G[:, -1:, :] - G)  # [H, C, K]
    state.mul_(torch.exp(G[:, -1, :]).unsqueeze(1))
    state.add_(torch.einsum("hrv,hrk->hvk", u, k * tail))
    return out.transpose(0, 1)


# -- vLLM conventions -------------------------------------------------------------------------
# q, k, v, raw gates: [1, total_tokens, H, D]; beta [1, total_tokens, H]; sequences delimited by
# cu_seqlens; recurrent state cache [slots, H, V, K] addressed by slot ids, slot 0 = null.


def chunk_kda_varlen(q, k, v, raw_g, beta, a_log, g_bias, initial_state, cu_seqlens,
                     lower_bound: float, scale: float | None = None):
    """Prefill: every sequence starts from `initial_state[n]` ([N, H, V, K]); beta already in
    (0, 1). Returns (out [1, T, H, V] in q's dtype, final_state [N, H, V, K] fp32)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g = kda_gate(raw_g[0], a_log, g_bias, lower_bound)
    out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    final = initial_state.float().clone()
    bounds = cu_seqlens.tolist()
    for n in range(len(bounds) - 1):
        sl = slice(bounds[n], bounds[n + 1])
        if sl.start == sl.stop:
            continue
        out[0, sl] = kda_chunked(q[0, sl], k[0, sl], v[0, sl], g[sl], beta[0, sl], scale,
                                 final[n]).to(q.dtype)
    return out, final


def fused_recurrent_kda_varlen(q, k, v, raw_g, raw_beta, a_log, g_bias, state_cache,
                               cu_seqlens, state_indices, lower_bound: float,
                               num_accepted_tokens=None, out=None, scale: float | None = None):
    """Decode / MTP verify, in place on `state_cache` [slots, H, V, K].

    state_indices: [N] (plain decode) or [N, 1 + num_spec] (spec decode). With spec decode the
    sequence starts from column num_accepted_tokens[n] - 1 and the state after its t-th token is
    stored in column t, so rejection never needs a copy. Sequences whose slot is <= 0 (padding)
    are skipped. beta arrives as logits and is passed through a sigmoid here.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.zeros(v.shape, dtype=q.dtype, device=q.device) if out is None else out
    g = kda_gate(raw_g[0], a_log, g_bias, lower_bound)
    beta = torch.sigmoid(raw_beta[0].float())
    indices = state_indices if state_indices.dim() == 2 else state_indices.unsqueeze(1)
    bounds = cu_seqlens.tolist()
    for n in range(len(bounds) - 1):
        sl = slice(bounds[n], bounds[n + 1])
        if sl.start == sl.stop:
            continue
        first = int(num_accepted_tokens[n]) - 1 if num_accepted_tokens is not None else 0
        src = int(indices[n, first])
        if src <= 0:
            continue
        state = state_cache[src].float().clone()
        states: list[torch.Tensor] = []
        out[0, sl] = kda_recurrent(q[0, sl], k[0, sl], v[0, sl], g[sl], beta[sl], scale, state,
                                   states).to(out.dtype)
        for t, s in enumerate(states):
            dst = int(indices[n, t]) if indices.shape[1] > 1 else src
            if dst > 0 and (indices.shape[1] > 1 or t == len(states) - 1):
                state_cache[dst] = s.to(state_cache.dtype)
    return out, state_cache
