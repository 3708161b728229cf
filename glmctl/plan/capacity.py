"""`plan_capacity`: per-GPU memory, KV layout and KV capacity for a model on a node with a setup.

The arithmetic vLLM 0.30 does at start-up, in order (`Worker.determine_available_memory`,
`vllm/v1/worker/gpu_worker.py`): the budget is ceil(total GPU memory x gpu_memory_utilization);
weights, the profiling run's peak and non-torch memory, and the CUDA-graph estimate come off it;
what is left is divided into KV blocks (`kv_cache.py`). On vLLM-CPU the KV space is given outright.
"""

from __future__ import annotations

import math

from pydantic import BaseModel

from glmctl.errors import UsageError
from glmctl.kernels.layouts import KV_FORMATS, KV_FP8, KV_FP8_DS_MLA, kv_format
from glmctl.plan.drafter_kv import DrafterKv, capacity_with_drafter, drafter_kv
from glmctl.plan.kv_cache import KvCacheLayout, kv_cache_layout, kv_capacity
from glmctl.plan.model import ModelSpec
from glmctl.plan.node import NodeSpec
from glmctl.plan.reserve import default_capture_sizes, reserves
from glmctl.plan.serving_setup import WEIGHT_GROUPS, ServingSetup
from glmctl.plan.weights import dflash_drafter_bytes, mtp_drafter_bytes, weight_groups

GIB = 1 << 30
DEFAULT_MAX_MODEL_LEN = 262_144  # glmctl's target context; vLLM would use the model's 1M


class MemoryLine(BaseModel):
    section: str  # "weights", "drafter", "reserve", "kv"
    key: str
    label: str
    bytes: int
    basis: str  # a weight format, "vLLM rule", "estimate", "node constant", "result"


class KvPerToken(BaseModel):
    key: str
    label: str
    layers: int
    bytes_per_token: float  # per GPU


class ResolvedSetup(BaseModel):
    tensor_parallel_size: int
    weights: dict[str, str]
    kv_cache_dtype: str  # the value to pass to vLLM's --kv-cache-dtype
    speculative: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    cudagraph_capture_sizes: list[int]
    block_size: int
    session_tokens: int


class CapacityPlan(BaseModel):
    """The answer to "what fits": every number per GPU, bytes unless the name says otherwise."""

    model: str
    model_source: str
    model_defaulted_fields: list[str]
    node: NodeSpec
    setup: ResolvedSetup
    memory: list[MemoryLine]
    budget_bytes: int  # what vLLM may use on each GPU (or the fixed KV space)
    kv_pool_bytes: int  # left for KV blocks (negative when weights and reserves exceed the budget)
    kv_layout: KvCacheLayout
    drafter_kv: DrafterKv | None = None  # DFlash2: where the drafter's K/V pages sit in the pool
    kv_per_token: list[KvPerToken]
    kv_bytes_per_token: float  # effective, incl. per-request KDA state and tail at max_model_len
    num_blocks: int
    blocks_per_request: int
    kv_tokens: int
    max_concurrency: float  # requests of max_model_len the pool holds (vLLM's figure)
    concurrency_at_max_model_len: int  # whole requests, capped at max_num_seqs
    sessions_that_fit: int  # kv_tokens // session_tokens, capped at max_num_seqs (the report's rule)
    fits: bool
    short_by_bytes: int | None
    reason: str | None
    notes: list[str]


