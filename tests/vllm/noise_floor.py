"""The vLLM lanes' noise-floor rule, as functions both lanes call (numpy only, no vLLM, no torch).

The floor is transformers' own precision noise on the same checkpoint: per scored prompt token,
spread = |log p in bf16 - log p in fp32| (transformers 5.24 `glm5_next`, the same weights). A
served bf16 model (vLLM with the glmctl plugin) meets the floor against transformers fp32 when
(tests/vllm/test_plugin_serving.py states it for the CPU lane):

  pooled over every prompt:  mean |d| <= 1.5 mean(spread) + 1e-3,  p99 |d| <= 1.5 p99(spread) + 1e-2
  for each prompt:           mean |d| <= 2 mean(spread) + 5e-3,     corr(served, fp32) > 0.99

The per-prompt bounds count for prompts of at least 16 scored tokens; shorter ones count in the
pooled figures only. Over 8 tokens a prompt's mean is one or two tokens' noise on either side:
vLLM CPU, measured on the tiny checkpoint (seed 0), meets every pooled bound and every prompt of
18 or more tokens, but "def hello(world):" (8 tokens) gives mean |d| 0.28 against a 0.04
allowance from transformers' spread on the same 8 tokens, with correlation 0.997.

Two served runs compared with each other (GPU vs the CPU lane's fixture, graphs vs eager) may each
sit one floor away from fp32, so `sides=2` doubles every allowance (the triangle inequality).

Greedy decoding: a step of transformers' fp32 greedy path is *decisive* when its top-1 margin
(log p of the top token minus the runner-up) exceeds p99(spread): bf16 noise cannot flip it. A
served greedy path must follow the reference through every decisive step until the first place
where the paths part, and they may part only at a step that is not decisive (a near-tie).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PER_PROMPT_MIN_TOKENS = 16

# MoE routing near-ties (tests.hf_reference.routing_gap: the k-th chosen expert's fp32 score minus
# the best one left out, the smallest over layers). Two experts whose fp32 routing scores lie
# closer than this may swap under bf16 hidden states (measured on the tiny model: ~0.6% relative
# hidden-state error moves sigmoid scores by up to ~0.0025 each way), and one swapped expert
# moves that token's logprobs by up to ~1 nat. On this random model about a third of positions
# have such a near-tie in some MoE layer; which of them swap depends on bf16 rounding details
# (vLLM's AVX2 and AVX-512 builds differ, and so do a CUDA GEMM's tiles at one batch size and
# another), so those positions are judged only in the pooled figures, and a greedy step at one
# (gap below 2 x ROUTING_TIE) may part two runs.
ROUTING_TIE = 0.006


def routing_near_tie(gap: float | None) -> bool:
    """Whether a greedy step's fp32 routing gap (None: unknown) lets bf16 noise swap an expert
    there: below 2 x ROUTING_TIE, as the hidden state also carries earlier positions' swaps."""
    return gap is not None and gap < 2 * ROUTING_TIE


@dataclass
class FloorCheck:
    passed: bool
    tokens: int
    mean: float  # pooled mean |d| (nats)
    p99: float
    limit_mean: float
    limit_p99: float
    spread_mean: float
    spread_p99: float
    rows: list = field(default_factory=list)  # (prompt, tokens, mean |d|, limit, corr)
    failures: list = field(default_factory=list)

    def summary(self) -> str:
        return (f"mean |d| {self.mean:.4f} (limit {self.limit_mean:.4f}), p99 {self.p99:.3f} "
                f"(limit {self.limit_p99:.3f}) over {self.tokens} tokens; floor: mean {self.spread_mean:.4f}, "
                f"p99 {self.spread_p99:.3f}")

    def as_data(self) -> dict:
        return {"tokens": self.tokens, "mean": self.mean, "p99": self.p99, "limit_mean": self.limit_mean,
                "limit_p99": self.limit_p99, "spread_mean": self.spread_mean, "spread_p99": self.spread_p99,
                "per_prompt": [{"prompt": r[0], "tokens": r[1], "mean": r[2], "limit": r[3], "corr": r[4]}
                               for r in self.rows], "failures": self.failures}


def _arrays(values: dict, names) -> dict[str, np.ndarray]:
    return {n: np.asarray(values[n], dtype=np.float64) for n in names}


