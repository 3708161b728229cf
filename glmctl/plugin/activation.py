"""What `register()` installs, and when.

Each vLLM process logs exactly one line from this module, saying what the plugin did there:
  - inactive (GLMCTL_PLUGIN=off, a platform vLLM serves itself, or a model that is not
    GLM-5.3-Flash): nothing of vLLM's is touched;
  - active: the adapters for GLM-5.3-Flash are installed (listed in the line).

vLLM loads general plugins before it parses the model, so on a platform that needs us the
plugin first installs a single gate around the platform's `check_and_update_config` (the first
place vLLM shows a plugin the model). The gate passes every other model straight through. When
it sees GLM-5.3-Flash it activates the adapters and sets `GLMCTL_PLUGIN_ACTIVE` in the
environment, which the engine and worker processes (spawned later) inherit, so they activate in
`register()` before the model is built.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from glmctl import switches
from glmctl.plugin.policy import (
    PlatformDecision,
    PlatformFacts,
    PluginMode,
    Target,
    decide_platform,
    model_is_glm5_next,
)

# A child of vLLM's logger, so the line is formatted and routed like vLLM's own.
logger = logging.getLogger("vllm.glmctl")

_registered = False
_active_target: Target | None = None
_installed: list[str] = []


def register_once(env: Mapping[str, str] | None = None) -> None:
    """`env`: the switches as `register()` read them (default: this process's environment)."""
    global _registered
    if _registered:
        return
    _registered = True
    try:
        mode = PluginMode(switches.read("GLMCTL_PLUGIN", env))
    except ValueError as exc:
        logger.warning("glmctl plugin: inactive (%s)", exc)
        return
    facts = current_platform_facts()
    decision = decide_platform(mode, facts)
    if decision.act and facts.kind == "cpu":
        from glmctl.plugin.platforms.cpu.env_fixes import serve_pil_image_processors

        serve_pil_image_processors()
    if not decision.act:
        logger.info("glmctl plugin: inactive (%s)", decision.reason)
        return
    # The gate stays installed after activation: vLLM builds further configs later (e.g. the
    # MTP drafter's, inside the worker) and each needs the same GLM-5.3-Flash defaults.
    _install_config_gate(decision)
    if inherited := switches.read("GLMCTL_PLUGIN_ACTIVE", env):
        activate(decision, because=f"inherited GLMCTL_PLUGIN_ACTIVE={inherited}")


def current_platform_facts() -> PlatformFacts:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return PlatformFacts("cpu")
    if current_platform.is_cuda():
        cap = current_platform.get_device_capability()
        return PlatformFacts("cuda", (cap.major, cap.minor) if cap is not None else None)
    return PlatformFacts(str(current_platform.device_name or "unknown"))


def is_active() -> bool:
    return _active_target is not None


def installed_adapters() -> tuple[str, ...]:
    return tuple(_installed)


def _install_config_gate(decision: PlatformDecision) -> None:
    from vllm.platforms import current_platform

    platform_cls = type(current_platform)
    stock = platform_cls.check_and_update_config  # bound to platform_cls

    def check_and_update_config(cls, vllm_config) -> None:
        if not model_is_glm5_next(vllm_config):
            stock(vllm_config)
            _log_inactive_once(vllm_config)
            return
        if not is_active():
            switches.hand_over("GLMCTL_PLUGIN_ACTIVE", "glm5_next")
            activate(decision, because="GLM-5.3-Flash config")
        from glmctl.plugin.config_hooks import update_glm5_next_config

        update_glm5_next_config(vllm_config, stock, _active_target)

    platform_cls.check_and_update_config = classmethod(check_and_update_config)


_logged_inactive = False


def _log_inactive_once(vllm_config) -> None:
    global _logged_inactive
    if _logged_inactive or is_active():
        return
    _logged_inactive = True
    arch = getattr(getattr(vllm_config, "model_config", None), "architecture", None)
    logger.info("glmctl plugin: inactive (model %s needs nothing from glmctl)", arch)


def activate(decision: PlatformDecision, because: str) -> None:
    """Install the GLM-5.3-Flash adapters for `decision.target` (idempotent)."""
    global _active_target
    if _active_target is not None:
        return
    assert decision.target is not None
    from glmctl.plugin import adapters
    from glmctl.plugin.attention import kernel_table

    _installed.extend(adapters.install(decision.target))
    _active_target = decision.target
    kernel_table.use_target(decision.target)
    logger.info(
        "glmctl plugin: active for GLM-5.3-Flash (%s; %s): %s [GLMCTL_PLUGIN=%s]",
        decision.reason,
        because,
        ", ".join(_installed),
        switches.read("GLMCTL_PLUGIN"),
    )