def sessions_that_fit(kv_tokens: int, session_tokens: int, slots: int) -> int:
    """The report's rule: KV tokens / session length, rounded down, capped at the configured slots."""
    return min(kv_tokens // session_tokens, slots)


def _default_batched_tokens(node: NodeSpec, max_model_len: int) -> int:
    """vLLM 0.30's defaults for the OpenAI server (`EngineArgs.get_batch_defaults`, CPU worker)."""
    if node.platform == "cpu":
        return max(max_model_len, 2048)
    memory = node.device_memory_bytes
    if memory >= 160 * GIB:
        return 16384
    if memory >= 70 * GIB and "a100" not in (node.gpu_model or "").lower():
        return 8192
    return 2048


def _check(model: ModelSpec, node: NodeSpec, setup: ServingSetup) -> None:
    tp = setup.tensor_parallel_size
    for what, n in (("attention heads", model.num_attention_heads), ("KDA heads", model.linear_num_heads),
                    ("expert intermediate size", model.moe_intermediate_size)):
        if n % tp:
            raise UsageError(f"--tp {tp} does not divide the model's {what} ({n})", hint="use a power of two")
    if tp > node.num_devices:
        raise UsageError(f"--tp {tp} needs {tp} devices; the node has {node.num_devices}")
    if not model.has_indexer:
        raise UsageError(f"{model.name} has no DSA indexer (index_topk is null); glmctl plans GLM-5.3-Flash's layout")
    spec = setup.speculative
    if spec.method == "mtp" and model.num_nextn_predict_layers < 1:
        raise UsageError(f"{model.name} has no MTP layer (num_nextn_predict_layers = 0)",
                         hint="use --speculative none or dflash2:N")


def plan_capacity(model: ModelSpec, node: NodeSpec, setup: ServingSetup) -> CapacityPlan:
    """Plan one GPU of `node` serving `model` with `setup` (all GPUs of a TP group are alike)."""
    _check(model, node, setup)
    tp, spec = setup.tensor_parallel_size, setup.speculative
    num_spec = spec.num_tokens
    mtp_layers = model.num_nextn_predict_layers if spec.method == "mtp" else 0
    cuda = node.platform == "cuda"
    max_model_len = setup.max_model_len or min(DEFAULT_MAX_MODEL_LEN, model.max_position_embeddings)
    max_num_seqs = setup.max_num_seqs or (256 if cuda else 128)
    batched = setup.max_num_batched_tokens or _default_batched_tokens(node, max_model_len)
    prefix_caching = cuda if setup.enable_prefix_caching is None else setup.enable_prefix_caching
    kv_dtype = setup.kv_cache_dtype
    graphs: list[int] = []
    if cuda and not setup.enforce_eager:
        graphs = ([s for s in setup.cudagraph_capture_sizes if s <= batched] if setup.cudagraph_capture_sizes
                  else default_capture_sizes(max_num_seqs, 1 + num_spec, batched, setup.max_cudagraph_capture_size))

    layout = kv_cache_layout(model, tp=tp, kv_cache_dtype=setup.kv_cache_dtype, num_spec=num_spec,
                             mtp_layers=mtp_layers, prefix_caching=prefix_caching,
                             kernel_block_size=setup.kernel_block_size, user_block_size=setup.block_size,
                             glmctl_plugin=setup.glmctl_plugin, platform=node.platform, cpu_amx=node.cpu_amx)
    memory = [MemoryLine(section="weights", key=w.group, label=w.label, bytes=w.bytes, basis=w.format)
              for w in weight_groups(model, tp, setup.weights)]
    notes: list[str] = []
    if spec.method == "mtp":
        memory.append(MemoryLine(section="drafter", key="drafter", label=f"MTP drafter ({mtp_layers} layer)",
                                 bytes=mtp_drafter_bytes(model, tp, setup.weights, mtp_layers),
                                 basis=f"experts {setup.weights.experts}"))
    draft = None
    if spec.method == "dflash2":
        memory.append(MemoryLine(section="drafter", key="drafter", label="DFlash2 drafter",
                                 bytes=dflash_drafter_bytes(spec.drafter, tp), basis="bf16"))
        draft = drafter_kv(layout, spec.drafter, tp, max_model_len)
        notes.append(f"DFlash2 drafter K/V {draft.placement}ed: {draft.reason} (glmctl.plugin.spec_decode.dflash2_layout)")
    if cuda:
        for r in reserves(model, tp=tp, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=batched, num_spec=num_spec, mtp_layers=mtp_layers,
                          capture_sizes=graphs, constants=node.constants,
                          drafter=spec.method != "none", glmctl_plugin=setup.glmctl_plugin):
            memory.append(MemoryLine(section="reserve", key=r.key, label=r.label, bytes=r.bytes, basis=r.basis))
    used = sum(line.bytes for line in memory)
    if node.kv_cache_bytes is not None:
        budget = available = node.kv_cache_bytes
        over = used + available - node.device_memory_bytes
    else:
        budget = math.ceil(node.device_memory_bytes * setup.gpu_memory_utilization)
        available, over = budget - used, 0

    cap = kv_capacity(layout, available, max_model_len) if draft is None else \
        capacity_with_drafter(draft, available, max_model_len)
    block_bytes = layout.bytes_per_block if draft is None else draft.block_bytes
    short = None
    reason = layout.error
    if reason is None and available < cap.needed_bytes:
        short = cap.needed_bytes - available
        reason = (f"does not fit: short by {short / GIB:.2f} GiB per GPU for one request of "
                  f"{max_model_len:,} tokens")
    elif reason is None and over > 0:
        short = over
        reason = (f"does not fit: weights, reserves and the {available / GIB:.2f} GiB KV space exceed "
                  f"{'host' if not cuda else 'GPU'} memory by {over / GIB:.2f} GiB")
    fits = reason is None
    tokens = cap.kv_tokens if fits else 0

    per_req = cap.blocks_per_request * block_bytes
    kv_per_token = [
        KvPerToken(key="mla", label=f"MLA latent ({kv_dtype})", layers=layout.num_mla_layers,
                   bytes_per_token=layout.num_mla_layers * layout.mla_bytes_per_token),
        KvPerToken(key="indexer", label="indexer K cache (fp8, pooled)", layers=layout.num_indexer_layers,
                   bytes_per_token=layout.num_indexer_layers * layout.indexer_page_bytes / layout.block_size),
        KvPerToken(key="per_request", label=f"KDA state + indexer tail, per request / {max_model_len:,}",
                   layers=layout.num_kda_layers,
                   bytes_per_token=(layout.tail_blocks + layout.num_kda_groups * layout.kda_blocks_per_group)
                   * block_bytes / max_model_len),
    ]
    if draft is not None:
        kv_per_token.append(KvPerToken(key="drafter", label=f"DFlash2 drafter K/V ({draft.placement})",
                                       layers=draft.num_layers, bytes_per_token=draft.bytes_per_token))
    slots_in_use = min(max_num_seqs, int(cap.max_concurrency)) if fits else 0
    state = slots_in_use * layout.num_kda_groups * layout.kda_blocks_per_group * block_bytes
    tail = slots_in_use * layout.tail_blocks * block_bytes
    pool = max(available, 0)
    drafter_bytes = 0
    if draft is not None:  # alias: the drafter's own blocks; append: its pages in every block
        drafter_bytes = slots_in_use * (draft.draft_blocks_per_request * block_bytes if draft.placement == "alias"
                                        else cap.blocks_per_request * (block_bytes - layout.bytes_per_block))
    memory += [
        MemoryLine(section="kv", key="kda_state", bytes=state, basis="result",
                   label=f"KDA state, {slots_in_use} slots x "
                         f"{layout.num_kda_groups * layout.kda_blocks_per_group * block_bytes / GIB:.3f} GiB"),
        MemoryLine(section="kv", key="indexer_tail", bytes=tail, basis="result",
                   label=f"indexer tails, {slots_in_use} slots"),
    ]
    if draft is not None:
        memory.append(MemoryLine(section="kv", key="drafter_kv", bytes=drafter_bytes, basis="result",
                                 label=f"DFlash2 drafter K/V ({draft.placement}), {slots_in_use} slots"))
    memory.append(MemoryLine(section="kv", key="kv_tokens", bytes=pool - state - tail - drafter_bytes,
                             basis="result", label="token KV (MLA + indexer)"))
    if model.has_vision:
        notes.append("the checkpoint has a vision tower; its weights and encoder cache are not counted "
                     "(the plan is for text serving)")
    if model.defaulted:
        notes.append(f"{model.source} leaves out {', '.join(model.defaulted)}: transformers' defaults were used")
    if kv_format(kv_dtype).name == KV_FP8_DS_MLA:
        notes.append(f"fp8_ds_mla stores {KV_FORMATS[KV_FP8_DS_MLA].row_bytes} bytes per token (vLLM's DeepSeek "
                     "record with a 64-dim RoPE part this NoPE model does not have); --kv-cache-dtype fp8 stores "
                     f"{KV_FORMATS[KV_FP8].row_bytes}")
    return CapacityPlan(
        model=model.name,
        model_source=model.source,
        model_defaulted_fields=model.defaulted,
        node=node,
        setup=ResolvedSetup(
            tensor_parallel_size=tp, weights={g: str(getattr(setup.weights, g)) for g in WEIGHT_GROUPS},
            kv_cache_dtype=kv_dtype, speculative=str(spec), max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=batched, gpu_memory_utilization=setup.gpu_memory_utilization,
            enable_prefix_caching=prefix_caching, cudagraph_capture_sizes=graphs, block_size=layout.block_size,
            session_tokens=setup.session_tokens,
        ),
        memory=memory,
        budget_bytes=budget,
        kv_pool_bytes=available,
        kv_layout=layout,
        drafter_kv=draft,
        kv_per_token=kv_per_token,
        kv_bytes_per_token=per_req / max_model_len,
        num_blocks=cap.num_blocks if fits else 0,
        blocks_per_request=cap.blocks_per_request,
        kv_tokens=tokens,
        max_concurrency=cap.max_concurrency if fits else 0.0,
        concurrency_at_max_model_len=slots_in_use,
        sessions_that_fit=sessions_that_fit(tokens, setup.session_tokens, max_num_seqs),
        fits=fits,
        short_by_bytes=short,
        reason=reason,
        notes=notes,
    )


def per_slot_gib(layout: KvCacheLayout) -> float:
    """Pool memory one request's KDA state occupies (whole blocks, see kv_cache.py)."""
    return layout.num_kda_groups * layout.kda_blocks_per_group * layout.bytes_per_block / GIB
