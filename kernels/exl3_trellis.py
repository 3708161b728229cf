"""EXL3 trellis tiles as exllamav3 1.6.5 stores them: the torch reference decode and the Triton
decode of 4-bit tiles straight into matrix-product operands.

The stored form (glmctl.quantize.exl3_format; exllamav3 quant/pack.cu, quant/exl3_dq.cuh,
modules/quant/exl3_lib/quantize.py `tensor_core_perm`):

  trellis [in/16, out/16, 16*K] int16   one 16x16 tile per [i, j]: rows are input channels (k),
                                        columns output channels (n); 256*K bits per tile
  bitstream of a tile   the int16 words read as little-endian uint32 (word w = int16[2w] |
                        int16[2w+1] << 16), each uint32 most significant bit first: stream bit b
                        is bit 31 - b % 32 of word b // 32
  state of position p   the 16 stream bits ending at bit (p+1)*K, first bit most significant,
                        wrapping around the tile (tail-biting): bits [(p+1)K - 16, (p+1)K) mod 256K
  value (mul1 codebook) x = state * 0x83DCD12D mod 2^32; v = fp16((1024 + bytesum(x)) *
                        fp16(0x1EEE) + fp16(0xC931)), one rounding (exllamav3's dp4a + hfma)
  position -> element   p = 8t + q (t: mma lane, q: 0..7): r0 = 2 (t % 4), c0 = t // 4;
                        r = r0 + (q & 1) + 8 ((q >> 1) & 1), c = c0 + 8 (q >> 2)  (the m16n8k16
                        B-fragment order exllamav3 decodes into)

At K = 4 a tile is 32 uint32 words and word j holds exactly the symbols of positions 8j..8j+7:
with z = (word j-1 mod 32) << 32 | word j, the state of position 8j + q is
(z >> (28 - 4q)) & 0xFFFF.

Raw values. The codebook is affine in r = 1024 + bytesum(x), an integer in [1024, 2044] that
fp16 holds exactly: v = K_INV r + K_BIAS. The decode can therefore hand the matrix product r
and leave the affine map to the product's epilogue: sum_k a_k v_k = K_INV sum_k a_k r_k +
K_BIAS sum_k a_k (`affine_epilogue`). That drops the per-weight fp16 fma (exact to fp32
accumulation instead of exllamav3's one fp16 rounding per weight; the two terms cancel by ~10x,
well inside fp32). `AFFINE=True` decodes exllamav3's fp16 values instead (the decode-rate bench).

Triton operand layout (`decode_block`): a [8 (nt), 8 (c0), BKT (kt), 4 (jr)] block of words
(tile column nt, word j = 4 c0 + jr of tile row kt) and the predecessors of its jr = 0 words
[8, 8, BKT] decode into two [64, BKT*16] fp16 matrices, one per column half h: row
n'' = 8 nt + c0 is output column 16 nt + 8 h + c0 (`n_of_half_row`); column
k' = 16 kt + 8 rhi + 4 rlo + 2 jh + jl (jr = 2 jh + jl) is input row 16 kt + 8 rhi + 2 jr + rlo
(`k_of_kprime`). Callers store the matching activations in k' order. jl is innermost so that the
two words of a packed fp16 pair (the decode works on word pairs jr, jr + 1) are neighbours in k'.
"""

from __future__ import annotations

import triton
import triton.language as tl

MUL1 = 0x83DCD12D
K_INV_BITS, K_BIAS_BITS = 0x1EEE, 0xC931
K_INV = 1774 / 262144  # fp16 0x1EEE exactly (1/147.7)
K_BIAS = -10.3828125  # fp16 0xC931 exactly
_K_INV: tl.constexpr = tl.constexpr(K_INV)
_K_BIAS: tl.constexpr = tl.constexpr(K_BIAS)

