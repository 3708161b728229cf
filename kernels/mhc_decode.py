"""One launch per mHC block at decode sizes: the (post +) pre block of ``mhc_pre_post`` (same
arguments and semantics; its ``mhc_pre_ref`` / ``mhc_fused_post_pre_ref`` are the references).

Grid (token groups of ``block_t`` tokens, hidden splits). Every program:

1. walks its split's columns in ``block_h`` chunks (the next chunk's loads issued before the
   current chunk's stores): the post block where fused (storing ``residual_cur``), then the fp32
   products of the mix projection and the square sum, accumulated in registers; one partial row
   per token to ``part[split, token, :]`` (``MIX_PAD`` floats: the ``n3 = 2n + n^2`` logits at
   their ``fn`` row index, the square sum at index ``n3``);
2. arrives at its group's counter: a CTA barrier, then one ``acq_rel`` atomic add at GPU scope
   (release: the CTA's stores before the count). The program drawing ticket ``splits - 1``
   arrived last: every store of its group is visible to it (acquire). It alone goes on, and sets
   the counter back to 0, so every launch finds the counters at 0 (nothing to clear between
   launches or graph replays);
3. (last program of the group, :mod:`.mhc_decode_finish`) sums the partials over the splits in
   one fixed tree (whichever program finishes, the sums are the same: deterministic), computes
   the pre and post gates, collapses the group's tokens, ``bf16(sum_i pre_i * cur_i)``, chunk by
   chunk (the first chunk requested beside the partials), applies the RMSNorm to the bf16 rows as
   vLLM's separate norm does, and last the comb gates: each of the ``n^2`` entries is its own
   ``[block_t]`` vector, so softmax and Sinkhorn rounds are register arithmetic, no cross-thread
   reduction.

Loads of what other programs of the launch wrote bypass L1 (``.cg``). The counters are a
persistent int32 buffer per device (``counters``), allocated and zeroed outside graph capture;
launches sharing it must not run concurrently (one stream per device, as a model's forward).

Cost per block at GLM-5.3-Flash's shape (n=4, H=4096, fn 1.5 MiB fp32), predicted from byte
counts, not measured: the fn slice is read once per group (the first group from memory, the
others mostly from L2) and each finisher reads its tokens' rows alone (32 KiB per token) plus
``splits x 128 B`` of partials per token. At 32 tokens (t4: 8 groups x 16 splits) every SM
streams ~100 KiB of fn, then one SM per group reads 128 KiB of rows: ~1-2 µs each at one SM's
L2 bandwidth, plus a launch, the atomic and the gate arithmetic, ~5-6 µs per block against the
two-launch pair's 17 µs measured on the H200; at 4 tokens (t2: 2 groups x 32 splits) ~4 µs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .mhc_decode_finish import _finish_group


@dataclass(frozen=True)
class FusedConfig:
    """Tokens per group, hidden columns per chunk, hidden splits (programs per group, each
    looping over its columns chunk by chunk), the finisher's hidden chunk, warps."""

    name: str
    block_t: int
    block_h: int
    splits: int
    fin_h: int
    num_warps: int

    def plan(self, hidden: int) -> tuple[int, int]:
        """(splits, chunks per split) at this hidden size."""
        chunks = triton.cdiv(hidden, self.block_h)
        per_split = triton.cdiv(chunks, self.splits)
        return triton.cdiv(chunks, per_split), per_split


