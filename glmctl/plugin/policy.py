"""When the plugin acts: pure decisions over facts about the platform and the model.

No vLLM or torch import here, so the rules are unit-testable anywhere and readable in one place.

The plugin acts in two stages, because vLLM loads general plugins before it knows the model:

1. `decide_platform` runs in `register()`: is this a platform where GLM-5.3-Flash needs us
   (vLLM's CPU platform; CUDA below compute capability 9), or did the user ask for us
   (`GLMCTL_PLUGIN=on`)? If not, the plugin installs nothing at all.
2. `is_glm5_next` runs when vLLM builds its config: only a GLM-5.3-Flash model activates the
   adapters; any other model leaves vLLM exactly as shipped.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from glmctl import switches

GLM5_NEXT_MODEL_TYPES = frozenset({"glm5_next", "glm5_next_text", "glm5_next_mtp"})
GLM5_NEXT_ARCHITECTURES = frozenset(
    {"Glm5NextForCausalLM", "Glm5NextForConditionalGeneration", "Glm5NextMTP"}
)


class PluginMode(enum.StrEnum):
    AUTO = "auto"  # act where vLLM 0.30 cannot run GLM-5.3-Flash: CPU, CUDA < sm_90
    ON = "on"  # act on any CUDA or CPU platform (e.g. our backend on sm_90 for comparison)
    OFF = "off"  # never act

    @classmethod
    def parse(cls, raw: str | None) -> PluginMode:
        """The value of GLMCTL_PLUGIN (None: unset); `switches.SwitchError` names a bad one."""
        return cls(switches.parse("GLMCTL_PLUGIN", raw))


@dataclass(frozen=True)
class PlatformFacts:
    kind: str  # "cpu", "cuda", or another vLLM platform name ("rocm", "xpu", ...)
    capability: tuple[int, int] | None = None  # CUDA compute capability

    @property
    def label(self) -> str:
        if self.kind == "cuda" and self.capability is not None:
            return f"cuda sm_{self.capability[0]}{self.capability[1]}"
        return self.kind


class Target(enum.StrEnum):
    """Which kernels the adapters dispatch to."""

    TORCH = "torch"  # the torch reference implementations (vLLM's CPU platform)
    TRITON = "triton"  # the Triton kernels (CUDA)


@dataclass(frozen=True)
class PlatformDecision:
    act: bool
    reason: str
    target: Target | None = None


def decide_platform(mode: PluginMode, platform: PlatformFacts) -> PlatformDecision:
    if mode is PluginMode.OFF:
        return PlatformDecision(False, "GLMCTL_PLUGIN=off")
    if platform.kind == "cpu":
        return PlatformDecision(True, "vLLM's CPU platform has no GLM-5.3-Flash path", Target.TORCH)
    if platform.kind == "cuda":
        major = platform.capability[0] if platform.capability else None
        if major is not None and major < 9:
            return PlatformDecision(
                True, f"vLLM 0.30 has no sparse-MLA/indexer path below sm_90 ({platform.label})",
                Target.TRITON,
            )
        if mode is PluginMode.ON:
            return PlatformDecision(True, f"GLMCTL_PLUGIN=on ({platform.label})", Target.TRITON)
        return PlatformDecision(
            False, f"{platform.label} is served by vLLM's own kernels (set GLMCTL_PLUGIN=on to use ours)"
        )
    return PlatformDecision(False, f"platform {platform.label} is not supported by glmctl")


def is_glm5_next(model_type: str | None, architectures: list[str] | tuple[str, ...] | None) -> bool:
    """True for GLM-5.3-Flash checkpoints (text-only or multimodal, main model or MTP)."""
    if model_type in GLM5_NEXT_MODEL_TYPES:
        return True
    return any(arch in GLM5_NEXT_ARCHITECTURES for arch in architectures or ())


def model_is_glm5_next(vllm_config) -> bool:
    """True when a vLLM config (read by attribute only) is a GLM-5.3-Flash model's."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None:
        return False
    hf_config = getattr(model_config, "hf_config", None)
    text_config = getattr(model_config, "hf_text_config", hf_config)
    architectures = list(getattr(hf_config, "architectures", None) or ())
    return is_glm5_next(getattr(text_config, "model_type", None), architectures) or is_glm5_next(
        getattr(hf_config, "model_type", None), architectures
    )


def num_speculative_tokens(vllm_config) -> int:
    spec = getattr(vllm_config, "speculative_config", None)
    return int(getattr(spec, "num_speculative_tokens", None) or 0) if spec is not None else 0


class MhcPath(enum.StrEnum):
    """Which implementation runs vLLM's mHC ops (pre, fused post+pre, post, delayed pre, head)."""

    TILELANG = "tilelang"  # vLLM's own CUDA kernels (tilelang JIT)
    TRITON = "triton"  # glmctl's Triton kernels (glmctl.kernels.mhc_pre_post)
    TORCH = "torch"  # vLLM's torch reference functions, with the input norm applied


def decide_mhc_path(raw: str | None, target: Target, capability: tuple[int, int] | None,
                    tilelang_present: bool) -> tuple[MhcPath, str]:
    """The mHC implementation and why. ``raw``: the value of GLMCTL_MHC (auto by default).

    On vLLM's CPU platform the torch path always runs (with the norm vLLM CPU drops). On CUDA,
    ``auto`` keeps vLLM's tilelang kernels on sm_90+ where vLLM ships and tests them, and takes
    glmctl's Triton kernels on sm_8x and wherever tilelang is not importable: vLLM 0.30 calls
    tilelang unconditionally on CUDA, so without it the engine dies in its first forward.
    """
    value = switches.parse("GLMCTL_MHC", raw)
    if target is Target.TORCH:
        return MhcPath.TORCH, "vLLM's CPU platform"
    if value != "auto":
        path = MhcPath(value)
        if path is MhcPath.TILELANG and not tilelang_present:
            raise ValueError("GLMCTL_MHC=tilelang but tilelang is not importable "
                             "(pip install tilelang, or use GLMCTL_MHC=triton)")
        return path, f"GLMCTL_MHC={value}"
    if not tilelang_present:
        return MhcPath.TRITON, "tilelang is not importable"
    if capability is not None and capability[0] < 9:
        return MhcPath.TRITON, f"sm_{capability[0]}{capability[1]}: vLLM tests tilelang mHC on sm_90+"
    return MhcPath.TILELANG, "vLLM's tilelang kernels (sm_90+)"
