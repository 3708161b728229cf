"""KDA decode and MTP verification in one launch: the short conv, the gate, the delta-rule update
of the recurrent state, the per-token state stores of speculative decoding and (optionally) the
gated RMS norm that follows, for GLM-5.3-Flash's linear-attention layers.

vLLM 0.30 runs the same step as three kernels: `causal_conv1d_update` (q|k|v conv, output written
back over the projections), `fused_recurrent_kda` (one program per sequence, head and 8 rows of
the state, walking the tokens with a load -> update -> store round trip each) and the o-norm's
`layer_norm_gated_fwd`. Here one program owns BV rows of one (sequence, head) state, loads every
input of all its tokens before its first store, and the programs of a (sequence, head) hand the
work that needs the whole head (the q/k/v conv-state update and the norm over head_dim) to the
last of them to arrive (an int32 ticket per pair; the counters are zero at rest and reset by that
program, so a CUDA graph can replay the launch).

Layouts (H heads of this rank, D = head_dim = K = V, W = conv width, tokens packed):
  qkv        [tokens, >= 3*H*D] row-strided, channels q (h*D + i) | k (H*D + h*D + i) | v (2*H*D + ...):
             the in-projection's output before the conv, as vLLM's layer holds it;
  conv_state [slots, 3*H*D, cols] any strides (vLLM's transposed SD view), cols >= W - 1 + MAX_T - 1;
  conv_w     [3*H*D, W] fp32 contiguous (vLLM's merged q|k|v conv weight), no bias;
  raw_g      [tokens, H*D] row-strided gate logits (f_b_proj output), g_bias [H*D] fp32, a_log [H];
  raw_beta   [tokens, H] row-strided logits;
  state      [slots, H, D(v), D(k)] fp32 or bf16, slot stride arbitrary, the rest contiguous;
  indices    [N, C] (speculative: C = num_spec + 1) or [N] (plain decode, one token a sequence);
  out        [tokens, H, D] contiguous, norm_gate [tokens, H*D] row-strided.

Semantics are vLLM's: sequence n starts from state slot indices[n, a-1] (a = num_accepted_tokens[n],
1 without speculation) and the state after its t-th token goes to slot indices[n, t] (indices[n]
without speculation), skipped where that slot is <= 0; its conv window starts at column a-1 of
conv slot indices[n, 0], and the new conv state (old columns a .. a+W-3, then the step's inputs)
is written from column 0. A sequence with no tokens or a conv slot <= 0 is padding: nothing of it
is read or written; one whose state slot (indices[n, a-1]) is <= 0 gets its conv state updated
and nothing else, as with vLLM's kernels. The conv output is rounded to the conv state's dtype
before use (vLLM stores it there), q/k are l2-normalised with eps 1e-6 inside the sqrt, q scaled
by D^-0.5, the gate is lower_bound * sigmoid(exp(a_log) * (g + g_bias)), beta = sigmoid(logits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_TOKENS = 4  # tokens per sequence the kernel unrolls: MTP with up to 3 draft tokens
TARGET_PROGRAMS = 256  # ~2 programs per SM on the H200 / L40 class


@dataclass(frozen=True)
class KdaDecodeConfig:
    name: str
    block_v: int  # state rows per program
    num_warps: int


CONFIGS = {c.name: c for c in (
    KdaDecodeConfig("v8w1", 8, 1),
    KdaDecodeConfig("v16w2", 16, 2),
    KdaDecodeConfig("v32w4", 32, 4),  # wider slices spill on sm_89 (64 rows: 255 registers + spills)
)}


def choose_config(pairs: int, head_dim: int = 128) -> KdaDecodeConfig:
    """The widest slice that still gives TARGET_PROGRAMS programs for `pairs` (sequence, head)
    pairs: 8 sequences x 8 heads -> v32w4 (256 programs), 1 x 8 -> v8w1 (128)."""
    for cfg in sorted(CONFIGS.values(), key=lambda c: -c.block_v):
        if cfg.block_v <= head_dim and pairs * (head_dim // cfg.block_v) >= TARGET_PROGRAMS:
            return cfg
    return CONFIGS["v8w1"]


def new_counters(max_seqs: int, heads: int, device) -> torch.Tensor:
    """Arrival counters for one layer's launches: int32 zeros, one per (sequence, head)."""
    return torch.zeros(max_seqs * heads, dtype=torch.int32, device=device)