# At decode sizes every cost is a latency. One group's finisher reads its tokens' whole rows
# (32 KiB per token at n=4, H=4096) alone, while the fn slice (1.5 MiB fp32) is read once per
# group: block_t trades one against the other. Splits x groups stays near one program per SM at
# the largest batch of each row (128 programs); fin_h keeps ~100 registers at 8 warps, no
# spills on sm_89 (the cross-compile test checks it).
FUSED_T1 = FusedConfig("t1", block_t=1, block_h=64, splits=64, fin_h=4096, num_warps=8)
FUSED_T2 = FusedConfig("t2", block_t=2, block_h=64, splits=32, fin_h=512, num_warps=8)
FUSED_T4 = FusedConfig("t4", block_t=4, block_h=64, splits=16, fin_h=256, num_warps=8)
FUSED_T8 = FusedConfig("t8", block_t=8, block_h=64, splits=16, fin_h=128, num_warps=8)
FUSED_CONFIGS = (FUSED_T1, FUSED_T2, FUSED_T4, FUSED_T8)
# (most tokens, config): the first row that holds the batch; larger batches take the two-launch
# kernels of mhc_pre_post.
FUSED_BY_TOKENS = ((2, FUSED_T1), (8, FUSED_T2), (32, FUSED_T4), (64, FUSED_T8))
FUSED_MAX_TOKENS = FUSED_BY_TOKENS[-1][0]
# (tokens, config) the benchmark times beside the defaults (bench/mhc.py --sweep): one knob at a
# time around each default. Cross-compiled for sm_89 with the shipped ones.
FUSED_CANDIDATES = (
    (4, FusedConfig("t1s64", block_t=1, block_h=64, splits=64, fin_h=4096, num_warps=8)),
    (4, FusedConfig("t2s64", block_t=2, block_h=64, splits=64, fin_h=512, num_warps=8)),
    (4, FusedConfig("t4s64", block_t=4, block_h=64, splits=64, fin_h=256, num_warps=8)),
    (32, FusedConfig("t4s32", block_t=4, block_h=64, splits=32, fin_h=256, num_warps=8)),
    (32, FusedConfig("t8s32", block_t=8, block_h=64, splits=32, fin_h=128, num_warps=8)),
    (32, FusedConfig("t2s8", block_t=2, block_h=64, splits=8, fin_h=512, num_warps=8)),
)
MAX_GROUPS = 256


def pick_config(num_tokens: int) -> FusedConfig | None:
    for most, cfg in FUSED_BY_TOKENS:
        if num_tokens <= most:
            return cfg
    return None


def mix_pad(n: int) -> int:
    """Floats per partial row: the n3 logits and the square sum, padded to a power of two."""
    return triton.next_power_of_2(n * (n + 2) + 1)


_counters: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device) -> torch.Tensor | None:
    """The device's arrival counters (zeroed once, then reset by the kernel itself); None while a
    graph is being captured before any eager call made them (a capture cannot zero them)."""
    device = torch.device(device)
    buf = _counters.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _counters[device] = torch.zeros(MAX_GROUPS, dtype=torch.int32, device=device)
    return buf


