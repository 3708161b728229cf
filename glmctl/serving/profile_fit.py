"""The planner's verdict on a profile: do its slots, each at its maximum length, fit the KV cache
`glmctl.plan` predicts for this node, and if not, what is the closest setting that does?

A profile promises `max_num_seqs` sessions of `max_model_len` tokens, so it fits when the plan
fits one request at all and `sessions_that_fit` (KV tokens / max_model_len, rounded down, capped
at the slots: the report's rule) reaches `max_num_seqs`. The node is the GPUs preflight found
(count = tensor-parallel size, memory of the first), or vLLM CPU's fixed KV space.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from glmctl.errors import GlmctlError
from glmctl.plan.model import ModelSpec
from glmctl.plan.node import NodeSpec, cpu_node, gpu_node
from glmctl.plan.serving_setup import ServingSetup, Speculative, WeightFormats, load_drafter
from glmctl.serving.launch_files import drafter_path
from glmctl.serving.schema import Profile

GIB = 1 << 30


@dataclass(frozen=True)
class CapacityVerdict:
    available: bool
    """False when no prediction could be made (the reason is in `note`)."""
    fits: bool = True
    kv_tokens: int | None = None
    """Predicted KV cache, tokens (the figure vLLM logs as "KV cache size")."""
    sessions_fit: int | None = None
    """Predicted sessions of max_model_len, rounded down and capped at max_num_seqs."""
    note: str = ""
    closest: str | None = None
    """The nearest setting that fits, when the profile does not."""


def profile_setup(profile: Profile, model: ModelSpec, max_model_len: int | None = None) -> ServingSetup:
    """The planner's setup for `profile` serving `model` (`max_model_len`: plan another length).
    ConfigError for a profile that cannot be planned (a DFlash2 drafter that is not named or
    cannot be read)."""
    args = profile.vllm_args
    spec = Speculative()
    if profile.speculative.method == "mtp":
        spec = Speculative(method="mtp", num_tokens=profile.speculative.tokens)
    elif profile.speculative.method == "dflash2":
        spec = Speculative(method="dflash2", num_tokens=profile.speculative.tokens,
                           drafter=load_drafter(drafter_path(profile)))
    return ServingSetup(
        tensor_parallel_size=profile.tensor_parallel_size,
        # on vLLM CPU the plugin holds FP8 attention dequantised (no block-FP8 GEMM there)
        weights=WeightFormats.for_checkpoint(
            model.checkpoint_quant, fp8_attention=model.fp8_attention if profile.platform != "cpu" else ()),
        kv_cache_dtype=profile.kv_cache_dtype,
        speculative=spec,
        max_model_len=max_model_len or profile.max_model_len,
        max_num_seqs=profile.max_num_seqs,
        max_num_batched_tokens=profile.max_num_batched_tokens,
        gpu_memory_utilization=profile.gpu_memory_utilization or 0.92,
        enforce_eager=bool(args.get("enforce-eager", False)),
        max_cudagraph_capture_size=profile.cuda_graph_max_tokens,
        enable_prefix_caching=args.get("enable-prefix-caching"),
        block_size=args.get("block-size") or _plugin_block_size(profile, model),
        session_tokens=max_model_len or profile.max_model_len,
    )


# A profile's `weights` names its checkpoint's format; EXL3 experts are planned at the nominal 4 bits.
_PROFILE_WEIGHTS = {"bf16": "bf16", "fp8": "fp8", "exl3": "exl3:4"}


def planned_model(profile: Profile, preset: ModelSpec) -> ModelSpec:
    """The model `profile` is planned for, from a preset (`glmctl doctor`: no checkpoint on the
    node yet), stored the way the profile says its checkpoint is."""
    return preset.model_copy(update={"checkpoint_quant": _PROFILE_WEIGHTS[profile.model.weights]})


def _plugin_block_size(profile: Profile, model: ModelSpec) -> int | None:
    """On vLLM CPU the plugin picks GLM-5.3-Flash's block size (from CPU_MLA's 16 up to the kpool
    indexer's rule); plan with what it will pick. On CUDA vLLM's own rules apply (planner)."""
    if profile.platform != "cpu":
        return None
    from glmctl.kernels.layouts import kpool_block_size

    cpu_mla_block_size = 16
    return kpool_block_size(cpu_mla_block_size, model.index_kpool, model.index_head_dim)


def profile_node(profile: Profile, gpus: list | None) -> NodeSpec | None:
    """The node `profile` runs on: its first tensor-parallel-size GPUs of `gpus` (the smallest
    memory of them), or vLLM CPU's fixed KV space; None without GPUs for a CUDA profile."""
    if profile.platform == "cpu":
        space = profile.env.get("VLLM_CPU_KVCACHE_SPACE")
        return cpu_node(float(space) if space else None)
    if not gpus:
        return None
    used = gpus[: profile.tensor_parallel_size]
    fixed = _size_bytes(profile.vllm_args.get("kv-cache-memory-bytes"))
    return gpu_node(num_gpus=len(used), gpu_memory_gib=min(g.total_gib for g in used),
                    kv_cache_gib=None if fixed is None else fixed / GIB)