@triton.jit
def _round_to(x, DTYPE: tl.constexpr):
    """fp32 x rounded to DTYPE and back, nearest-even, the same bits on a GPU and in the Triton
    interpreter (which truncates on conversion). bf16 by bit arithmetic; fp32 unchanged."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def _conv_token(x_ch, x_stride_t, cs_ch, cs_stride_col, first, w_ch, seq_len,
                T: tl.constexpr, W: tl.constexpr, CS_DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    """silu(conv) of token T for the channels whose pointers are given: taps 0 .. W-2-T come from
    the conv state's columns first+T .. first+W-2, the rest from tokens 0 .. T of the step."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(W):
        if T + j < W - 1:
            xv = tl.load(cs_ch + (first + T + j) * cs_stride_col)
        else:
            xv = tl.load(x_ch + (T + j - (W - 1)) * x_stride_t,
                         mask=tl.zeros([BLOCK], dtype=tl.int64) + seq_len > T + j - (W - 1), other=0.0)
        acc += xv.to(tl.float32) * tl.load(w_ch + j)
    acc = acc / (1.0 + tl.exp(-acc))
    return _round_to(acc, CS_DTYPE)


@triton.jit
def _token_inputs(x_tok, x_stride_t, cs_base, cs_stride_dim, cs_stride_col, first, conv_w_ptr,
                  q_ch, k_ch, v_ch, g_tok, g_bias_h, dk, beta_tok, amp, scale, seq_len,
                  T: tl.constexpr, W: tl.constexpr, CS_DTYPE: tl.constexpr, LOWER_BOUND: tl.constexpr,
                  D: tl.constexpr, BV: tl.constexpr):
    """Token T's q (normalised, scaled), k (normalised), v slice, per-channel decay and beta."""
    q = _conv_token(x_tok + q_ch, x_stride_t, cs_base + q_ch * cs_stride_dim, cs_stride_col, first,
                    conv_w_ptr + q_ch * W, seq_len, T, W, CS_DTYPE, D)
    k = _conv_token(x_tok + k_ch, x_stride_t, cs_base + k_ch * cs_stride_dim, cs_stride_col, first,
                    conv_w_ptr + k_ch * W, seq_len, T, W, CS_DTYPE, D)
    v = _conv_token(x_tok + v_ch, x_stride_t, cs_base + v_ch * cs_stride_dim, cs_stride_col, first,
                    conv_w_ptr + v_ch * W, seq_len, T, W, CS_DTYPE, BV)
    q = q / tl.sqrt(tl.sum(q * q) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k) + 1e-6)
    g = tl.load(g_tok + dk, mask=dk * 0 + seq_len > T, other=0.0).to(tl.float32) + g_bias_h
    decay = tl.exp(LOWER_BOUND / (1.0 + tl.exp(-(amp * g))))
    beta = tl.sigmoid(tl.load(beta_tok, mask=seq_len > T, other=0.0).to(tl.float32))
    return q, k, v, decay, beta