def logprob_parity(served: dict, reference: dict, fp32: dict, bf16: dict, sides: int = 1,
                   routing_gaps: dict | None = None) -> FloorCheck:
    """`served` vs `reference` per prompt (arrays of log p of each scored token), against the floor
    of transformers' bf16 vs fp32 on the same tokens. `reference` is usually `fp32` itself.
    With `routing_gaps` (the fp32 reference's per position, as tests/gpu/vllm_lane_reference.py
    records them) each prompt's own bounds (mean, correlation) are taken at the positions whose
    routing is decisive (gap >= ROUTING_TIE), as the CPU lane takes them; the pooled bounds count
    every position."""
    names = [n for n in reference if n in served]
    s, r, f, b = (_arrays(x, names) for x in (served, reference, fp32, bf16))
    rows, failures = [], []
    for n in names:
        if not (len(s[n]) == len(r[n]) == len(f[n]) == len(b[n])):
            failures.append(f"{n}: {len(s[n])} served vs {len(r[n])} reference tokens")
            continue
        d, spread = np.abs(s[n] - r[n]), np.abs(b[n] - f[n])
        limit = sides * (2 * spread.mean() + 5e-3)
        keep = np.ones(len(d), dtype=bool)
        if (routing_gaps is not None and n in routing_gaps and len(routing_gaps[n]) == len(d)
                and len(d) >= PER_PROMPT_MIN_TOKENS):
            keep = np.asarray(routing_gaps[n], dtype=np.float64) >= ROUTING_TIE
            if keep.sum() < len(d) // 2:  # the CPU lane's guard: most positions must count
                failures.append(f"{n}: only {int(keep.sum())} of {len(d)} positions route decisively")
                keep = np.ones(len(d), dtype=bool)
        tokens = int(len(d))
        d = d[keep]
        corr = (float(np.corrcoef(s[n][keep], r[n][keep])[0, 1]) if len(d) > 1 else 1.0)
        rows.append((n, tokens, float(d.mean()), float(limit), corr))
        if tokens < PER_PROMPT_MIN_TOKENS:
            continue
        if d.mean() > limit:
            failures.append(f"{n}: mean |d| {d.mean():.4f} > {limit:.4f}")
        if not corr > 0.99:
            failures.append(f"{n}: correlation {corr:.4f} <= 0.99")
    used = [n for n in names if len(s[n]) == len(r[n]) == len(f[n]) == len(b[n])]
    if not used:
        return FloorCheck(False, 0, float("nan"), float("nan"), 0, 0, 0, 0, rows, failures or ["no prompts"])
    d = np.concatenate([np.abs(s[n] - r[n]) for n in used])
    spread = np.concatenate([np.abs(b[n] - f[n]) for n in used])
    limit_mean = sides * (1.5 * spread.mean() + 1e-3)
    limit_p99 = sides * (1.5 * np.quantile(spread, 0.99) + 1e-2)
    if d.mean() > limit_mean:
        failures.append(f"pooled mean |d| {d.mean():.4f} > {limit_mean:.4f}")
    if np.quantile(d, 0.99) > limit_p99:
        failures.append(f"pooled p99 |d| {np.quantile(d, 0.99):.3f} > {limit_p99:.3f}")
    return FloorCheck(not failures, int(d.size), float(d.mean()), float(np.quantile(d, 0.99)),
                      float(limit_mean), float(limit_p99), float(spread.mean()),
                      float(np.quantile(spread, 0.99)), rows, failures)


def greedy_floor(fp32: dict, bf16: dict) -> float:
    """p99 of transformers' bf16-vs-fp32 prompt-logprob spread: the margin a greedy step must
    exceed to be decisive."""
    names = [n for n in fp32 if n in bf16]
    return float(np.quantile(np.concatenate([np.abs(np.asarray(bf16[n]) - np.asarray(fp32[n]))
                                             for n in names]), 0.99))


@dataclass
class GreedyCheck:
    passed: bool
    decisive_followed: int
    rows: list = field(default_factory=list)  # (prompt, same tokens, decisive among them, parted at, margin)
    failures: list = field(default_factory=list)

    def summary(self) -> str:
        parts = ", ".join(f"{r[0]} {r[1]}" + (f" (parted at a {r[4]:.2f}-nat margin)" if r[3] is not None else "")
                          for r in self.rows)
        return f"greedy: {self.decisive_followed} decisive steps followed; same tokens: {parts}"