_SIZE = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)")


def _size_bytes(value) -> int | None:
    """vLLM's --kv-cache-memory-bytes (a fixed KV space per GPU; vLLM then skips its memory
    profile): an integer, or vLLM's human-readable form (k/m/g/t decimal, K/M/G/T binary)."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    match = _SIZE.fullmatch(str(value).strip())
    if match is None:
        return None
    number, suffix = match.groups()
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
             "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[suffix]
    return int(float(number) * scale)


def _longest_single_request(profile: Profile, model: ModelSpec, node: NodeSpec, high: int) -> int:
    """The longest max_model_len for which one request fits (0 if none), by bisection."""
    from glmctl.plan.capacity import plan_capacity

    low, best = 1024, 0
    while low <= high:
        mid = (low + high) // 2 // 1024 * 1024 or 1024
        if plan_capacity(model, node, profile_setup(profile, model, mid)).fits:
            best, low = mid, mid + 1024
        else:
            high = mid - 1024
    return best


def predict_for_checkpoint(profile: Profile, checkpoint: Path, gpus: list | None) -> CapacityVerdict:
    """`predict` for the checkpoint `glmctl serve` was given, on `gpus` (preflight's)."""
    from glmctl.plan.model import load_model_spec

    node = profile_node(profile, gpus)
    if node is None:
        return CapacityVerdict(available=False, note="no GPUs visible to plan for")
    try:
        model = load_model_spec(checkpoint)
    except GlmctlError as exc:
        return _cannot_plan(exc)
    return predict(profile, model, node)


def _cannot_plan(exc: GlmctlError) -> CapacityVerdict:
    return CapacityVerdict(available=False, note=f"the planner cannot plan this checkpoint: {exc.message}")


def predict(profile: Profile, model: ModelSpec, node: NodeSpec) -> CapacityVerdict:
    """The planner's prediction for `profile` serving `model` on `node` (or why there is none);
    a profile that cannot be planned raises (`profile_setup`)."""
    from glmctl.plan.capacity import plan_capacity

    setup = profile_setup(profile, model)
    try:
        result = plan_capacity(model, node, setup)
    except GlmctlError as exc:
        return _cannot_plan(exc)
    slots, length = profile.max_num_seqs, profile.max_model_len
    drafter = (f" (with the DFlash2 drafter's K/V {result.drafter_kv.placement}ed)"
               if result.drafter_kv is not None else "")
    if result.fits and result.sessions_that_fit >= slots:
        return CapacityVerdict(True, True, result.kv_tokens, result.sessions_that_fit,
                               note=f"{result.kv_tokens:,} KV tokens predicted{drafter}: {slots} session{'s' * (slots != 1)} "
                                    f"of {length:,} tokens fit on {node.name}")
    if result.fits:
        per_slot = result.kv_tokens // slots // result.setup.block_size * result.setup.block_size
        closest = (f"max_num_seqs {max(result.sessions_that_fit, 1)} at max_model_len {length:,}, or "
                   f"max_model_len {per_slot:,} for all {slots} slots")
        note = (f"the planner predicts {result.kv_tokens:,} KV tokens on {node.name}: "
                f"{result.sessions_that_fit} session(s) of {length:,} tokens, not the profile's {slots}")
        return CapacityVerdict(True, False, result.kv_tokens, result.sessions_that_fit, note, closest)
    longest = _longest_single_request(profile, model, node, length)
    closest = (f"max_model_len {longest:,} (one session)" if longest else
               "no max_model_len fits: more GPUs, an fp8 KV cache or 4-bit experts")
    short = f", short by {result.short_by_bytes / GIB:.2f} GiB per GPU" if result.short_by_bytes else ""
    note = f"the planner predicts that not even one request of {length:,} tokens fits on {node.name}{short}"
    if result.reason and not result.short_by_bytes:
        note = f"the planner rejects this setup: {result.reason}"
    return CapacityVerdict(True, False, 0, 0, note, closest)