@triton.jit
def _delta_step(S, q, k, v, decay, beta, out_tok, state_ptr, dst, rec_len, vv, dk,
                T: tl.constexpr, D: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """One token of the recurrence on the [BV, D] slice, in vLLM's order of operations; for a
    token of the sequence's first rec_len, stores its output slice and, where its slot is > 0,
    the state after it."""
    S = S * decay[None, :]
    u = (v - tl.sum(S * k[None, :], 1)) * beta
    S = S + u[:, None] * k[None, :]
    o = tl.sum(S * q[None, :], 1)
    # masks built from vectors: the interpreter mistypes a vector & scalar mask
    live = vv * 0 + rec_len > T
    tl.store(out_tok + vv, _round_to(o, OUT_DTYPE).to(OUT_DTYPE), mask=live)
    tl.store(state_ptr + vv[:, None] * D + dk[None, :], S.to(state_ptr.dtype.element_ty),
             mask=(live & (vv * 0 + dst > 0))[:, None])
    return S


@triton.jit
def _conv_state_update(cs_base, cs_stride_dim, cs_stride_col, x_base, x_stride_t, ch, first, seq_len,
                       W: tl.constexpr, NCP: tl.constexpr):
    """New conv state of channels `ch`: old columns first+1 .. first+W-2, then the step's tokens,
    written from column 0 (W - 2 + seq_len columns)."""
    c = tl.arange(0, NCP)
    old_col = c < W - 2
    keep = c < W - 2 + seq_len
    old = tl.load(cs_base + ch[None, :] * cs_stride_dim + (first + 1 + c)[:, None] * cs_stride_col,
                  mask=old_col[:, None], other=0.0)
    new = tl.load(x_base + (c - (W - 2))[:, None] * x_stride_t + ch[None, :],
                  mask=((~old_col) & keep)[:, None], other=0.0)
    val = tl.where(old_col[:, None], old, new.to(old.dtype))
    tl.debug_barrier()  # every thread's loads of the columns before any overwrite
    tl.store(cs_base + ch[None, :] * cs_stride_dim + c[:, None] * cs_stride_col, val, mask=keep[:, None])


@triton.jit
def _kda_decode_kernel(
    x_ptr, x_stride_t, conv_w_ptr, cs_ptr, cs_stride_slot, cs_stride_dim, cs_stride_col,
    g_ptr, g_stride_t, g_bias_ptr, a_log_ptr, beta_ptr, beta_stride_t,
    state_ptr, state_stride_slot, idx_ptr, idx_stride_n, acc_ptr, cu_ptr,
    out_ptr, gate_ptr, gate_stride_t, norm_w_ptr, cnt_ptr, scale, norm_eps,
    H: tl.constexpr, D: tl.constexpr, BV: tl.constexpr, W: tl.constexpr, MAX_T: tl.constexpr,
    SPEC: tl.constexpr, FUSE_NORM: tl.constexpr, LOWER_BOUND: tl.constexpr,
    NCP: tl.constexpr, TP: tl.constexpr,
):
    iv = tl.program_id(0)
    nh = tl.program_id(1)
    n = nh // H
    h = nh % H
    bos = tl.load(cu_ptr + n).to(tl.int64)
    seq_len = tl.load(cu_ptr + n + 1).to(tl.int64) - bos
    first = 0
    if SPEC:
        first = tl.load(acc_ptr + n).to(tl.int64) - 1
    row = idx_ptr + n.to(tl.int64) * idx_stride_n
    conv_slot = tl.load(row).to(tl.int64)
    src = tl.load(row + first).to(tl.int64)
    if (seq_len <= 0) | (conv_slot <= 0):
        return
    # vLLM's recurrence skips a sequence whose state slot is null; its conv still runs
    rec_len = tl.where(src > 0, seq_len, 0)
    dk = tl.arange(0, D)
    vv = iv * BV + tl.arange(0, BV)
    head_state = state_ptr + h * D * D
    # the state slice first: its address waits on two dependent loads already
    S = tl.load(head_state + src * state_stride_slot + vv[:, None] * D + dk[None, :],
                mask=(vv * 0 + rec_len > 0)[:, None], other=0.0).to(tl.float32)

    q_ch = h * D + dk
    k_ch = H * D + h * D + dk
    v_ch = 2 * H * D + h * D + vv
    x_base = x_ptr + bos * x_stride_t
    cs_base = cs_ptr + conv_slot * cs_stride_slot
    g_base = g_ptr + bos * g_stride_t + h * D
    beta_base = beta_ptr + bos * beta_stride_t + h
    g_bias_h = tl.load(g_bias_ptr + h * D + dk).to(tl.float32)
    amp = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    out_base = out_ptr + (bos * H + h) * D

    # every input of every token before the first store (a store may alias a later load)
    q0, k0, v0, d0, b0 = _token_inputs(x_base, x_stride_t, cs_base, cs_stride_dim, cs_stride_col, first,
                                       conv_w_ptr, q_ch, k_ch, v_ch, g_base, g_bias_h, dk, beta_base,
                                       amp, scale, seq_len, 0, W, cs_ptr.dtype.element_ty, LOWER_BOUND, D, BV)
    dst0 = conv_slot  # indices[n, 0] (indices[n] without speculation)
    if MAX_T > 1:
        q1, k1, v1, d1, b1 = _token_inputs(x_base, x_stride_t, cs_base, cs_stride_dim, cs_stride_col, first,
                                           conv_w_ptr, q_ch, k_ch, v_ch, g_base + g_stride_t, g_bias_h, dk,
                                           beta_base + beta_stride_t, amp, scale, seq_len, 1, W,
                                           cs_ptr.dtype.element_ty, LOWER_BOUND, D, BV)
        dst1 = tl.load(row + 1).to(tl.int64)
    if MAX_T > 2:
        q2, k2, v2, d2, b2 = _token_inputs(x_base, x_stride_t, cs_base, cs_stride_dim, cs_stride_col, first,
                                           conv_w_ptr, q_ch, k_ch, v_ch, g_base + 2 * g_stride_t, g_bias_h, dk,
                                           beta_base + 2 * beta_stride_t, amp, scale, seq_len, 2, W,
                                           cs_ptr.dtype.element_ty, LOWER_BOUND, D, BV)
        dst2 = tl.load(row + 2).to(tl.int64)
    if MAX_T > 3:
        q3, k3, v3, d3, b3 = _token_inputs(x_base, x_stride_t, cs_base, cs_stride_dim, cs_stride_col, first,
                                           conv_w_ptr, q_ch, k_ch, v_ch, g_base + 3 * g_stride_t, g_bias_h, dk,
                                           beta_base + 3 * beta_stride_t, amp, scale, seq_len, 3, W,
                                           cs_ptr.dtype.element_ty, LOWER_BOUND, D, BV)
        dst3 = tl.load(row + 3).to(tl.int64)

    S = _delta_step(S, q0, k0, v0, d0, b0, out_base, head_state + dst0 * state_stride_slot, dst0,
                    rec_len, vv, dk, 0, D, out_ptr.dtype.element_ty)
    if MAX_T > 1:
        S = _delta_step(S, q1, k1, v1, d1, b1, out_base + H * D, head_state + dst1 * state_stride_slot, dst1,
                        rec_len, vv, dk, 1, D, out_ptr.dtype.element_ty)
    if MAX_T > 2:
        S = _delta_step(S, q2, k2, v2, d2, b2, out_base + 2 * H * D, head_state + dst2 * state_stride_slot,
                        dst2, rec_len, vv, dk, 2, D, out_ptr.dtype.element_ty)
    if MAX_T > 3:
        S = _delta_step(S, q3, k3, v3, d3, b3, out_base + 3 * H * D, head_state + dst3 * state_stride_slot,
                        dst3, rec_len, vv, dk, 3, D, out_ptr.dtype.element_ty)

    # The pair's last program to arrive does what needs the whole head. Every thread's loads of
    # the conv window and stores of the output slice come before the ticket (the barrier); its
    # release / the last arrival's acquire order them before that program's conv-state stores and
    # output reloads.
    tl.debug_barrier()
    owner = True
    if D // BV > 1:
        owner = tl.atomic_add(cnt_ptr + nh, 1, sem="acq_rel", scope="gpu") == D // BV - 1
    if owner:
        dh = tl.arange(0, D)
        for part in tl.static_range(3):
            _conv_state_update(cs_base, cs_stride_dim, cs_stride_col, x_base, x_stride_t,
                               part * H * D + h * D + dh, first, seq_len, W, NCP)
        if FUSE_NORM:
            t = tl.arange(0, TP)
            live = (t < rec_len)[:, None]
            o_ptrs = out_base + t[:, None] * (H * D) + dh[None, :]
            o = tl.load(o_ptrs, mask=live, other=0.0, cache_modifier=".cg").to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(o * o, 1) / D + norm_eps)
            gate = tl.load(gate_ptr + (bos + t)[:, None] * gate_stride_t + h * D + dh[None, :], mask=live,
                           other=0.0).to(tl.float32)
            y = o * rstd[:, None] * tl.load(norm_w_ptr + dh).to(tl.float32)[None, :] * tl.sigmoid(gate)
            tl.store(o_ptrs, _round_to(y, out_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty), mask=live)
        if D // BV > 1:
            tl.atomic_xchg(cnt_ptr + nh, 0, sem="relaxed", scope="gpu")