# Two words per invocation ($8/$9, predecessors $10/$11) -> the 8 positions of both, packed as
# fp16 pairs ($q = position q of word a | of word b << 16). States: u = z >> 24 and t = z >> 4
# (funnel shifts) give positions 0-2 and 4, 6; positions 3, 5, 7 come from the word alone
# (byte-aligned: prmt with a zero operand). r = dp4a(state * MUL1, 0x01010101, 0x6400): 0x6400 is
# fp16 1024.0 and the byte sum (<= 1020) lands in its mantissa, so the low 16 bits are fp16(r).
_STATES = """
shf.r.wrap.b32 u, {w}, {p}, 24;
shf.r.wrap.b32 t, {w}, {p}, 4;
bfe.u32 s0, u, 4, 16;
and.b32 s1, u, 65535;
shr.b32 s2, t, 16;
shr.b32 s3, {w}, 16;
prmt.b32 s4, t, 0, 0x4421;
prmt.b32 s5, {w}, 0, 0x4421;
and.b32 s6, t, 65535;
and.b32 s7, {w}, 65535;
""" + "".join(f"mul.lo.u32 s{q}, s{q}, 0x83DCD12D;\ndp4a.u32.u32 {{r}}{q}, s{q}, 0x01010101, 0x6400;\n"
              for q in range(8))
_PACK = "".join(f"prmt.b32 ${q}, a{q}, b{q}, 0x5410;\n" for q in range(8))
_AFFINE = "".join(f"fma.rn.f16x2 ${q}, ${q}, kinv, kbias;\n" for q in range(8))
_ASM_HEAD = ("{\n.reg .b32 u, t, s<8>, a<8>, b<8>, kinv, kbias;\n"
             + _STATES.format(w="$8", p="$10", r="a") + _STATES.format(w="$9", p="$11", r="b") + _PACK)
_ASM_RAW: tl.constexpr = tl.constexpr(_ASM_HEAD + "}\n")
_ASM_AFFINE: tl.constexpr = tl.constexpr(
    _ASM_HEAD + f"mov.b32 kinv, {K_INV_BITS * 0x10001:#x};\nmov.b32 kbias, {K_BIAS_BITS * 0x10001:#x};\n"
    + _AFFINE + "}\n")
_CONSTRAINTS: tl.constexpr = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 4))


def tensor_core_position(p: int) -> tuple[int, int]:
    """(row, col) inside a 16x16 tile of trellis position p (exllamav3's tensor_core_perm)."""
    t, q = divmod(p, 8)
    r0, c0 = 2 * (t % 4), t // 4
    return r0 + (q & 1) + 8 * ((q >> 1) & 1), c0 + 8 * (q >> 2)


def mul1_values(states, raw: bool = False):
    """fp16 codebook values of 16-bit states (torch int64 tensor); raw: the integers r instead."""
    import torch

    x = (states.to(torch.int64) * MUL1) & 0xFFFFFFFF
    s = (x & 255) + ((x >> 8) & 255) + ((x >> 16) & 255) + ((x >> 24) & 255)
    if raw:
        return (1024 + s).to(torch.float16)
    return ((1024 + s).double() * K_INV + K_BIAS).to(torch.float16)


