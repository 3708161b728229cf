"""KL(reference || build) per token from two truncated (top-K) next-token distributions.

A server reports, per position, the log-probabilities of its top K tokens plus the actual next
token. Everything else is unknown except two facts: each unreported token's probability is at most
the smallest reported top-K probability (the *cap*), and the unreported tokens together hold the
*tail* mass 1 - sum(reported).

The divergence is computed over a partition of the vocabulary: one cell per token in the union of
the two reports, and one bucket for every other token. Merging tokens into a cell can only lose
divergence (the log-sum inequality), so the KL of a partition is a **lower bound** of the
full-vocabulary KL. A token in one report but not the other has an unknown probability on the
other side; this module takes, within the caps and tail masses above, the values that make the
divergence *smallest*. The true distributions satisfy those constraints, so the result is still a
lower bound of the exact KL, and it is the tightest one these reports allow: a token the reference
ranks highly that the build does not list gets at most the build's cap, which is what makes a
changed top-K set visible (merging it into the bucket, as a plain "renormalise and add a tail"
scheme does, would hide exactly that).

The minimisation is convex. Its optimum makes one likelihood ratio `rho = p/q` common to every
free value (clipped at the caps) and to the bucket:
    q_i = min(cap_q, p_i / rho)  for tokens only the reference listed,
    p_j = min(cap_p, rho * q_j)  for tokens only the build listed,
    p_rest = rho * q_rest,
with `rho` fixed by the two tail masses; when no such `rho` leaves both bucket masses positive, the
bucket is empty on both sides and each tail is filled separately (`rho_q`, `rho_p` below). Each
`rho` is found by bisection in log space, vectorised over positions. With K at least the
vocabulary, every cell is known and the result is the exact KL (the bucket then holds only float
rounding, which is dropped: see `ROUNDING`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TINY = 1e-12  # floor for masses in logs: a tail that rounds to 0 still bounds a finite KL
ROUNDING = 1e-6  # a bucket this light on both sides is float rounding (reports that list every token)
_LOG_RHO_RANGE = (-80.0, 80.0)
_BISECT_STEPS = 48  # 160 / 2**48: rho to 1e-12 relative


@dataclass(frozen=True)
class TopK:
    """One side's report at one position: the listed tokens, their log-probabilities, and the
    smallest top-K log-probability (every unlisted token is at most that likely)."""

    ids: np.ndarray  # int64, the listed tokens (top K plus the actual token)
    logprobs: np.ndarray  # float64, same order
    cap_logprob: float
    actual: int  # the token that was there in the text
    top: int  # the rank-1 token


@dataclass(frozen=True)
class PositionStats:
    """Per-position numbers of a comparison, as arrays over positions (text order)."""

    kld: np.ndarray  # lower bound of KL(reference || build), nats
    ref_logprob: np.ndarray  # log p_reference(actual token)
    build_logprob: np.ndarray  # log p_build(actual token)
    same_top: np.ndarray  # bool: the build's top token is the reference's
    p_ref_top_low: np.ndarray  # p_build(reference's top token): exact where listed, else 0 ..
    p_ref_top_high: np.ndarray  # .. the build's cap


def _xlogx_over(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a * ln(a / b), with 0 * ln(0 / b) = 0."""
    out = np.zeros_like(a)
    pos = a > 0
    out[pos] = a[pos] * (np.log(a[pos]) - np.log(np.maximum(b[pos], TINY)))
    return out


def _bisect_log(fn, lo: np.ndarray, hi: np.ndarray, increasing: bool) -> np.ndarray:
    """Per row, x in [lo, hi] with fn(x) = 0 for a monotone fn (`increasing` says which way)."""
    lo, hi = lo.copy(), hi.copy()
    for _ in range(_BISECT_STEPS):
        mid = 0.5 * (lo + hi)
        above = fn(mid) > 0
        go_down = above if increasing else ~above
        hi = np.where(go_down, mid, hi)
        lo = np.where(go_down, lo, mid)
    return 0.5 * (lo + hi)