@triton.jit
def _mhc_block_kernel(
    res_ptr, x_ptr, post_ptr, comb_ptr, cur_ptr, fn_ptr, part_ptr, count_ptr,
    scale_ptr, base_ptr, norm_w_ptr, post_out_ptr, comb_out_ptr, lin_out_ptr,
    T, H, num_splits, chunks_per_split,
    rms_eps, pre_eps, sk_eps, post_mult, norm_eps,
    N: tl.constexpr, N3: tl.constexpr, GP: tl.constexpr, CP: tl.constexpr,
    MIX_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr, FIN_H: tl.constexpr, FIN_CHUNKS: tl.constexpr,
    SINKHORN_REPEAT: tl.constexpr, WITH_POST: tl.constexpr, HAS_NORM: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    toks = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = toks < T
    t64 = toks.to(tl.int64)
    hb = tl.arange(0, BLOCK_H)
    gi = tl.arange(0, GP)
    ci = tl.arange(0, CP)
    if WITH_POST:
        ps = ()
        cs = ()  # comb[t, i, j] at index i * N + j
        for j in tl.static_range(N):
            ps = ps + (tl.load(post_ptr + t64 * N + j, mask=tmask, other=0.0),)
        for ij in tl.static_range(N * N):
            cs = cs + (tl.load(comb_ptr + t64 * (N * N) + ij, mask=tmask, other=0.0),)
    acc_g = tl.zeros([BLOCK_T, GP, BLOCK_H], dtype=tl.float32)
    acc_c = tl.zeros([BLOCK_T, CP, BLOCK_H], dtype=tl.float32)
    sq = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    # The split's columns in chunks of BLOCK_H; the next chunk's loads are issued before the
    # current chunk's stores (the compiler cannot move a load above a store it cannot prove
    # apart), so one chunk's latency overlaps the previous chunk's work.
    first = pid_s * chunks_per_split
    nxt = _load_chunk(res_ptr, x_ptr, fn_ptr, t64, tmask, first * BLOCK_H + hb, H, gi, ci,
                      N, WITH_POST)
    for c in range(chunks_per_split):
        tile = nxt
        hs = (first + c) * BLOCK_H + hb
        hn = hs + BLOCK_H
        nxt = _load_chunk(res_ptr, x_ptr, fn_ptr, t64, tmask,
                          tl.where(c + 1 < chunks_per_split, hn, H), H, gi, ci, N, WITH_POST)
        tile_mask = tmask[:, None] & (hs < H)[None, :]
        for j in tl.static_range(N):
            if WITH_POST:
                mixed = ps[j][:, None] * tile[N].to(tl.float32)
                for i in tl.static_range(N):
                    mixed += cs[i * N + j][:, None] * tile[i].to(tl.float32)
                cur = mixed.to(tl.bfloat16)
                tl.store(cur_ptr + t64[:, None] * (N * H) + j * H + hs[None, :], cur,
                         mask=tile_mask)
                v = cur.to(tl.float32)
            else:
                v = tile[j].to(tl.float32)
            sq += v * v
            acc_g += v[:, None, :] * tile[N + 1 + j][None, :, :]
            acc_c += v[:, None, :] * tile[2 * N + 1 + j][None, :, :]
    row = part_ptr + (pid_s.to(tl.int64) * T + t64) * MIX_PAD  # [BLOCK_T]
    tl.store(row[:, None] + gi[None, :], tl.sum(acc_g, axis=2),
             mask=tmask[:, None] & (gi[None, :] < 2 * N))
    tl.store(row[:, None] + 2 * N + ci[None, :], tl.sum(acc_c, axis=2),
             mask=tmask[:, None] & (ci[None, :] < N * N))
    tl.store(row + N3, tl.sum(sq, axis=1), mask=tmask)
    tl.debug_barrier()
    ticket = tl.atomic_add(count_ptr + pid_t, 1, sem="acq_rel", scope="gpu")
    if ticket == num_splits - 1:
        tl.store(count_ptr + pid_t, 0)
        _finish_group(
            part_ptr, cur_ptr, scale_ptr, base_ptr, norm_w_ptr, post_out_ptr, comb_out_ptr,
            lin_out_ptr, tmask, t64, T, H, num_splits,
            rms_eps, pre_eps, sk_eps, post_mult, norm_eps,
            N, N3, MIX_PAD, BLOCK_T, BLOCK_S, FIN_H, FIN_CHUNKS, SINKHORN_REPEAT, HAS_NORM,
        )


@triton.jit
def _load_chunk(res_ptr, x_ptr, fn_ptr, t64, tmask, hs, H, gi, ci, N: tl.constexpr,
                WITH_POST: tl.constexpr):
    """One chunk's inputs, flat: the n residual tiles [BLOCK_T, BLOCK_H] (bf16), x (or a
    placeholder), then per stream j the fn rows [0, 2n) and [2n, n3) as [rows, BLOCK_H] tiles of
    fn[o, j*H + h]. Columns at or past H are masked (no memory traffic)."""
    hmask = hs < H
    tile_mask = tmask[:, None] & hmask[None, :]
    out = ()
    for i in tl.static_range(N):
        out = out + (tl.load(res_ptr + t64[:, None] * (N * H) + i * H + hs[None, :],
                             mask=tile_mask, other=0.0),)
    if WITH_POST:
        out = out + (tl.load(x_ptr + t64[:, None] * H + hs[None, :], mask=tile_mask, other=0.0),)
    else:
        out = out + (0.0,)
    for j in tl.static_range(N):
        cols = (j * H + hs)[None, :]
        out = out + (tl.load(fn_ptr + gi[:, None].to(tl.int64) * (N * H) + cols,
                             mask=(gi[:, None] < 2 * N) & hmask[None, :], other=0.0),)
    for j in tl.static_range(N):
        cols = (j * H + hs)[None, :]
        out = out + (tl.load(fn_ptr + (2 * N + ci[:, None]).to(tl.int64) * (N * H) + cols,
                             mask=(ci[:, None] < N * N) & hmask[None, :], other=0.0),)
    return out


def sinkhorn_repeat(value) -> int:
    # A compile-time constant (the model's, 20 for GLM-5.3-Flash): the rounds unroll.
    repeat = int(value)
    if repeat < 1:
        raise ValueError(f"sinkhorn_repeat must be at least 1, got {repeat}")
    return repeat


def block_outputs(residual: torch.Tensor, with_post: bool):
    """(residual_cur, post [T, n, 1] fp32, comb [T, n, n] fp32, layer input [T, H] bf16) of one
    block, allocated; residual_cur is the residual itself without a post block."""
    t, n, h = residual.shape
    dev = residual.device
    return (torch.empty_like(residual) if with_post else residual,
            torch.empty(t, n, 1, dtype=torch.float32, device=dev),
            torch.empty(t, n, n, dtype=torch.float32, device=dev),
            torch.empty(t, h, dtype=torch.bfloat16, device=dev))


def post_operands(x, post_mix, comb_mix, t: int, n: int):
    """The post block's inputs as the kernels read them: x contiguous, the gates fp32 [T, n] and
    [T, n, n]."""
    return (x.contiguous(), post_mix.reshape(t, n).float().contiguous(),
            comb_mix.reshape(t, n, n).float().contiguous())


def fused_block(residual, x, post_mix, comb_mix, fn, hc_scale, hc_base, rms_eps, hc_pre_eps,
                hc_sinkhorn_eps, hc_post_mult_value, repeat, norm_weight, norm_eps,
                cfg: FusedConfig, count: torch.Tensor):
    """One pre block, preceded by a post block where ``x`` is given, in one launch.
    ``residual`` [T, n, H] bf16 contiguous, ``fn`` [n3, n*H] fp32 (checked by the caller),
    ``count`` from ``counters``. -> (residual_cur, post [T, n, 1], comb [T, n, n], layer_input)."""
    t, n, h = residual.shape
    groups = triton.cdiv(t, cfg.block_t)
    if groups > count.numel():
        raise ValueError(f"{t} tokens in groups of {cfg.block_t} need {groups} counters, "
                         f"{count.numel()} exist")
    splits, per_split = cfg.plan(h)
    pad = mix_pad(n)
    with_post = x is not None
    part = torch.empty(splits, t, pad, dtype=torch.float32, device=residual.device)
    cur, post_out, comb_out, lin = block_outputs(residual, with_post)
    if t == 0:
        return cur, post_out, comb_out, lin
    if with_post:
        x, post_mix, comb_mix = post_operands(x, post_mix, comb_mix, t, n)
    fin_h = min(triton.next_power_of_2(h), cfg.fin_h)
    has_norm = norm_weight is not None
    _mhc_block_kernel[(groups, splits)](
        residual, x if with_post else residual, post_mix if with_post else part,
        comb_mix if with_post else part, cur, fn.contiguous(), part, count,
        hc_scale.contiguous(), hc_base.contiguous(), norm_weight if has_norm else hc_scale,
        post_out, comb_out, lin, t, h, splits, per_split,
        float(rms_eps), float(hc_pre_eps), float(hc_sinkhorn_eps), float(hc_post_mult_value),
        float(norm_eps),
        N=n, N3=n * (n + 2), GP=triton.next_power_of_2(2 * n),
        CP=triton.next_power_of_2(n * n), MIX_PAD=pad, BLOCK_T=cfg.block_t,
        BLOCK_H=cfg.block_h, BLOCK_S=triton.next_power_of_2(splits), FIN_H=fin_h,
        FIN_CHUNKS=triton.cdiv(h, fin_h), SINKHORN_REPEAT=sinkhorn_repeat(repeat),
        WITH_POST=with_post, HAS_NORM=has_norm,
        num_warps=cfg.num_warps,
    )
    return cur, post_out, comb_out, lin