def kda_decode(qkv: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor,
               raw_g: torch.Tensor, raw_beta: torch.Tensor, a_log: torch.Tensor, g_bias: torch.Tensor,
               state: torch.Tensor, cu_seqlens: torch.Tensor, state_indices: torch.Tensor,
               lower_bound: float, num_accepted_tokens: torch.Tensor | None = None,
               out: torch.Tensor | None = None, norm_gate: torch.Tensor | None = None,
               norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-5,
               counters: torch.Tensor | None = None, config: KdaDecodeConfig | None = None,
               scale: float | None = None) -> torch.Tensor:
    """One launch for N = len(cu_seqlens) - 1 sequences (layouts in the module docstring); updates
    `conv_state` and `state` in place and returns `out` [tokens, H, D] (allocated when None): the
    attention output, gated-RMS-normed with (norm_gate, norm_weight, norm_eps) when norm_gate is
    given. `counters`: `new_counters()` of at least N * H, needed when the config splits a head."""
    heads, dim = state.shape[-3], state.shape[-1]
    width = conv_weight.shape[1]
    spec = num_accepted_tokens is not None
    max_t = state_indices.shape[1] if spec else 1
    num_seqs = cu_seqlens.shape[0] - 1
    tokens = qkv.shape[0]
    if not spec and state_indices.dim() != 1:
        raise ValueError("plain decode takes indices [N]; [N, C] needs num_accepted_tokens")
    if not 1 <= max_t <= MAX_TOKENS:
        raise ValueError(f"{max_t} tokens per sequence; the kernel unrolls at most {MAX_TOKENS}")
    if state.shape[-2] != dim or state.stride(-1) != 1 or state.stride(-2) != dim or state.stride(-3) != dim * dim:
        raise ValueError(f"state must be [slots, H, D, D] with contiguous heads, got {tuple(state.shape)} "
                         f"strides {state.stride()}")
    if conv_state.shape[1] != 3 * heads * dim or conv_state.shape[2] < width - 2 + max_t:
        raise ValueError(f"conv_state {tuple(conv_state.shape)} for {heads} heads x {dim}, width {width}")
    if qkv.dtype != conv_state.dtype or qkv.stride(-1) != 1 or raw_g.stride(-1) != 1:
        raise ValueError("qkv in the conv state's dtype; qkv and raw_g contiguous per token")
    if not conv_weight.is_contiguous() or conv_weight.dtype != torch.float32:
        raise ValueError("conv_weight must be contiguous fp32 [3*H*D, W]")
    cfg = config or choose_config(num_seqs * heads, dim)
    splits = dim // cfg.block_v
    if splits > 1 and (counters is None or counters.numel() < num_seqs * heads):
        raise ValueError(f"{cfg.name} splits each head in {splits}: needs counters for {num_seqs * heads} pairs")
    if out is None:
        out = qkv.new_empty(tokens, heads, dim)
    out_rows = out.view(-1, heads * dim)
    if norm_gate is not None:
        norm_gate = norm_gate.reshape(-1, heads * dim)
    if raw_g.dim() != 2:
        raw_g = raw_g.reshape(-1, heads * dim)
    if raw_beta.dim() != 2:
        raw_beta = raw_beta.reshape(-1, heads)
    idx = state_indices if state_indices.dim() == 2 else state_indices.unsqueeze(1)
    scale = dim ** -0.5 if scale is None else scale
    fuse_norm = norm_gate is not None
    _kda_decode_kernel[(splits, num_seqs * heads)](
        qkv, qkv.stride(0), conv_weight, conv_state, conv_state.stride(0), conv_state.stride(1),
        conv_state.stride(2), raw_g, raw_g.stride(0), g_bias.reshape(-1), a_log.reshape(-1),
        raw_beta, raw_beta.stride(0), state, state.stride(0), idx, idx.stride(0),
        num_accepted_tokens if spec else cu_seqlens, cu_seqlens, out_rows,
        norm_gate if fuse_norm else out_rows, norm_gate.stride(0) if fuse_norm else 0,
        norm_weight if fuse_norm else out_rows, counters if counters is not None else cu_seqlens,
        scale, norm_eps,
        H=heads, D=dim, BV=cfg.block_v, W=width, MAX_T=max_t, SPEC=spec, FUSE_NORM=fuse_norm,
        LOWER_BOUND=float(lower_bound), NCP=triton.next_power_of_2(width - 2 + max_t),
        TP=triton.next_power_of_2(max_t), num_warps=cfg.num_warps, num_stages=1,
    )
    return out


