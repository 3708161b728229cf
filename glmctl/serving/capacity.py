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

from glmctl.errors import GlmctlError
from glmctl.serving.render import RenderedLaunch

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


def _setup(launch: RenderedLaunch, plan, model, max_model_len: int | None = None):
    prof, args = launch.profile, launch.profile.vllm_args
    spec = plan.Speculative()
    if prof.speculative.method == "mtp":
        spec = plan.Speculative(method="mtp", num_tokens=prof.speculative.tokens)
    elif prof.speculative.method == "dflash2":
        from glmctl.plan.setup import load_drafter

        spec = plan.Speculative(method="dflash2", num_tokens=prof.speculative.tokens,
                                drafter=load_drafter(prof.speculative.drafter.path))
    return plan.ServingSetup(
        tensor_parallel_size=prof.tensor_parallel_size,
        # on vLLM CPU the plugin holds FP8 attention dequantised (no block-FP8 GEMM there)
        weights=plan.WeightFormats.for_checkpoint(
            _checkpoint_quant(prof, model), fp8_attention=model.fp8_attention if prof.platform != "cpu" else ()),
        kv_cache_dtype=prof.kv_cache_dtype,
        speculative=spec,
        max_model_len=max_model_len or prof.max_model_len,
        max_num_seqs=prof.max_num_seqs,
        max_num_batched_tokens=prof.max_num_batched_tokens,
        gpu_memory_utilization=prof.gpu_memory_utilization or 0.92,
        enforce_eager=bool(args.get("enforce-eager", False)),
        max_cudagraph_capture_size=prof.cuda_graph_max_tokens,
        enable_prefix_caching=args.get("enable-prefix-caching"),
        block_size=args.get("block-size") or _plugin_block_size(launch, model),
        session_tokens=max_model_len or prof.max_model_len,
    )


# A profile's `weights` names its checkpoint's format; EXL3 experts are planned at the nominal 4 bits.
_PROFILE_WEIGHTS = {"bf16": "bf16", "fp8": "fp8", "exl3": "exl3:4"}


def _checkpoint_quant(profile, model) -> str:
    """The checkpoint's own format, or the profile's declared one when planning from the preset
    (no checkpoint on the node yet: `glmctl doctor`)."""
    if model.source.startswith("preset"):
        return _PROFILE_WEIGHTS[profile.model.weights]
    return model.checkpoint_quant


def _plugin_block_size(launch: RenderedLaunch, model) -> int | None:
    """On vLLM CPU the plugin picks GLM-5.3-Flash's block size (from CPU_MLA's 16 up to the kpool
    indexer's rule); plan with what it will pick. On CUDA vLLM's own rules apply (planner)."""
    if launch.profile.platform != "cpu":
        return None
    from glmctl.plugin.policy import kpool_block_size

    cpu_mla_block_size = 16
    return kpool_block_size(cpu_mla_block_size, model.index_kpool, model.index_head_dim)


def _node(launch: RenderedLaunch, gpus, plan):
    if launch.profile.platform == "cpu":
        space = launch.env.get("VLLM_CPU_KVCACHE_SPACE")
        return plan.cpu_node(float(space) if space else None)
    if not gpus:
        return None
    used = gpus[: launch.profile.tensor_parallel_size]
    fixed = _size_bytes(launch.profile.vllm_args.get("kv-cache-memory-bytes"))
    return plan.gpu_node(num_gpus=len(used), gpu_memory_gib=min(g.total_gib for g in used),
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


def _longest_single_request(launch: RenderedLaunch, plan, model, node, high: int) -> int:
    """The longest max_model_len for which one request fits (0 if none), by bisection."""
    low, best = 1024, 0
    while low <= high:
        mid = (low + high) // 2 // 1024 * 1024 or 1024
        if plan.plan_capacity(model, node, _setup(launch, plan, model, mid)).fits:
            best, low = mid, mid + 1024
        else:
            high = mid - 1024
    return best


def predict(launch: RenderedLaunch, gpus: list | None = None) -> CapacityVerdict:
    """The planner's prediction for `launch` on this node (or why there is none)."""
    import glmctl.plan as plan

    prof = launch.profile
    node = _node(launch, gpus, plan)
    if node is None:
        return CapacityVerdict(available=False, note="no GPUs visible to plan for")
    try:
        model = plan.load_model_spec(launch.model_dir)
        result = plan.plan_capacity(model, node, _setup(launch, plan, model))
    except GlmctlError as exc:
        return CapacityVerdict(available=False, note=f"the planner cannot plan this checkpoint: {exc.message}")
    slots, length = prof.max_num_seqs, prof.max_model_len
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
    longest = _longest_single_request(launch, plan, model, node, length)
    closest = (f"max_model_len {longest:,} (one session)" if longest else
               "no max_model_len fits: more GPUs, an fp8 KV cache or 4-bit experts")
    short = f", short by {result.short_by_bytes / GIB:.2f} GiB per GPU" if result.short_by_bytes else ""
    note = f"the planner predicts that not even one request of {length:,} tokens fits on {node.name}{short}"
    if result.reason and not result.short_by_bytes:
        note = f"the planner rejects this setup: {result.reason}"
    return CapacityVerdict(True, False, 0, 0, note, closest)
