"""Scaling a rank step that was measured whole (steps per second, no breakdown by kind).

When the stand-in run measured only vLLM's step rate and no profile, nothing says which part of
the step is bound by what, and none is invented here. The prediction takes a stated share of the
whole step as bound by one resource (`WholeStepAssumption`; default: all of it bandwidth-bound,
what bounds a decode step's kernels) and leaves the rest unscaled (launch latency and host work,
taken as equal on both machines). Every such cell also carries:

- the range: the same cell with the share at each end of `range_shares` (default 0 and 1: nothing
  scales .. everything scales), so the reader sees how much the answer rests on the assumption;
- where the report has the cell, the share that would reproduce the report's tok/s with the same
  collectives (an inference from the report, not a measurement; below 0 means the unscaled
  stand-in step plus the collective model's time is already slower than the report's node).
"""

from __future__ import annotations

from glmctl.plan.prediction.node_records import (
    DeviceFigures,
    KindLine,
    WholeStepAssumption,
    bound_ratio,
)

_WHAT = {"bandwidth": "memory bandwidth", "compute_bf16": "bf16 tensor throughput",
         "compute_fp8": "fp8 tensor throughput", "launch": "nothing"}


def whole_step_kinds(step_us: float, a: WholeStepAssumption, stand_in: DeviceFigures,
                     target: DeviceFigures) -> list[KindLine]:
    """The measured step as two lines: the share taken as `a.bound`-bound, and the unscaled rest."""
    r = bound_ratio(stand_in, target, a.bound)
    share = a.scaled_share
    lines = [KindLine(kind=f"whole_step_{a.bound}_bound_assumed", measured_us=step_us * share, bound=a.bound,
                      ratio=round(r, 4), predicted_us=step_us * share * r)]
    if share < 1.0:
        lines.append(KindLine(kind="whole_step_unscaled_assumed", measured_us=step_us * (1.0 - share),
                              bound="launch", ratio=1.0, predicted_us=step_us * (1.0 - share)))
    return lines


def tok_s_at(share: float, step_us: float, ratio: float, collectives_us: float, sessions: int,
             tokens_per_step: float) -> float:
    """Tokens per second when `share` of the measured step scales by `ratio` and the rest does not."""
    step = step_us * (share * ratio + 1.0 - share) + collectives_us
    return sessions * tokens_per_step / (step * 1e-6)


def share_for(report_tok_s: float, step_us: float, ratio: float, collectives_us: float, sessions: int,
              tokens_per_step: float) -> float | None:
    """The scaled share at which the prediction equals `report_tok_s` (None when ratio is 1)."""
    if abs(ratio - 1.0) < 1e-9:
        return None
    node_step_us = sessions * tokens_per_step / report_tok_s * 1e6
    return ((node_step_us - collectives_us) / step_us - 1.0) / (ratio - 1.0)


def describe(a: WholeStepAssumption, stand_in: DeviceFigures, target: DeviceFigures) -> str:
    r = bound_ratio(stand_in, target, a.bound)
    lo, hi = a.range_shares
    return (f"its step measured whole (no breakdown): {a.scaled_share:.0%} of it taken as {a.bound}-bound "
            f"(assumed; x{r:.2f}, {stand_in.name}'s {_WHAT[a.bound]} over {target.name}'s), the rest unscaled; "
            f"range {lo:.0%}..{hi:.0%} of the step scaled")
