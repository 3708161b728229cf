"""The inline-PTX trellis decode of glmctl.kernels.exl3_trellis (what the GPU runs) computes what
the format defines: every position of every word, packed as the kernels expect (word pairs: the
first word's value in the low half), raw integers r = 1024 + bytesum and, with the affine map,
exllamav3's fp16 codebook values bit for bit. Checked with tests/unit/exl3_ptx_emulator (the GPU
lane checks the compiled code itself)."""

from __future__ import annotations

import importlib.util
import random

import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("triton") is None:  # found, not imported: see the import below
    pytest.skip("needs triton", allow_module_level=True)

from glmctl.kernels.triton_env import import_interpreted  # noqa: E402

from tests.unit import exl3_ptx_emulator as ptx  # noqa: E402

# through the interpreter when triton is not loaded yet, so that this file does not switch the
# process's triton to compiled mode for the interpreted kernel tests collected after it
(tr,) = import_interpreted("glmctl.kernels.exl3_trellis") or (__import__(
    "glmctl.kernels.exl3_trellis", fromlist=["exl3_trellis"]),)


def _f16(bits: int) -> float:
    return float(torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.float16))


def _state(z: int, q: int) -> int:
    """Position q of the word w in z = prev << 32 | w, from the format definition (module doc)."""
    return (z >> (28 - 4 * q)) & 0xFFFF


@pytest.mark.parametrize("affine", [False, True])
def test_inline_decode_block_matches_the_format(affine):
    asm = (tr._ASM_AFFINE if affine else tr._ASM_RAW).value
    rng = random.Random(7 + affine)
    words = [0, 0xFFFFFFFF, 0x80000001, 0x12345678] + [rng.getrandbits(32) for _ in range(60)]
    for i in range(0, len(words), 2):
        wa, wb = words[i], words[i + 1]
        pa, pb = words[(i + 17) % len(words)], words[(i + 33) % len(words)]
        out = ptx.run(asm, [0] * 8 + [wa, wb, pa, pb])[:8]
        for q in range(8):
            for half, (w, p) in enumerate(((wa, pa), (wb, pb))):
                state = _state((p << 32) | w, q)
                got = (out[q] >> (16 * half)) & 0xFFFF
                if affine:
                    want = tr.mul1_values(torch.tensor([state])).view(torch.int16).item() & 0xFFFF
                    assert got == want, (hex(w), hex(p), q, half)
                else:
                    r = 1024 + sum(((state * tr.MUL1 & 0xFFFFFFFF) >> s) & 255 for s in (0, 8, 16, 24))
                    assert _f16(got) == r, (hex(w), hex(p), q, half)


def test_raw_values_and_the_affine_map_give_the_codebook():
    """K_INV r + K_BIAS, evaluated in fp32 and rounded once, is exllamav3's value for every r."""
    r = torch.arange(1024, 2045, dtype=torch.float32)
    via_fp32 = (r * tr.K_INV + tr.K_BIAS).half()
    exact = (r.double() * tr.K_INV + tr.K_BIAS).half()
    assert torch.equal(via_fp32, exact)
    assert torch.equal(r.half().float(), r)  # r is exact in fp16
