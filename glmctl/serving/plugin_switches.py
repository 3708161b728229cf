"""The plugin switches a profile sets: every vLLM process inherits them from `vllm.env`, and the
plugin reads them in `register()` (the names, values and parsers are `glmctl.switches`')."""

from __future__ import annotations

from glmctl import switches
from glmctl.serving.schema import Profile


def profile_switches(profile: Profile) -> dict[str, str]:
    """The plugin variables this profile needs; defaults are left unset. Each value is one the
    plugin's parser takes (checked here, so a rendered file never holds one it refuses)."""
    env = {}
    if profile.collectives.mode != "vllm":
        env["GLMCTL_COLLECTIVES"] = profile.collectives.mode
    if profile.collectives.int8_prefill_all_reduce:
        env["GLMCTL_COLLECTIVES_INT8"] = "prefill"
    for name, value in env.items():
        switches.parse(name, value)
    return env
