"""mHC (manifold-constrained hyper-connection) pre and post blocks, in Triton, beside their torch
references. Semantics are vLLM 0.30's (``vllm/model_executor/layers/mhc.py`` and its torch
kernels) with the layer's input RMSNorm applied, as GLM-5.3-Flash calls them.

Shapes (``n`` = hc_mult residual streams, ``H`` = hidden size, ``n3 = 2n + n^2`` mix logits):

* ``residual``: [T, n, H] bf16, contiguous; ``x`` (the sublayer's output): [T, H] bf16.
* ``fn``: [n3, n*H] fp32, row ``o`` dotted with the flattened residual ``[stream][h]``;
  ``hc_scale`` [3] and ``hc_base`` [n3] fp32.
* ``post`` [T, n, 1] fp32 and ``comb`` [T, n, n] fp32, as vLLM's pre block returns them.

``mhc_pre`` (vLLM's ``mhc_pre`` + ``_apply_mhc_norm``):
  mixes = (flat(residual).f32 @ fn^T) * rsqrt(sum(flat^2) / (n*H) + rms_eps)
  pre   = sigmoid(mixes[:n] * s0 + base[:n]) + pre_eps
  post  = sigmoid(mixes[n:2n] * s1 + base[n:2n]) * post_mult
  comb  = sinkhorn(softmax_j(mixes[2n:].view(n, n) * s2 + base[2n:]) + sk_eps, repeat, sk_eps)
  layer_input = rms_norm(bf16(sum_i pre_i * residual_i), weight, norm_eps)
``mhc_post``: out_j = bf16(sum_i comb_ij * residual_i + post_j * x).
``mhc_fused_post_pre``: residual_cur = mhc_post(...), then mhc_pre(residual_cur) (the pre reads
the bf16-rounded residual_cur, as the unfused pair does).

Decode batches (up to ``mhc_decode.FUSED_MAX_TOKENS`` tokens) run in one launch per block
(``mhc_decode``: the partial mixes, then the last program of each token group finishes the
gates, the collapse and the norm) unless ``decode="split"`` is passed; ``decode`` may also name a
``mhc_decode.FusedConfig`` (benchmarks). Larger batches, and ``decode="split"``, take two launches
per block, both CUDA-graph safe (shapes only from tensor sizes, no host sync):
1. ``_mix_partials_kernel``, grid (token blocks, hidden blocks): applies the post block to its
   [tokens, n, BLOCK_H] tile where asked (storing residual_cur), and writes each tile's partial
   mix logits and square sums to a workspace [splits, T, MIX_PAD].
2. ``_mix_finalize_kernel``, grid (T,): sums the partials in one fixed tree (deterministic),
   computes the gates and the Sinkhorn-normalised comb in registers, then the collapsed
   layer input and its RMSNorm.
The fp32 mix projection uses ``tl.dot(..., input_precision="ieee")``: true fp32 products, as the
reference's fp32 matmul, so the gates differ from it only by summation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import mhc_decode

# The decode paths ``decode=`` names: one launch per block (fused) or the partials + finalize pair.
DECODE_PATHS = ("fused", "split")
DEFAULT_DECODE = "fused"


@dataclass(frozen=True)
class MixConfig:
    """Tile of the partial-mix kernel: tokens x hidden columns per program."""

    name: str
    block_t: int
    block_h: int
    num_warps: int


# Decode batches (a few to ~50 tokens) need hidden-dimension parallelism to fill the GPU;
# prefill chunks have tokens to spare and a smaller workspace with wider hidden tiles.
# Both spill no registers on sm_89 (the cross-compile test checks it).
MIX_DECODE = MixConfig("decode", block_t=16, block_h=16, num_warps=2)
MIX_PREFILL = MixConfig("prefill", block_t=16, block_h=64, num_warps=8)
MIX_CONFIGS = (MIX_DECODE, MIX_PREFILL)
DECODE_MAX_TOKENS = 128


def mix_config(num_tokens: int) -> MixConfig:
    return MIX_DECODE if num_tokens <= DECODE_MAX_TOKENS else MIX_PREFILL


def finalize_warps(hidden_size: int) -> int:
    return 8 if hidden_size >= 4096 else 4


@triton.jit
def _mix_partials_kernel(
    res_ptr, x_ptr, post_ptr, comb_ptr, cur_ptr, fn_ptr, part_ptr, sq_ptr,
    T, H,
    N: tl.constexpr, N3: tl.constexpr, MIX_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    WITH_POST: tl.constexpr, WITH_MIX: tl.constexpr,
):
    # Every load is issued before the first store (tuples of tiles, one per stream): a load
    # placed after the residual_cur store would wait for it, as the compiler cannot prove the
    # two do not alias.
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    toks = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    hs = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    tmask = toks < T
    hmask = hs < H
    tile_mask = tmask[:, None] & hmask[None, :]
    t64 = toks.to(tl.int64)
    outs = tl.arange(0, MIX_PAD)
    rs = ()
    for i in tl.static_range(N):
        rs = rs + (tl.load(res_ptr + t64[:, None] * (N * H) + i * H + hs[None, :],
                           mask=tile_mask, other=0.0).to(tl.float32),)
    ws = ()
    if WITH_MIX:
        for j in tl.static_range(N):
            # fn[o, j*H + h] for this tile's columns, as [BLOCK_H, MIX_PAD]
            ws = ws + (tl.load(fn_ptr + outs[None, :].to(tl.int64) * (N * H) + j * H
                               + hs[:, None],
                               mask=hmask[:, None] & (outs[None, :] < N3), other=0.0),)
    if WITH_POST:
        xv = tl.load(x_ptr + t64[:, None] * H + hs[None, :], mask=tile_mask,
                     other=0.0).to(tl.float32)
        ps = ()
        cs = ()  # comb[t, i, j] at index i * N + j
        for j in tl.static_range(N):
            ps = ps + (tl.load(post_ptr + t64 * N + j, mask=tmask, other=0.0),)
        for ij in tl.static_range(N * N):
            cs = cs + (tl.load(comb_ptr + t64 * (N * N) + ij, mask=tmask, other=0.0),)
    acc = tl.zeros([BLOCK_T, MIX_PAD], dtype=tl.float32)
    sq = tl.zeros([BLOCK_T], dtype=tl.float32)
    for j in tl.static_range(N):
        if WITH_POST:
            mixed = ps[j][:, None] * xv
            for i in tl.static_range(N):
                mixed += cs[i * N + j][:, None] * rs[i]
            cur = mixed.to(tl.bfloat16)
            tl.store(cur_ptr + t64[:, None] * (N * H) + j * H + hs[None, :], cur, mask=tile_mask)
            v = cur.to(tl.float32)
        else:
            v = rs[j]
        if WITH_MIX:
            sq += tl.sum(v * v, axis=1)
            acc += tl.dot(v, ws[j], input_precision="ieee")
    if WITH_MIX:
        split = pid_h.to(tl.int64) * T
        tl.store(part_ptr + (split + t64[:, None]) * MIX_PAD + outs[None, :], acc,
                 mask=tmask[:, None])
        tl.store(sq_ptr + split + t64, sq, mask=tmask)


@triton.jit
def _mix_finalize_kernel(
    part_ptr, sq_ptr, cur_ptr, scale_ptr, base_ptr, norm_w_ptr,
    post_out_ptr, comb_out_ptr, lin_out_ptr,
    T, H, num_splits,
    rms_eps, pre_eps, sk_eps, post_mult, norm_eps,
    N: tl.constexpr, BLOCK_N: tl.constexpr, MIX_PAD: tl.constexpr, BLOCK_HF: tl.constexpr,
    BLOCK_S: tl.constexpr, SINKHORN_REPEAT: tl.constexpr, HAS_NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    ni = tl.arange(0, BLOCK_N)
    nmask = ni < N
    cmask = nmask[:, None] & nmask[None, :]
    hs = tl.arange(0, BLOCK_HF)
    hmask = hs < H
    # The token's streams and the norm weight are loaded first, beside the partials: none of
    # them waits for the gates.
    r = tl.load(cur_ptr + t * (N * H) + ni[:, None] * H + hs[None, :],
                mask=nmask[:, None] & hmask[None, :], other=0.0).to(tl.float32)
    if HAS_NORM:
        nw = tl.load(norm_w_ptr + hs, mask=hmask, other=0.0).to(tl.float32)
    # Every split's partials in one load per kind, summed along the split axis: a fixed
    # reduction tree (deterministic), and no chain of dependent loads per split.
    si = tl.arange(0, BLOCK_S)
    smask = si < num_splits
    rows = part_ptr + (si.to(tl.int64) * T + t) * MIX_PAD  # [BLOCK_S]
    m_pre = tl.sum(tl.load(rows[:, None] + ni[None, :], mask=smask[:, None] & nmask[None, :],
                           other=0.0), axis=0)
    m_post = tl.sum(tl.load(rows[:, None] + N + ni[None, :],
                            mask=smask[:, None] & nmask[None, :], other=0.0), axis=0)
    m_comb = tl.sum(tl.load(rows[:, None, None] + 2 * N + ni[None, :, None] * N + ni[None, None, :],
                            mask=smask[:, None, None] & cmask[None, :, :], other=0.0), axis=0)
    sq = tl.sum(tl.load(sq_ptr + si.to(tl.int64) * T + t, mask=smask, other=0.0), axis=0)
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    b_pre = tl.load(base_ptr + ni, mask=nmask, other=0.0)
    b_post = tl.load(base_ptr + N + ni, mask=nmask, other=0.0)
    b_comb = tl.load(base_ptr + 2 * N + ni[:, None] * N + ni[None, :], mask=cmask, other=0.0)
    rstd = tl.rsqrt(sq / (N * H) + rms_eps)
    pre = tl.sigmoid((m_pre * rstd) * s0 + b_pre) + pre_eps
    post = tl.sigmoid((m_post * rstd) * s1 + b_post) * post_mult
    logits = (m_comb * rstd) * s2 + b_comb
    logits = tl.where(cmask, logits, float("-inf"))
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    e = tl.where(cmask, e, 0.0)
    comb = tl.where(cmask, e / tl.sum(e, axis=1)[:, None] + sk_eps, 0.0)
    comb = comb / (tl.sum(comb, axis=0)[None, :] + sk_eps)
    for _ in tl.static_range(SINKHORN_REPEAT - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + sk_eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + sk_eps)
    tl.store(post_out_ptr + t * N + ni, post, mask=nmask)
    tl.store(comb_out_ptr + t * (N * N) + ni[:, None] * N + ni[None, :], comb, mask=cmask)

    lin = tl.sum(tl.where(nmask, pre, 0.0)[:, None] * r, axis=0).to(tl.bfloat16)
    if HAS_NORM:
        v = lin.to(tl.float32)
        var = tl.sum(v * v, axis=0) / H
        y = (v * tl.rsqrt(var + norm_eps)).to(tl.bfloat16)
        lin = (y.to(tl.float32) * nw).to(tl.bfloat16)
    tl.store(lin_out_ptr + t * H + hs, lin, mask=hmask)


def _mix_pad(n: int) -> int:
    return max(16, triton.next_power_of_2(n * (n + 2)))


def _check(residual: torch.Tensor, fn: torch.Tensor | None = None) -> tuple[int, int, int]:
    if residual.dtype != torch.bfloat16 or residual.dim() != 3:
        raise ValueError(f"residual must be [T, n, H] bf16, got {tuple(residual.shape)} "
                         f"{residual.dtype}")
    t, n, h = residual.shape
    if fn is not None and (fn.dtype != torch.float32 or tuple(fn.shape) != (n * (n + 2), n * h)):
        raise ValueError(f"fn must be [{n * (n + 2)}, {n * h}] fp32, got {tuple(fn.shape)} "
                         f"{fn.dtype}")
    return t, n, h


def _fused_config(decode, num_tokens: int):
    """The one-launch config for this batch, or None for the two-launch kernels."""
    if isinstance(decode, mhc_decode.FusedConfig):
        return decode
    if decode not in DECODE_PATHS:
        raise ValueError(f"decode={decode!r} is not one of {', '.join(DECODE_PATHS)} "
                         "or a mhc_decode.FusedConfig")
    return mhc_decode.pick_config(num_tokens) if decode == "fused" else None


def _launch(residual, x, post_mix, comb_mix, fn, hc_scale, hc_base, rms_eps, hc_pre_eps,
            hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, norm_weight, norm_eps, decode):
    """One pre block, optionally preceded by a post block (x, post_mix, comb_mix given)."""
    t, n, h = _check(residual, fn)
    residual = residual.contiguous()
    fused = _fused_config(DEFAULT_DECODE if decode is None else decode, t)
    # The counters are made on the first call, whatever its size (vLLM's first forward is an
    # eager prefill-sized one), so that a later graph capture finds them.
    count = mhc_decode.counters(residual.device)
    if fused is not None and count is not None and t > 0:
        return mhc_decode.fused_block(residual, x, post_mix, comb_mix, fn, hc_scale, hc_base,
                                      rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
                                      sinkhorn_repeat, norm_weight, norm_eps, fused, count)
    with_post = x is not None
    cfg = mix_config(t)
    splits = triton.cdiv(h, cfg.block_h)
    pad = _mix_pad(n)
    dev = residual.device
    part = torch.empty(splits, t, pad, dtype=torch.float32, device=dev)
    sq = torch.empty(splits, t, dtype=torch.float32, device=dev)
    cur, post_out, comb_out, lin = mhc_decode.block_outputs(residual, with_post)
    if t == 0:
        return cur, post_out, comb_out, lin
    if with_post:
        x, post_mix, comb_mix = mhc_decode.post_operands(x, post_mix, comb_mix, t, n)
    _mix_partials_kernel[(triton.cdiv(t, cfg.block_t), splits)](
        residual, x if with_post else residual, post_mix if with_post else part,
        comb_mix if with_post else part, cur, fn.contiguous(), part, sq, t, h,
        N=n, N3=n * (n + 2), MIX_PAD=pad, BLOCK_T=cfg.block_t, BLOCK_H=cfg.block_h,
        WITH_POST=with_post, WITH_MIX=True,
        num_warps=cfg.num_warps,
    )
    has_norm = norm_weight is not None
    _mix_finalize_kernel[(t,)](
        part, sq, cur, hc_scale.contiguous(), hc_base.contiguous(),
        norm_weight if has_norm else hc_scale, post_out, comb_out, lin,
        t, h, splits, float(rms_eps), float(hc_pre_eps),
        float(hc_sinkhorn_eps), float(hc_post_mult_value), float(norm_eps),
        N=n, BLOCK_N=triton.next_power_of_2(n), MIX_PAD=pad,
        BLOCK_HF=triton.next_power_of_2(h), BLOCK_S=triton.next_power_of_2(splits),
        SINKHORN_REPEAT=mhc_decode.sinkhorn_repeat(sinkhorn_repeat), HAS_NORM=has_norm,
        num_warps=finalize_warps(h),
    )
    return cur, post_out, comb_out, lin


def mhc_pre(residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
            hc_post_mult_value, sinkhorn_repeat, norm_weight=None, norm_eps=0.0, decode=None):
    """-> (post [T, n, 1] fp32, comb [T, n, n] fp32, layer_input [T, H] bf16)."""
    _, post, comb, lin = _launch(residual, None, None, None, fn, hc_scale, hc_base, rms_eps,
                                 hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
                                 sinkhorn_repeat, norm_weight, norm_eps, decode)
    return post, comb, lin


def mhc_fused_post_pre(x, residual, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base,
                       rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
                       sinkhorn_repeat, norm_weight=None, norm_eps=0.0, decode=None):
    """-> (residual_cur [T, n, H] bf16, post, comb, layer_input)."""
    return _launch(residual, x, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base, rms_eps,
                   hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat,
                   norm_weight, norm_eps, decode)


def mhc_post(x, residual, post_layer_mix, comb_res_mix):
    """-> residual_cur [T, n, H] bf16 (the post block alone)."""
    t, n, h = _check(residual)
    residual = residual.contiguous()
    cur = torch.empty_like(residual)
    if t == 0:
        return cur
    cfg = mix_config(t)
    _mix_partials_kernel[(triton.cdiv(t, cfg.block_t), triton.cdiv(h, cfg.block_h))](
        residual, x.contiguous(), post_layer_mix.reshape(t, n).float().contiguous(),
        comb_res_mix.reshape(t, n, n).float().contiguous(), cur, residual, residual, residual,
        t, h, N=n, N3=n * (n + 2), MIX_PAD=_mix_pad(n), BLOCK_T=cfg.block_t,
        BLOCK_H=cfg.block_h, WITH_POST=True, WITH_MIX=False,
        num_warps=cfg.num_warps,
    )
    return cur


# ----------------------------------------------------------------------------- references


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """vLLM's weighted RMSNorm semantics: fp32 statistics, bf16 rounding before the weight."""
    v = x.float()
    y = v * torch.rsqrt(v.square().mean(-1, keepdim=True) + eps)
    if weight is None:
        return y.to(x.dtype)
    return (y.to(weight.dtype) * weight).to(x.dtype)