def kl_lower_bound(p: np.ndarray, p_known: np.ndarray, cap_p: np.ndarray,
                   q: np.ndarray, q_known: np.ndarray, cap_q: np.ndarray) -> np.ndarray:
    """Rows are positions, columns the union of the two reports (padding: known on neither side;
    a column known on neither side is ignored).

    `p`, `q`: probabilities where `*_known`; `cap_*`: per row, the bound on an unknown entry.
    Returns, per row, the smallest KL(p || q) over the union cells plus the rest bucket that is
    consistent with the reports (see the module doc).
    """
    a = p_known & q_known
    b = p_known & ~q_known  # only the reference listed it: q unknown, at most cap_q
    c = ~p_known & q_known  # only the build listed it: p unknown, at most cap_p
    p_b = np.where(b, p, 0.0)
    q_c = np.where(c, q, 0.0)
    tail_p = np.maximum(1.0 - np.where(p_known, p, 0.0).sum(1), TINY)  # mass of tokens p did not list
    tail_q = np.maximum(1.0 - np.where(q_known, q, 0.0).sum(1), TINY)
    cap_p = np.minimum(cap_p, tail_p)[:, None]
    cap_q = np.minimum(cap_q, tail_q)[:, None]

    def q_b(log_rho):  # total q over b at ratio rho: decreasing in rho
        return np.where(b, np.minimum(cap_q, p_b / np.exp(log_rho)[:, None]), 0.0).sum(1)

    def p_c(log_rho):  # total p over c at ratio rho: increasing in rho
        return np.where(c, np.minimum(cap_p, q_c * np.exp(log_rho)[:, None]), 0.0).sum(1)

    n = len(p)
    lo, hi = np.full(n, _LOG_RHO_RANGE[0]), np.full(n, _LOG_RHO_RANGE[1])
    # rho_q: below it the b-cells would need more than the build's tail (its bucket would go negative)
    need_q = (cap_q[:, 0] * b.sum(1)) > tail_q
    log_rho_q = np.where(need_q, _bisect_log(lambda x: q_b(x) - tail_q, lo, hi, increasing=False), lo)
    # rho_p: above it the c-cells would need more than the reference's tail
    need_p = (cap_p[:, 0] * c.sum(1)) > tail_p
    log_rho_p = np.where(need_p, _bisect_log(lambda x: p_c(x) - tail_p, lo, hi, increasing=True), hi)

    def excess(log_rho):  # p_rest - rho * q_rest: decreasing in rho
        return (tail_p - p_c(log_rho)) - np.exp(log_rho) * (tail_q - q_b(log_rho))

    interior = log_rho_q < log_rho_p
    log_rho = _bisect_log(excess, log_rho_q, np.where(interior, log_rho_p, log_rho_q + 1.0), increasing=False)
    log_rho_for_q = np.where(interior, log_rho, log_rho_q)[:, None]
    log_rho_for_p = np.where(interior, log_rho, log_rho_p)[:, None]
    q_fill = np.where(b, np.minimum(cap_q, p_b / np.exp(log_rho_for_q)), np.where(q_known, q, 0.0))
    p_fill = np.where(c, np.minimum(cap_p, q_c * np.exp(log_rho_for_p)), np.where(p_known, p, 0.0))
    cells = a | b | c
    # the bucket holds what each side's unlisted mass did not give to the union's cells
    rest_q = np.maximum(tail_q - np.where(b, q_fill, 0.0).sum(1), 0.0)
    rest_p = np.maximum(tail_p - np.where(c, p_fill, 0.0).sum(1), 0.0)
    kl = np.where(cells, _xlogx_over(np.where(cells, p_fill, 0.0), np.where(cells, q_fill, 1.0)), 0.0).sum(1)
    # A bucket below ROUNDING on both sides is what float rounding leaves of reports that list
    # (nearly) every token; its term would be noise of either sign. Dropping it moves the value by at
    # most ROUNDING (p ln(p/q) >= p - q >= -ROUNDING), so the result is a lower bound up to that.
    noise = (rest_p < ROUNDING) & (rest_q < ROUNDING)
    kl = kl + np.where(noise, 0.0, _xlogx_over(rest_p, rest_q))
    return np.maximum(kl, 0.0)  # rounding of near-identical reports can dip a hair below 0


def _padded(reports: list[TopK]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, probabilities, listed) as [positions, widest report] arrays; padding is unlisted."""
    width = max(len(r.ids) for r in reports)
    ids = np.full((len(reports), width), -1, dtype=np.int64)
    probs = np.zeros((len(reports), width))
    for row, r in enumerate(reports):
        ids[row, :len(r.ids)] = r.ids
        probs[row, :len(r.ids)] = np.exp(r.logprobs)
    return ids, probs, ids >= 0


def union_table(ref: list[TopK], build: list[TopK]) -> tuple[np.ndarray, ...]:
    """The (p, p_known, cap_p, q, q_known, cap_q) arrays over each position's union of the two
    reports: the reference's tokens first, then the build's that the reference did not list."""
    r_ids, r_p, r_listed = _padded(ref)
    b_ids, b_p, b_listed = _padded(build)
    same = (b_ids[:, :, None] == r_ids[:, None, :]) & b_listed[:, :, None]  # [n, build col, ref col]
    q_at_ref = np.einsum("nbr,nb->nr", same, b_p)  # the build's probability of each reference token
    q_known_at_ref = same.any(1)
    build_only = b_listed & ~same.any(2)
    p = np.concatenate([r_p, np.zeros_like(b_p)], 1)
    p_known = np.concatenate([r_listed, np.zeros_like(b_listed)], 1)
    q = np.concatenate([q_at_ref, np.where(build_only, b_p, 0.0)], 1)
    q_known = np.concatenate([q_known_at_ref, build_only], 1)
    cap_p = np.exp(np.array([r.cap_logprob for r in ref]))
    cap_q = np.exp(np.array([b.cap_logprob for b in build]))
    return p, p_known, cap_p, q, q_known, cap_q


def compare_positions(ref: list[TopK], build: list[TopK]) -> PositionStats:
    """Every per-position number of `glmctl eval kld` for aligned reports of the same tokens."""
    if len(ref) != len(build):
        raise ValueError("the two reports cover different positions")
    if not ref:
        empty = np.zeros(0)
        return PositionStats(empty, empty, empty, np.zeros(0, bool), empty, empty)
    kld = kl_lower_bound(*union_table(ref, build))
    ref_lp, build_lp, same, low, high = [], [], [], [], []
    for r, b in zip(ref, build, strict=True):
        if r.actual != b.actual:
            raise ValueError("the two reports score different tokens")
        ref_lp.append(_logprob_of(r, r.actual))
        build_lp.append(_logprob_of(b, b.actual))
        same.append(r.top == b.top)
        listed = b.ids == r.top
        if listed.any():
            value = float(np.exp(b.logprobs[listed][0]))
            low.append(value)
            high.append(value)
        else:
            low.append(0.0)
            high.append(float(np.exp(b.cap_logprob)))
    return PositionStats(kld=kld, ref_logprob=np.array(ref_lp), build_logprob=np.array(build_lp),
                         same_top=np.array(same), p_ref_top_low=np.array(low), p_ref_top_high=np.array(high))


def _logprob_of(report: TopK, token: int) -> float:
    return float(report.logprobs[report.ids == token][0])
