"""Standard errors for per-token scores, which are not independent.

Neighbouring tokens of source code are correlated (an identifier that is hard to predict once is
easy the next few times), so the textbook `std / sqrt(n)` over tokens is too small. The standard
error here is by *batch means*: the mean over contiguous blocks of tokens, whose block means are
close to independent once a block is longer than the correlation length. Blocks are 256 tokens,
shortened for short texts so that there are always at least 10 of them.

A comparison of two runs over the same tokens is *paired*: the per-token difference of negative
log-likelihoods cancels what the two models share (the text's own difficulty), which is almost
all of the variance; its batch-means standard error gives the interval of the relative change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

BLOCK_TOKENS = 256
MIN_BLOCKS = 10
Z95 = 1.959963984540054  # two-sided 95% normal quantile


def block_length(n: int) -> int:
    return max(1, min(BLOCK_TOKENS, n // MIN_BLOCKS))


def batch_means_stderr(values: np.ndarray) -> float:
    """Standard error of `values.mean()` by batch means over contiguous blocks (see module doc)."""
    n = len(values)
    if n < 2:
        return float("nan")
    block = block_length(n)
    k = n // block
    if k < 2:
        return float(np.std(values, ddof=1) / math.sqrt(n))
    means = values[: k * block].reshape(k, block).mean(axis=1)
    return float(np.std(means, ddof=1) / math.sqrt(k))


def stderr_method(n: int) -> str:
    block = block_length(n)
    return f"batch means over {n // block} contiguous blocks of {block} tokens"


@dataclass(frozen=True)
class RelativeChange:
    """exp(mean paired NLL difference) - 1, i.e. new perplexity / baseline perplexity - 1."""

    percent: float
    ci95_low_percent: float
    ci95_high_percent: float
    tokens_paired: int
    method: str


def relative_change(new_nll: np.ndarray, base_nll: np.ndarray) -> RelativeChange:
    if new_nll.shape != base_nll.shape:
        raise ValueError("paired comparison needs the same scored tokens")
    diff = new_nll - base_nll
    mean = float(diff.mean())
    se = batch_means_stderr(diff)
    if not math.isfinite(se):
        se = 0.0
    return RelativeChange(
        percent=100.0 * math.expm1(mean),
        ci95_low_percent=100.0 * math.expm1(mean - Z95 * se),
        ci95_high_percent=100.0 * math.expm1(mean + Z95 * se),
        tokens_paired=len(diff),
        method="paired per-token NLL differences, " + stderr_method(len(diff)),
    )
