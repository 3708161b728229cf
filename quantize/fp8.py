"""Block-scaled FP8 (e4m3fn) weights: the maths, in plain torch.

Format (DeepSeek-V3 style, what vLLM 0.30's `Fp8LinearMethod` with `weight_block_size` loads):

    weight            float8_e4m3fn [N, K]              same shape as the original [out, in] matrix
    weight_scale_inv  float32 [ceil(N/B), ceil(K/B)]    one scale per B x B block (B = 128)
    dequantised       weight[i, j] * weight_scale_inv[i // B, j // B]

Each block's scale is amax(|block|) / 448, so the block's largest element maps to +-448, the
largest finite e4m3fn value; an all-zero block gets scale 1. Blocks at the bottom and right edges
may be partial (N or K not a multiple of B): their scale comes from the elements they have, exactly
the grid `create_fp8_scale_parameter` allocates (ceil) and `_dequant_fp8_block` in vLLM's
glm5next loader expands. Rounding is torch's cast to float8_e4m3fn: round to nearest, ties to even,
saturating at +-448 (never NaN).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

FP8_MAX = 448.0


def scale_shape(shape: tuple[int, int], block: int) -> tuple[int, int]:
    return (math.ceil(shape[0] / block), math.ceil(shape[1] / block))


def quantize_block_fp8(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a 2-D bf16/fp16/fp32 matrix: returns (fp8 weight, fp32 weight_scale_inv).

    Rows may be a stripe of a larger matrix as long as the stripe starts on a block row: the
    scales of consecutive stripes then concatenate to the whole matrix's scales. `w` is not
    modified. Each element is scaled by 448 / amax(block) in fp32 and cast with torch's
    saturating round-to-nearest-even; |w * 448 / amax| exceeds 448 by at most an fp32 rounding
    step, which the cast saturates to 448.
    """
    import torch

    rows, cols = w.shape
    nb_r, nb_c = scale_shape((rows, cols), block)
    pad_r, pad_c = nb_r * block - rows, nb_c * block - cols
    # fp32 first: torch's CPU reductions are ~2x faster on fp32 than on bf16, and the working copy
    # is needed for the scaling anyway (a clone when `w` is already fp32, so `w` stays untouched).
    x = w.float() if w.dtype != torch.float32 else w.clone()
    if pad_r or pad_c:
        x = torch.nn.functional.pad(x, (0, pad_c, 0, pad_r))  # zeros never raise a block's amax
    blocks = x.view(nb_r, block, nb_c, block)
    # amax from max and min: no |x| temporary the size of the stripe; contiguous dim first
    # (a reduction over (1, 3) at once is ~25% slower on CPU).
    amax = torch.maximum(blocks.amax(dim=3).amax(dim=1), blocks.amin(dim=3).amin(dim=1).neg())
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("the matrix holds NaN or infinite values")
    nonzero = amax > 0
    scale_inv = torch.where(nonzero, amax / FP8_MAX, torch.ones_like(amax))
    blocks.mul_(torch.where(nonzero, FP8_MAX / amax, torch.ones_like(amax))[:, None, :, None])
    q = blocks.to(torch.float8_e4m3fn).view(nb_r * block, nb_c * block)
    if pad_r or pad_c:
        q = q[:rows, :cols].contiguous()
    return q, scale_inv


def dequantize_block_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block: int,
                         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """weight * weight_scale_inv broadcast over B x B blocks (fp32 unless `out_dtype`)."""
    import torch

    rows, cols = q.shape
    s = scale_inv.float().repeat_interleave(block, dim=0)[:rows].repeat_interleave(block, dim=1)[:, :cols]
    out = q.float() * s
    return out if out_dtype is None or out_dtype == torch.float32 else out.to(out_dtype)


@dataclass
class ErrorStats:
    """Accumulates reference-vs-dequantised error over stripes of one tensor (float64 sums)."""

    signal_sq: float = 0.0
    error_sq: float = 0.0
    max_abs: float = 0.0
    numel: int = 0

    def add(self, reference: torch.Tensor, approx: torch.Tensor) -> None:
        import torch

        ref = reference.double()
        err = approx.double() - ref
        self.signal_sq += float(torch.dot(ref.flatten(), ref.flatten()))
        self.error_sq += float(torch.dot(err.flatten(), err.flatten()))
        if err.numel():
            self.max_abs = max(self.max_abs, float(err.abs().max()))
        self.numel += ref.numel()

    @property
    def rel_rms(self) -> float:
        """||w - w_hat|| / ||w||: 0 is exact."""
        if self.signal_sq == 0:
            return 0.0 if self.error_sq == 0 else math.inf
        return math.sqrt(self.error_sq / self.signal_sq)

    @property
    def snr_db(self) -> float:
        """10 log10(||w||^2 / ||w - w_hat||^2): +inf when exact."""
        if self.error_sq == 0:
            return math.inf
        if self.signal_sq == 0:
            return -math.inf
        return 10 * math.log10(self.signal_sq / self.error_sq)