def mhc_pre_ref(residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
                hc_post_mult_value, sinkhorn_repeat, norm_weight=None, norm_eps=0.0):
    t, n, h = _check(residual, fn)
    flat = residual.reshape(t, n * h).float()
    mixes = flat @ fn.t()
    mixes = mixes * torch.rsqrt(flat.square().sum(-1, keepdim=True) / (n * h) + rms_eps)
    pre = torch.sigmoid(mixes[:, :n] * hc_scale[0] + hc_base[:n]) + hc_pre_eps
    post = torch.sigmoid(mixes[:, n:2 * n] * hc_scale[1] + hc_base[n:2 * n]) * hc_post_mult_value
    logits = mixes[:, 2 * n:].view(t, n, n) * hc_scale[2] + hc_base[2 * n:].view(1, n, n)
    comb = torch.softmax(logits, dim=-1) + hc_sinkhorn_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_sinkhorn_eps)
    for _ in range(sinkhorn_repeat - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_sinkhorn_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_sinkhorn_eps)
    lin = (pre.unsqueeze(-1) * residual.float()).sum(dim=1).to(torch.bfloat16)
    if norm_weight is not None:
        lin = rms_norm_ref(lin, norm_weight, norm_eps)
    return post.view(t, n, 1), comb, lin


def mhc_post_ref(x, residual, post_layer_mix, comb_res_mix):
    mixed = torch.einsum("tij,tih->tjh", comb_res_mix.float(), residual.float())
    return (mixed + post_layer_mix.float() * x.unsqueeze(-2).float()).to(residual.dtype)


def mhc_fused_post_pre_ref(x, residual, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base,
                           rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
                           sinkhorn_repeat, norm_weight=None, norm_eps=0.0):
    cur = mhc_post_ref(x, residual, post_layer_mix, comb_res_mix)
    return (cur, *mhc_pre_ref(cur, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
                              hc_post_mult_value, sinkhorn_repeat, norm_weight, norm_eps))
