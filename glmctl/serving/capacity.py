"""The planner's prediction for a profile: does the profile's promise (its slots, each at its
maximum length) fit in the KV cache glmctl predicts for this node, and if not, what does?

The prediction comes from `glmctl.plan`; until that package offers `plan_capacity`, the check
reports itself as unavailable rather than guessing.
"""

from __future__ import annotations

from dataclasses import dataclass

from glmctl.serving.render import RenderedLaunch


@dataclass(frozen=True)
class CapacityVerdict:
    available: bool
    """False when no prediction could be made (the reason is in `note`)."""
    fits: bool = True
    kv_tokens: int | None = None
    """Predicted KV cache, tokens (node total, as vLLM reports it)."""
    sessions_fit: int | None = None
    """Predicted sessions at max_model_len, rounded down and capped at max_num_seqs."""
    note: str = ""
    closest: str | None = None
    """The nearest setting that fits, when the profile does not."""


def predict(launch: RenderedLaunch) -> CapacityVerdict:
    try:
        from glmctl.plan import plan_capacity  # noqa: F401
    except ImportError:
        return CapacityVerdict(available=False, note="the planner (glmctl.plan) is not available yet")
    return CapacityVerdict(available=False, note="the planner's interface is not wired to profiles yet")
