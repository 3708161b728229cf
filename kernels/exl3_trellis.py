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

At K = 4 a tile is 32 uint32 words and word j holds exactly the symbols of positions 8j..8j+7,
so position 8j + q reads word j (and, for q < 3, the low 12 bits of word j - 1 mod 32).

Triton operand layout (`decode_tile_half`): a [BNT, 8, BKT, 4] block of words (tile column nt,
c0 = j // 4, tile row kt, jr = j % 4) decodes into two [BNT*8, BKT*16] fp16 matrices, one per
column half h (c = c0 + 8h): row n'' = nt*8 + c0 is output column nt*16 + 8h + c0, column
k' = kt*16 + 4 jr + 2 rhi + rlo is input row kt*16 + 8 rhi + 2 jr + rlo. Callers store the
matching activations in k' order (`k_of_kprime`) and put outputs back with `n_of_half_row`.
"""

from __future__ import annotations

import triton
import triton.language as tl

MUL1 = 0x83DCD12D
K_INV_BITS, K_BIAS_BITS = 0x1EEE, 0xC931
K_INV = 1774 / 262144  # fp16 0x1EEE exactly (1/147.7)
K_BIAS = -10.3828125  # fp16 0xC931 exactly
# value = bytesum * K_INV + (1024 * K_INV + K_BIAS): every term and the sum are exact in fp32, so
# the fp16 rounding of the fp32 result is exllamav3's single hfma rounding
_BIAS_SLOW: tl.constexpr = tl.constexpr(1024 * K_INV + K_BIAS)
# dp4a(x, 0x01010101, 0x4B000000) is the fp32 bit pattern of 2^23 + bytesum; fma(f, K_INV, c)
# with c = 1024 K_INV + K_BIAS - 2^23 K_INV (exact in fp32) gives the same exact value
_BIAS_FAST: tl.constexpr = tl.constexpr(1024 * K_INV + K_BIAS - 8388608 * K_INV)
_K_INV: tl.constexpr = tl.constexpr(K_INV)


def tensor_core_position(p: int) -> tuple[int, int]:
    """(row, col) inside a 16x16 tile of trellis position p (exllamav3's tensor_core_perm)."""
    t, q = divmod(p, 8)
    r0, c0 = 2 * (t % 4), t // 4
    return r0 + (q & 1) + 8 * ((q >> 1) & 1), c0 + 8 * (q >> 2)


def mul1_values(states):
    """fp16 codebook values of 16-bit states (torch int64 tensor)."""
    import torch

    x = (states.to(torch.int64) * MUL1) & 0xFFFFFFFF
    s = (x & 255) + ((x >> 8) & 255) + ((x >> 16) & 255) + ((x >> 24) & 255)
    return ((1024 + s).double() * K_INV + K_BIAS).to(torch.float16)


def decode_trellis_ref(trellis, bits: int):
    """The [in, out] fp16 matrix T of a stored projection, straight from the format definition
    (the `reconstruct` of exllamav3, before the Hadamard rotations and channel scales)."""
    import torch

    kt, nt, words16 = trellis.shape
    if words16 != 16 * bits:
        raise ValueError(f"trellis last dim {words16} != 16 * {bits} bits")
    u16 = trellis.to(torch.int64) & 0xFFFF
    # stream order of the 16-bit halves: high half of each uint32 first
    stream16 = u16.view(kt, nt, 8 * bits, 2).flip(-1).reshape(kt, nt, 16 * bits)
    bit = (stream16.unsqueeze(-1) >> torch.arange(15, -1, -1)) & 1  # MSB first
    stream = bit.reshape(kt, nt, 256 * bits)
    length = 256 * bits
    p = torch.arange(256)
    window = ((p.unsqueeze(1) + 1) * bits - 16 + torch.arange(16).unsqueeze(0)) % length  # [256, 16]
    states = (stream[:, :, window] << torch.arange(15, -1, -1)).sum(-1)  # [kt, nt, 256]
    values = mul1_values(states)
    rows, cols = zip(*(tensor_core_position(q) for q in range(256)), strict=True)
    tile = torch.empty((kt, nt, 16, 16), dtype=torch.float16)
    tile[:, :, torch.tensor(rows), torch.tensor(cols)] = values
    return tile.permute(0, 2, 1, 3).reshape(kt * 16, nt * 16)


def k_of_kprime(kp):
    """Input row (within a 16-row tile block) of operand column k' (works on ints and tensors)."""
    return (kp // 16) * 16 + ((kp // 2) % 2) * 8 + ((kp // 4) % 4) * 2 + kp % 2


def n_of_half_row(row, half: int):
    """Output column of row n'' of the column-half `half` operand."""
    return (row // 8) * 16 + 8 * half + row % 8


@triton.jit
def _k_of_kprime(kp):
    return (kp // 16) * 16 + ((kp // 2) % 2) * 8 + ((kp // 4) % 4) * 2 + kp % 2


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
def _mul1(state, FAST: tl.constexpr):
    """fp16 mul1 codebook value of uint32 states < 2^16."""
    x = state * 0x83DCD12D
    if FAST:
        bits = tl.inline_asm_elementwise("dp4a.u32.u32 $0, $1, 16843009, 1258291200;", "=r,r", [x],
                                         dtype=tl.uint32, is_pure=True, pack=1)
        v = tl.fma(bits.to(tl.float32, bitcast=True), _K_INV, _BIAS_FAST)
    else:
        t = (x & 0x00FF00FF) + ((x >> 8) & 0x00FF00FF)
        s = (t & 0xFFFF) + (t >> 16)
        v = s.to(tl.float32) * _K_INV + _BIAS_SLOW
    return v.to(tl.float16)


@triton.jit
def _pair(w, prev, Q: tl.constexpr, FAST: tl.constexpr):
    """Positions Q and Q + 2 of every word (rows r0 + 0 and r0 + 8) on a new last axis."""
    return tl.join(_mul1(_state(w, prev, Q), FAST), _mul1(_state(w, prev, Q + 2), FAST))


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
def decode_tile_half(w, prev, HALF: tl.constexpr, BNT: tl.constexpr, BKT: tl.constexpr,
                     FAST: tl.constexpr):
    """[BNT*8, BKT*16] fp16 operand of column half HALF from uint32 words [BNT, 8, BKT, 4] and
    their predecessors (word j - 1 mod 32 of the same tile); see the module docstring."""
    q0: tl.constexpr = 4 * HALF
    # tl.join stacks on a new last axis: [..., rhi, rlo] is join over rlo of pairs over rhi
    v = tl.join(_pair(w, prev, q0, FAST), _pair(w, prev, q0 + 1, FAST))
    return tl.reshape(v, [BNT * 8, BKT * 16])