def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """vLLM's o_norm (FusedRMSNormGated, sigmoid): rms-normalise over the last dim, times the
    weight, times sigmoid(gate); fp32 maths, x's dtype out."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float().to(x.device)
    return (y * torch.sigmoid(gate.float().to(x.device))).to(x.dtype)


def kda_decode_ref(qkv, conv_state, conv_weight, raw_g, raw_beta, a_log, g_bias, state, cu_seqlens,
                   state_indices, lower_bound: float, num_accepted_tokens=None, out=None, norm_gate=None,
                   norm_weight=None, norm_eps: float = 1e-5, **_unused) -> torch.Tensor:
    """`kda_decode` in torch, sequence by sequence: vLLM's conv update (`causal_conv1d_update_ref`),
    its output in the conv state's dtype, then the recurrence (`fused_recurrent_kda_varlen`) and
    the gated norm. Same arguments and effects."""
    from .kda import fused_recurrent_kda_varlen
    from .kda_conv import causal_conv1d_update_ref

    heads, dim = state.shape[-3], state.shape[-1]
    spec = num_accepted_tokens is not None
    idx = state_indices if state_indices.dim() == 2 else state_indices.unsqueeze(1)
    max_t = idx.shape[1] if spec else 1
    tokens = qkv.shape[0]
    out = qkv.new_zeros(tokens, heads, dim) if out is None else out
    raw_g = raw_g.reshape(tokens, heads, dim)
    raw_beta = raw_beta.reshape(tokens, heads)
    bounds = cu_seqlens.tolist()
    for n in range(len(bounds) - 1):
        bos, eos = bounds[n], bounds[n + 1]
        first = int(num_accepted_tokens[n]) - 1 if spec else 0
        if eos == bos or int(idx[n, 0]) <= 0:
            continue
        one = torch.tensor([0, eos - bos])
        acc = num_accepted_tokens[n : n + 1] if spec else None
        x = causal_conv1d_update_ref(qkv[bos:eos], conv_state, conv_weight, activation="silu",
                                     conv_state_indices=idx[n : n + 1, 0], num_accepted_tokens=acc,
                                     query_start_loc=one if spec else None, max_query_len=max_t)
        if int(idx[n, first]) <= 0:
            continue
        q, k, v = (x.to(conv_state.dtype).float().reshape(1, eos - bos, 3, heads, dim)[:, :, i] for i in range(3))
        o, _ = fused_recurrent_kda_varlen(q, k, v, raw_g[None, bos:eos], raw_beta[None, bos:eos], a_log, g_bias,
                                          state, one, idx[n : n + 1] if spec else idx[n, :1], lower_bound,
                                          num_accepted_tokens=acc, out=torch.zeros(1, eos - bos, heads, dim))
        if norm_gate is not None:
            gate = norm_gate.reshape(tokens, heads, dim)[bos:eos]
            out[bos:eos] = gated_rms_norm_ref(o[0].to(out.dtype), gate, norm_weight, norm_eps)
        else:
            out[bos:eos] = o[0].to(out.dtype)
    return out


def sm89_configs():
    """(name, jit function, {arg: type}, {constexpr: value}, options) for `sm89_check`: the TP8
    rank's shapes (8 heads of 128, conv width 4), MTP-3 verification and plain decode, fp32 state."""
    i64, f32 = "i64", "fp32"
    types = dict(x_ptr="*bf16", x_stride_t=i64, conv_w_ptr="*fp32", cs_ptr="*bf16", cs_stride_slot=i64,
                 cs_stride_dim=i64, cs_stride_col=i64, g_ptr="*bf16", g_stride_t=i64, g_bias_ptr="*fp32",
                 a_log_ptr="*fp32", beta_ptr="*bf16", beta_stride_t=i64, state_ptr="*fp32",
                 state_stride_slot=i64, idx_ptr="*i32", idx_stride_n=i64, acc_ptr="*i32", cu_ptr="*i32",
                 out_ptr="*bf16", gate_ptr="*bf16", gate_stride_t=i64, norm_w_ptr="*bf16", cnt_ptr="*i32",
                 scale=f32, norm_eps=f32)
    for cfg in CONFIGS.values():
        variants = [(4, True, True), (1, False, True)]  # MTP-3 verification, plain decode
        if cfg.name in ("v8w1", "v32w4"):  # picked at 1 x 4 and 8 x 4: the bench also runs them unnormed
            variants.append((4, True, False))
        for max_t, spec, norm in variants:
            tag = f"{cfg.name} T{max_t}{' spec' if spec else ''}{' norm' if norm else ''}"
            yield (f"kda_decode[{tag}]", _kda_decode_kernel, types,
                   dict(H=8, D=128, BV=cfg.block_v, W=4, MAX_T=max_t, SPEC=spec, FUSE_NORM=norm,
                        LOWER_BOUND=-5.0, NCP=triton.next_power_of_2(2 + max_t),
                        TP=triton.next_power_of_2(max_t)),
                   dict(num_warps=cfg.num_warps, num_stages=1))
