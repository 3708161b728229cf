"""The finisher of the one-launch mHC decode block (:mod:`.mhc_decode`, step 3 of its module doc):
the program that arrives last at its token group's counter turns the group's partial rows into the
block's outputs.

It reads ``part[split, token, :]`` (``MIX_PAD`` floats per row: the ``n3 = 2n + n^2`` logits at
their ``fn`` row index, the square sum at index ``n3``) and the group's ``residual_cur`` rows; other
programs of the launch wrote both, so both are loaded past L1 (``.cg``). It writes post ``[T, n]``
and comb ``[T, n, n]`` fp32 and the layer input ``[T, H]`` bf16 (RMS-normed where a norm weight is
given). The partials are summed over the splits in one fixed tree, so the outputs do not depend on
which program finishes.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_rows(cur_ptr, t64, tmask, h0, H, hf, N: tl.constexpr):
    """The group's streams over hidden columns [h0, h0 + FIN_H): a tuple of [BLOCK_T, FIN_H]."""
    hs = h0 + hf
    mask = tmask[:, None] & (hs < H)[None, :]
    rows = ()
    for i in tl.static_range(N):
        rows = rows + (tl.load(cur_ptr + t64[:, None] * (N * H) + i * H + hs[None, :], mask=mask,
                               other=0.0, cache_modifier=".cg"),)
    return rows


@triton.jit
def _finish_group(
    part_ptr, cur_ptr, scale_ptr, base_ptr, norm_w_ptr, post_out_ptr, comb_out_ptr, lin_out_ptr,
    tmask, t64, T, H, num_splits,
    rms_eps, pre_eps, sk_eps, post_mult, norm_eps,
    N: tl.constexpr, N3: tl.constexpr, MIX_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_S: tl.constexpr, FIN_H: tl.constexpr, FIN_CHUNKS: tl.constexpr,
    SINKHORN_REPEAT: tl.constexpr, HAS_NORM: tl.constexpr,
):
    # With several chunks, the first chunk's rows are requested beside the partials, so their
    # latency overlaps the partials' (a whole row requested that early makes ptxas spill).
    hf = tl.arange(0, FIN_H)
    if FIN_CHUNKS > 1:
        nxt = _load_rows(cur_ptr, t64, tmask, 0, H, hf, N)
    si = tl.arange(0, BLOCK_S)
    oi = tl.arange(0, MIX_PAD)
    parts = tl.load(part_ptr + (si.to(tl.int64)[:, None, None] * T + t64[None, :, None]) * MIX_PAD
                    + oi[None, None, :],
                    mask=(si < num_splits)[:, None, None] & tmask[None, :, None]
                    & (oi <= N3)[None, None, :], other=0.0, cache_modifier=".cg")
    if HAS_NORM:
        w_first = tl.load(norm_w_ptr + hf, mask=hf < H, other=0.0).to(tl.float32)
    else:
        w_first = tl.zeros([FIN_H], dtype=tl.float32)
    mix = tl.sum(parts, axis=0)  # [BLOCK_T, MIX_PAD], one fixed tree over the splits
    m = ()  # m[o]: [BLOCK_T], logit o (o < n3) or the square sum (o == n3)
    for o in tl.static_range(N3 + 1):
        m = m + (tl.sum(tl.where(oi[None, :] == o, mix, 0.0), axis=1),)
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    rstd = tl.rsqrt(m[N3] / (N * H) + rms_eps)
    pres = ()
    for i in tl.static_range(N):
        pres = pres + (tl.sigmoid((m[i] * rstd) * s0 + tl.load(base_ptr + i)) + pre_eps,)
        post = tl.sigmoid((m[N + i] * rstd) * s1 + tl.load(base_ptr + N + i)) * post_mult
        tl.store(post_out_ptr + t64 * N + i, post, mask=tmask)
    if FIN_CHUNKS == 1:
        # The group's whole rows in one chunk: the collapsed rows stay in registers.
        lin = _collapse(_load_rows(cur_ptr, t64, tmask, 0, H, hf, N), pres, N)
        omask = tmask[:, None] & (hf < H)[None, :]
        out = lin_out_ptr + t64[:, None] * H + hf[None, :]
        if HAS_NORM:
            v = lin.to(tl.float32)
            rn = tl.rsqrt(tl.sum(v * v, axis=1) / H + norm_eps)
            lin = _apply_norm(lin, rn, w_first)
        tl.store(out, lin, mask=omask)
    else:
        # Chunk by chunk, the next chunk's loads in flight during the current one (a chunk
        # past H is fully masked: no memory traffic). With the norm, the bf16 collapsed rows
        # go to the output first and are read back by the same threads once the row's
        # statistics are known.
        sq = tl.zeros([BLOCK_T, FIN_H], dtype=tl.float32)
        for c in range(FIN_CHUNKS):
            rows = nxt
            nxt = _load_rows(cur_ptr, t64, tmask, (c + 1) * FIN_H, H, hf, N)
            lin = _collapse(rows, pres, N)
            hs = c * FIN_H + hf
            tl.store(lin_out_ptr + t64[:, None] * H + hs[None, :], lin,
                     mask=tmask[:, None] & (hs < H)[None, :])
            if HAS_NORM:
                v = lin.to(tl.float32)
                sq += v * v
        if HAS_NORM:
            rn = tl.rsqrt(tl.sum(sq, axis=1) / H + norm_eps)
            tl.debug_barrier()  # the rows read back may have been stored by other threads
            lnext = _load_lin(lin_out_ptr, t64, tmask, 0, H, hf)
            wnext = w_first
            for c in range(FIN_CHUNKS):
                lin = lnext
                w = wnext
                lnext = _load_lin(lin_out_ptr, t64, tmask, (c + 1) * FIN_H, H, hf)
                hn = (c + 1) * FIN_H + hf
                wnext = tl.load(norm_w_ptr + hn, mask=hn < H, other=0.0).to(tl.float32)
                hs = c * FIN_H + hf
                tl.store(lin_out_ptr + t64[:, None] * H + hs[None, :], _apply_norm(lin, rn, w),
                         mask=tmask[:, None] & (hs < H)[None, :])

    # comb[i * N + j]: softmax over j, then Sinkhorn (columns, then rows and columns again).
    comb = ()
    for i in tl.static_range(N):
        logits = ()
        for j in tl.static_range(N):
            logits = logits + ((m[2 * N + i * N + j] * rstd) * s2
                               + tl.load(base_ptr + 2 * N + i * N + j),)
        top = logits[0]
        for j in tl.static_range(1, N):
            top = tl.maximum(top, logits[j])
        es = ()
        for j in tl.static_range(N):
            es = es + (tl.exp(logits[j] - top),)
        total = es[0]
        for j in tl.static_range(1, N):
            total += es[j]
        for j in tl.static_range(N):
            comb = comb + (es[j] / total + sk_eps,)
    comb = _normalise_columns(comb, sk_eps, N)
    for _ in range(SINKHORN_REPEAT - 1):
        comb = _normalise_rows(comb, sk_eps, N)
        comb = _normalise_columns(comb, sk_eps, N)
    for ij in tl.static_range(N * N):
        tl.store(comb_out_ptr + t64 * (N * N) + ij, comb[ij], mask=tmask)