def greedy_parity(served: dict, reference: dict, floor: float) -> GreedyCheck:
    """`served[name]`: token ids; `reference[name]`: the fp32 greedy steps as (token, top-1 margin)
    or (token, top-1 margin, routing gap). A step is decisive when its margin exceeds the floor;
    the served path may part only at a step that is not, or whose routing (where the gap is
    known) is itself a near-tie (gap < 2 x ROUTING_TIE: a swapped expert moves log p by ~1 nat)."""
    rows, failures, decisive_total = [], [], 0
    for name, steps in reference.items():
        if name not in served:
            continue
        same = decisive = 0
        parted, margin_at = None, None
        for step, got in zip(steps, served[name], strict=False):
            want, margin = step[0], step[1]
            gap = step[2] if len(step) > 2 else None
            if got != want:
                parted, margin_at = same, margin
                if margin > floor and not routing_near_tie(gap):
                    failures.append(f"{name}: step {same} gives {got}, the reference {want} with a decisive "
                                    f"{margin:.3f}-nat margin (floor {floor:.3f})"
                                    + (f" and routing gap {gap:.4f}" if gap is not None else ""))
                break
            same += 1
            decisive += margin > floor  # followed through a margin bf16 noise cannot flip
        decisive_total += decisive
        rows.append((name, same, decisive, parted, margin_at))
    if decisive_total < 3:
        failures.append(f"only {decisive_total} decisive steps followed: too few to say anything")
    return GreedyCheck(not failures, decisive_total, rows, failures)


# -- two runs of the same greedy request (graphs vs eager, MTP vs plain, one batch vs another) --


