"""fp32 -> float8_e4m3fn rounding written as integer operations (a Triton helper, not a kernel).

Why not ``x.to(tl.float8e4nv)``: the Triton interpreter rounds that conversion wrongly (it keeps
the old exponent when rounding carries, flushes subnormals, rounds ties away from zero), so a
quantising kernel could not be checked bit for bit on CPU. This helper gives the same bits as
torch's ``.to(torch.float8_e4m3fn)`` and as the GPU's ``cvt.rn.satfinite`` (round to nearest
even, saturate to +-448) under the interpreter and on the GPU alike; it costs a handful of
integer instructions per value, which only the cache-write paths pay.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e4m3_bits(x):
    """float8_e4m3fn bit patterns (int32 in [0, 255]) of fp32 ``x``, saturating, RTNE."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal range (|x| >= 2^-6): keep 3 of the 23 mantissa bits, ties to even; a carry rolls
    # into the exponent by itself. Rebias the exponent from 127 to 7: subtract 120 << 3.
    lsb = (mag >> 20) & 1
    normal = ((mag + 0x7FFFF + lsb) >> 20) - (120 << 3)
    # Subnormal range: value = m * 2^-9, m in [0, 8]; |x| * 512 is exact, and adding and
    # subtracting 1.5 * 2^23 rounds it to the nearest even integer in fp32.
    scaled = tl.abs(x) * 512.0
    m = ((scaled + 12582912.0) - 12582912.0).to(tl.int32)
    out = tl.where(mag >= 0x3C800000, normal, m)
    return out | sign