def decode_trellis_ref(trellis, bits: int, raw: bool = False):
    """The [in, out] fp16 matrix T of a stored projection, straight from the format definition
    (the `reconstruct` of exllamav3, before the Hadamard rotations and channel scales), on the
    trellis's device; raw: the integers r (module docstring) instead of the values."""
    import torch

    kt, nt, words16 = trellis.shape
    if words16 != 16 * bits:
        raise ValueError(f"trellis last dim {words16} != 16 * {bits} bits")
    dev = trellis.device
    u16 = trellis.to(torch.int64) & 0xFFFF
    # stream order of the 16-bit halves: high half of each uint32 first
    stream16 = u16.view(kt, nt, 8 * bits, 2).flip(-1).reshape(kt, nt, 16 * bits)
    msb_first = torch.arange(15, -1, -1, device=dev)
    bit = (stream16.unsqueeze(-1) >> msb_first) & 1
    stream = bit.reshape(kt, nt, 256 * bits)
    length = 256 * bits
    p = torch.arange(256, device=dev)
    window = ((p.unsqueeze(1) + 1) * bits - 16 + torch.arange(16, device=dev).unsqueeze(0)) % length  # [256, 16]
    states = (stream[:, :, window] << msb_first).sum(-1)  # [kt, nt, 256]
    values = mul1_values(states, raw)
    rows, cols = zip(*(tensor_core_position(q) for q in range(256)), strict=True)
    tile = torch.empty((kt, nt, 16, 16), dtype=torch.float16, device=dev)
    tile[:, :, torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = values
    return tile.permute(0, 2, 1, 3).reshape(kt * 16, nt * 16)


def k_of_kprime(kp):
    """Input row of operand column k' (works on ints and tensors); see the module docstring."""
    rhi, rlo, jr = (kp // 8) % 2, (kp // 4) % 2, kp % 4
    return (kp // 16) * 16 + 8 * rhi + 2 * jr + rlo


def n_of_half_row(row, half: int):
    """Output column of row n'' of the column-half `half` operand."""
    return (row // 8) * 16 + 8 * half + row % 8


@triton.jit
def _k_of_kprime(kp):
    return (kp // 16) * 16 + ((kp // 8) % 2) * 8 + (kp % 4) * 2 + (kp // 4) % 2


@triton.jit
def _n_of_half_row(row, HALF: tl.constexpr):
    return (row // 8) * 16 + 8 * HALF + row % 8


@triton.jit
def _hadamard(rows, cols):
    """Entries (+-1, fp32) of the 128x128 Sylvester Hadamard at [rows[i], cols[j]]."""
    v = rows[:, None] & cols[None, :]
    v = v ^ (v >> 4)
    v = v ^ (v >> 2)
    v = v ^ (v >> 1)
    return 1.0 - 2.0 * (v & 1).to(tl.float32)


@triton.jit
def block_offsets(ROW_WORDS: tl.constexpr, BKT: tl.constexpr):
    """Word offsets of a block of 8 tile columns x BKT tile rows ([8, 8, BKT, 4], see the module
    docstring) and of the predecessors of its jr = 0 words ([8, 8, BKT]); ROW_WORDS: words per
    tile row of the projection (out/16 * 32)."""
    nt = tl.arange(0, 8)[:, None, None]
    c0 = tl.arange(0, 8)[None, :, None]
    kt = tl.arange(0, BKT)[None, None, :]
    tile = nt * 32 + kt * ROW_WORDS
    words = (tile + c0 * 4)[:, :, :, None] + tl.arange(0, 4)[None, None, None, :]
    return words, tile + (c0 * 4 + 31) % 32


@triton.jit
def _state(w, prev, Q: tl.constexpr):
    # position 8j + Q: the 16 bits ending 4 (Q + 1) bits into word j
    if Q < 3:
        s = ((w >> (28 - 4 * Q)) | (prev << (4 * Q + 4))) & 0xFFFF
    elif Q == 3:
        s = w >> 16
    else:
        s = (w >> (28 - 4 * Q)) & 0xFFFF
    return s


@triton.jit
def _value(w, prev, Q: tl.constexpr, AFFINE: tl.constexpr):
    x = _state(w, prev, Q) * 0x83DCD12D
    t = (x & 0x00FF00FF) + ((x >> 8) & 0x00FF00FF)
    r = ((t & 0xFFFF) + (t >> 16) + 1024).to(tl.float32)
    if AFFINE:
        r = r * _K_INV + _K_BIAS  # exact in fp32: the fp16 rounding below is the only one
    return r.to(tl.float16)


@triton.jit
def decode_words(w, prev, AFFINE: tl.constexpr, FAST: tl.constexpr):
    """The 8 positions (q = 0..7) of uint32 words w with predecessors prev, as 8 fp16 tensors of
    w's shape: raw values r, or the codebook's fp16 values with AFFINE. FAST: one PTX block per
    word pair (dp4a, sm_61+); else plain Triton (the interpreter), the same numbers."""
    if FAST:
        if AFFINE:
            out = tl.inline_asm_elementwise(_ASM_AFFINE, _CONSTRAINTS, [w, prev], dtype=(tl.float16,) * 8,
                                            is_pure=True, pack=2)
        else:
            out = tl.inline_asm_elementwise(_ASM_RAW, _CONSTRAINTS, [w, prev], dtype=(tl.float16,) * 8,
                                            is_pure=True, pack=2)
    else:
        out = (_value(w, prev, 0, AFFINE), _value(w, prev, 1, AFFINE), _value(w, prev, 2, AFFINE),
               _value(w, prev, 3, AFFINE), _value(w, prev, 4, AFFINE), _value(w, prev, 5, AFFINE),
               _value(w, prev, 6, AFFINE), _value(w, prev, 7, AFFINE))
    return out


@triton.jit
def _half(qa, qb, Q0: tl.constexpr, BKT: tl.constexpr):
    """Column half Q0 // 4 from the positions of the jh = 0 (qa) and jh = 1 (qb) word pairs."""
    x00 = tl.join(qa[Q0], qb[Q0])  # [.., jl, jh] at rhi = 0, rlo = 0
    x01 = tl.join(qa[Q0 + 1], qb[Q0 + 1])
    x10 = tl.join(qa[Q0 + 2], qb[Q0 + 2])
    x11 = tl.join(qa[Q0 + 3], qb[Q0 + 3])
    z = tl.join(tl.join(x00, x01), tl.join(x10, x11))  # [nt, c0, kt, jl, jh, rlo, rhi]
    z = tl.permute(z, (0, 1, 2, 6, 5, 4, 3))  # [nt, c0, kt, rhi, rlo, jh, jl]
    return tl.reshape(z, [64, BKT * 16])


@triton.jit
def decode_block(w, prev0, BKT: tl.constexpr, AFFINE: tl.constexpr, FAST: tl.constexpr):
    """The two [64, BKT*16] fp16 operands (column halves 0 and 1) of a word block w [8, 8, BKT, 4]
    (uint32) whose jr = 0 words have predecessors prev0 [8, 8, BKT]; see the module docstring."""
    w4 = tl.reshape(w, [8, 8, BKT, 2, 2])  # [.., jh, jl]
    wl0, wl1 = tl.split(w4)  # jl = 0, 1: [.., jh]
    w0, w2 = tl.split(wl0)
    w1, w3 = tl.split(wl1)
    qa = decode_words(tl.join(w0, w1), tl.join(prev0, w0), AFFINE, FAST)  # words jr = 0, 1
    qb = decode_words(tl.join(w2, w3), tl.join(w1, w2), AFFINE, FAST)  # words jr = 2, 3
    return _half(qa, qb, 0, BKT), _half(qa, qb, 4, BKT)


@triton.jit
def affine_epilogue(acc, asum):
    """sum_k a_k v_k from the raw product acc [R, N] = sum_k a_k r_k and asum [R] = sum_k a_k."""
    return acc * _K_INV + _K_BIAS * asum[:, None]


@triton.jit
def _decode_blocks_kernel(tr_ptr, out_ptr, ROW_WORDS: tl.constexpr, BKT: tl.constexpr, AFFINE: tl.constexpr,
                          FAST: tl.constexpr):
    base = tr_ptr + tl.program_id(0) * (BKT * ROW_WORDS) + tl.program_id(1) * 256
    woff, poff = block_offsets(ROW_WORDS, BKT)
    w = tl.load(base + woff).to(tl.uint32, bitcast=True)
    p = tl.load(base + poff).to(tl.uint32, bitcast=True)
    h0, h1 = decode_block(w, p, BKT, AFFINE, FAST)
    rows = tl.arange(0, 64)[:, None] * (BKT * 16) + tl.arange(0, BKT * 16)[None, :]
    dst = out_ptr + (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * (2 * 64 * BKT * 16)
    tl.store(dst + rows, h0)
    tl.store(dst + 64 * BKT * 16 + rows, h1)


def decode_blocks(trellis, bkt: int, affine: bool):
    """Every block operand of a 4-bit trellis [KT, NT, 64] (int16; KT % bkt == 0, NT % 8 == 0),
    as `decode_block` makes it: [KT/bkt, NT/8, 2 (column half), 64 (n''), bkt*16 (k')] fp16, raw
    integers or (affine) the codebook values. The tests' window on the decode."""
    import torch

    from .triton_env import interpreting

    kt, nt, _ = trellis.shape
    out = torch.empty((kt // bkt, nt // 8, 2, 64, bkt * 16), dtype=torch.float16, device=trellis.device)
    _decode_blocks_kernel[(kt // bkt, nt // 8)](trellis.contiguous().view(torch.int32), out, ROW_WORDS=nt * 32,
                                                BKT=bkt, AFFINE=affine, FAST=trellis.is_cuda and not interpreting())
    return out


def decode_blocks_ref(trellis, bkt: int, affine: bool):
    """`decode_blocks` from the format definition (`decode_trellis_ref`) and the layout maps."""
    import torch

    kt, nt, _ = trellis.shape
    dev = trellis.device
    t = decode_trellis_ref(trellis, 4, raw=not affine).view(kt // bkt, bkt * 16, nt * 16)
    t = t[:, k_of_kprime(torch.arange(bkt * 16, device=dev))]
    row = torch.arange(64, device=dev)
    cols = torch.stack([torch.stack([j * 128 + n_of_half_row(row, h) for h in (0, 1)]) for j in range(nt // 8)])
    return t[:, :, cols].permute(0, 2, 3, 4, 1)  # [KT/bkt, k', NT/8, 2, 64] -> [.., 2, 64, k']
