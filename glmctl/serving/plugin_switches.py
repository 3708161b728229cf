"""The environment switches of glmctl's vLLM plugin that a profile sets (one place for the names).

Agreed with the plugin (see /work/notes/serve-plugin-switches.md while both are in flight):
every vLLM process inherits these, and the plugin reads them in `register()`.
"""

from __future__ import annotations

from glmctl.serving.schema import Profile

PLUGIN = "GLMCTL_PLUGIN"  # auto (default) | on | off   (glmctl.plugin.policy.ENV_MODE)
# The plugin's own hand-over to the processes vLLM spawns (glmctl.plugin.policy.ENV_ACTIVE): never
# inherited from whoever starts vLLM, or a server would activate for a model it was not shown.
PLUGIN_ACTIVE = "GLMCTL_PLUGIN_ACTIVE"
COLLECTIVES = "GLMCTL_COLLECTIVES"  # vllm (default) | host-staged
COLLECTIVES_INT8 = "GLMCTL_COLLECTIVES_INT8"  # off (default) | prefill


def switches(profile: Profile) -> dict[str, str]:
    """The plugin variables this profile needs; defaults are left unset."""
    env = {}
    if profile.collectives.mode != "vllm":
        env[COLLECTIVES] = profile.collectives.mode
    if profile.collectives.int8_prefill_all_reduce:
        env[COLLECTIVES_INT8] = "prefill"
    return env