@dataclass
class Divergence:
    prompt: str
    step: int | None  # first step where the tokens differ; None: the same tokens throughout
    kind: str  # "same", "near-tie" or "defect"
    steps: int
    max_delta_before: float  # largest |log p| difference of the shared tokens before `step`
    delta_at: float | None = None  # |log p| difference, at `step`, of the first run's token
    tokens: tuple | None = None  # (first run's token, second run's token) at `step`
    reference_top2: tuple | None = None  # ((token, log p), (token, log p)) at the shared prefix
    reference_margin: float | None = None
    reason: str = ""

    def as_data(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


def _logprob_of(step: dict, token: int) -> float | None:
    return next((lp for t, lp in step["top"] if t == token), None)


def classify_divergence(prompt: str, a: list[dict], b: list[dict], floor: float,
                        reference_top2: tuple | None = None, reference_label: str = "the reference",
                        routing_gap: float | None = None) -> Divergence:
    """Two greedy runs of one request, each step {"token": id, "top": [[id, log p], [id, log p]]}
    (vLLM's top-2 logprobs). At the first step where they part, the choice is a *near-tie* when
    the runs' log-probabilities agreed within the floor up to there and either the reference
    (transformers fp32 at the shared prefix; else the first run's own top-2) ranks exactly the two
    chosen tokens first and second with a margin at or below the floor, or the reference's MoE
    routing at that position is itself a near-tie (`routing_gap` below 2 x ROUTING_TIE: bf16
    noise may swap an expert there, and one swapped expert moves log p by up to ~1 nat, so any
    token may come first; the CPU lane's greedy test leaves such steps unjudged likewise).
    Anything else is a *defect*."""
    n = min(len(a), len(b))
    deltas = []
    for i in range(n):
        ta, tb = a[i]["token"], b[i]["token"]
        if ta != tb:
            break
        deltas.append(abs(a[i]["top"][0][1] - b[i]["top"][0][1]) if a[i]["top"] and b[i]["top"] else 0.0)
    else:
        return Divergence(prompt, None, "same", n, max(deltas, default=0.0))
    before = max(deltas, default=0.0)
    lp_b = _logprob_of(b[i], ta)
    delta_at = abs(_logprob_of(a[i], ta) - lp_b) if lp_b is not None and _logprob_of(a[i], ta) is not None else None
    top2 = reference_top2 or tuple(tuple(x) for x in a[i]["top"][:2])
    label = reference_label if reference_top2 else "the first run's own top-2"
    margin = float(top2[0][1] - top2[1][1]) if len(top2) == 2 else float("inf")
    reasons, token_reasons = [], []
    if {top2[0][0], top2[1][0]} != {ta, tb}:
        token_reasons.append(f"{label} ranks {top2[0][0]}, {top2[1][0]} first, not the chosen {ta}, {tb}")
    if margin > floor:
        token_reasons.append(f"{label}'s margin {margin:.3f} nats exceeds the floor {floor:.3f}")
    routing_tie = routing_near_tie(routing_gap)
    if not routing_tie:
        reasons += token_reasons
    if before > floor:
        reasons.append(f"log p already differed by {before:.3f} > {floor:.3f} before step {i}")
    if delta_at is not None and delta_at > floor and not routing_tie:
        reasons.append(f"log p of {ta} differs by {delta_at:.3f} > {floor:.3f} at step {i}")
    if routing_gap is not None and not routing_tie and token_reasons:
        reasons.append(f"the reference's routing there is decisive (gap {routing_gap:.4f} >= "
                       f"{2 * ROUTING_TIE:.3f})")
    kind = "defect" if reasons else "near-tie"
    if reasons:
        why = "; ".join(reasons)
    elif routing_tie:
        why = (f"a routing near-tie: the reference's MoE routing gap there is {routing_gap:.4f} < "
               f"{2 * ROUTING_TIE:.3f} (its top-2 {top2[0][0]}, {top2[1][0]}); log p agreed within "
               f"{before:.2e} before")
    else:
        why = (f"{label} puts {top2[0][0]} and {top2[1][0]} {margin:.3f} nats apart (floor {floor:.3f}); "
               f"log p agreed within {before:.2e} before")
    return Divergence(prompt, i, kind, n, before, delta_at, (ta, tb), top2, margin, why)


# -- a quantised KV cache against the bf16 one (tests/vllm/test_plugin_kv_fp8.py's bounds) --

FP8_KV_MEAN, FP8_KV_MAX, FP8_KV_CORR = 0.15, 3.0, 0.985


@dataclass
class BoundsCheck:
    passed: bool
    tokens: int
    mean: float
    max: float
    corr: float
    failures: list = field(default_factory=list)

    def summary(self) -> str:
        return f"mean |d| {self.mean:.4f}, max {self.max:.3f}, corr {self.corr:.4f} over {self.tokens} tokens"

    def as_data(self) -> dict:
        return {"tokens": self.tokens, "mean": self.mean, "max": self.max, "corr": self.corr,
                "failures": self.failures}


def within_bounds(quantised: dict, baseline: dict, mean: float, max_: float, corr: float) -> BoundsCheck:
    """Pooled over the prompts both have: mean |d| <= mean, max |d| <= max_, correlation >= corr."""
    names = [n for n in baseline if n in quantised and len(quantised[n]) == len(baseline[n])]
    if not names:
        return BoundsCheck(False, 0, float("nan"), float("nan"), float("nan"), ["no common prompts"])
    q = np.concatenate([np.asarray(quantised[n], dtype=np.float64) for n in names])
    b = np.concatenate([np.asarray(baseline[n], dtype=np.float64) for n in names])
    d = np.abs(q - b)
    c = float(np.corrcoef(q, b)[0, 1])
    failures = [f"{what} {got:.4f} {op} {limit}" for what, got, limit, op, bad in (
        ("mean |d|", d.mean(), mean, ">", d.mean() > mean), ("max |d|", d.max(), max_, ">", d.max() > max_),
        ("correlation", c, corr, "<", c < corr)) if bad]
    return BoundsCheck(not failures, int(d.size), float(d.mean()), float(d.max()), c, failures)


def fp8_kv_parity(fp8: dict, bf16_kv: dict) -> BoundsCheck:
    """An FP8 KV cache (fp8 or fp8_ds_mla) against bf16 KV, same engine otherwise: the CPU lane's
    bounds (mean |d| <= 0.15 nats, max <= 3 nats, correlation >= 0.985)."""
    return within_bounds(fp8, bf16_kv, FP8_KV_MEAN, FP8_KV_MAX, FP8_KV_CORR)
