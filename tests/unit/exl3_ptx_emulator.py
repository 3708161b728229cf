"""A Python model of the few PTX instructions glmctl.kernels.exl3_trellis's decode block uses,
so the unit lane can check that block's arithmetic without a GPU (the interpreter cannot run
inline PTX). Semantics from the PTX ISA: b32 registers as ints in [0, 2^32); `shf.r.wrap` shifts
the 64-bit pair {hi, lo} right by the amount mod 32; `prmt` (default mode) picks bytes of {b, a}
by the selector's nibbles (bit 3 set: the picked byte's sign replicated); `dp4a.u32.u32` adds the
unsigned byte products; `fma.rn.f16x2` rounds each half once to fp16."""

from __future__ import annotations

import re

import numpy as np

M32 = 0xFFFFFFFF


def _f16(bits: int) -> float:
    return float(np.array([bits], dtype=np.uint16).view(np.float16)[0])


def _bits16(value: float) -> int:
    return int(np.array([value], dtype=np.float16).view(np.uint16)[0])


def _prmt(a: int, b: int, sel: int) -> int:
    data = (b << 32) | a
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = (data >> (8 * (nib & 7))) & 0xFF
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _fma_f16x2(a: int, b: int, c: int) -> int:
    out = 0
    for h in range(2):
        x, y, z = (_f16((v >> (16 * h)) & 0xFFFF) for v in (a, b, c))
        out |= _bits16(x * y + z) << (16 * h)  # x*y + z is exact in float64 for fp16 operands
    return out


def run(asm: str, operands: list[int]) -> list[int]:
    """Execute `asm` (one inline-asm body; $0.. numbered as Triton numbers them) with `operands`
    as the input registers following the outputs; return every $n register."""
    regs: dict[str, int] = {f"${i}": v & M32 for i, v in enumerate(operands)}

    def val(tok: str) -> int:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return int(tok, 0) & M32

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." :
            continue
        op, _, rest = line.partition(" ")
        args = [t.strip() for t in rest.split(",")]
        d, src = args[0], args[1:]
        if op == "shf.r.wrap.b32":
            lo, hi, n = val(src[0]), val(src[1]), val(src[2]) % 32
            r = (((hi << 32) | lo) >> n) & M32
        elif op == "bfe.u32":
            r = (val(src[0]) >> val(src[1])) & ((1 << val(src[2])) - 1)
        elif op == "and.b32":
            r = val(src[0]) & val(src[1])
        elif op == "shr.b32":
            r = val(src[0]) >> val(src[1])
        elif op == "prmt.b32":
            r = _prmt(val(src[0]), val(src[1]), val(src[2]))
        elif op == "mul.lo.u32":
            r = (val(src[0]) * val(src[1])) & M32
        elif op == "dp4a.u32.u32":
            a, b = val(src[0]), val(src[1])
            r = (val(src[2]) + sum(((a >> s) & 0xFF) * ((b >> s) & 0xFF) for s in (0, 8, 16, 24))) & M32
        elif op == "mov.b32":
            r = val(src[0])
        elif op == "fma.rn.f16x2":
            r = _fma_f16x2(val(src[0]), val(src[1]), val(src[2]))
        else:
            raise ValueError(f"instruction outside the modelled subset: {line!r}")
        regs[d] = r
    return [regs[k] for k in sorted((k for k in regs if re.fullmatch(r"\$\d+", k)), key=lambda k: int(k[1:]))]