@triton.jit
def _collapse(rows, pres, N: tl.constexpr):
    """bf16(sum_i pre_i * cur_i) over a [BLOCK_T, FIN_H] chunk."""
    lin = pres[0][:, None] * rows[0].to(tl.float32)
    for i in tl.static_range(1, N):
        lin += pres[i][:, None] * rows[i].to(tl.float32)
    return lin.to(tl.bfloat16)


@triton.jit
def _apply_norm(lin, rn, w):
    """vLLM's weighted RMSNorm of bf16 rows: bf16(bf16(v * rstd) * w)."""
    y = (lin.to(tl.float32) * rn[:, None]).to(tl.bfloat16)
    return (y.to(tl.float32) * w[None, :]).to(tl.bfloat16)


@triton.jit
def _load_lin(lin_ptr, t64, tmask, h0, H, hf):
    hs = h0 + hf
    return tl.load(lin_ptr + t64[:, None] * H + hs[None, :], mask=tmask[:, None] & (hs < H)[None, :],
                   other=0.0, cache_modifier=".cg")


@triton.jit
def _normalise_columns(comb, eps, N: tl.constexpr):
    sums = ()
    for j in tl.static_range(N):
        s = comb[j]
        for i in tl.static_range(1, N):
            s += comb[i * N + j]
        sums = sums + (s + eps,)
    out = ()
    for ij in tl.static_range(N * N):
        out = out + (comb[ij] / sums[ij % N],)
    return out


@triton.jit
def _normalise_rows(comb, eps, N: tl.constexpr):
    sums = ()
    for i in tl.static_range(N):
        s = comb[i * N]
        for j in tl.static_range(1, N):
            s += comb[i * N + j]
        sums = sums + (s + eps,)
    out = ()
    for ij in tl.static_range(N * N):
        out = out + (comb[ij] / sums[ij // N],)
    return out
