"""A DFlash2 drafter's KV cache inside GLM-5.3-Flash's KV pool (vLLM 0.30 engine core).

vLLM 0.30 lays GLM-5.3-Flash's pool out by hand (`kv_cache_utils._get_kv_cache_groups_glm5_next`
and `_glm5_next_tensor_layout`: MLA + indexer pages per block, KDA states over the MLA pages,
kpool tails over the indexer pages) and only when every attention layer is MLA. A DFlash
drafter brings plain attention layers (Qwen3 K/V pages), so stock vLLM falls through to its
generic grouping, which cannot pad MLA pages and refuses to start ("Padding is only supported
for non-MLA attention layers"). Here the target's layers keep exactly vLLM's layout and the draft
layers are placed by `glmctl.plugin.spec_decode.dflash2_layout` (`alias`: their own group, pages laid over
the target's MLA pages; `append`: extra pages in every block of the target's attention group).

Four functions of `kv_cache_utils` are wrapped, each doing the stock work on the target's layers
and adding the draft layers: grouping, the pool's bytes per block, the tensors of the config, and
the memory one request needs. Models without such layers pass straight through.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from glmctl.plugin.spec_decode.dflash2_layout import (
    DraftPlacement,
    PoolShape,
    cdiv,
    choose,
    pack_alias,
    requested_placement,
)

logger = logging.getLogger("vllm.glmctl")


def install() -> str:
    from vllm.v1.core import kv_cache_utils as kcu

    if getattr(kcu._get_kv_cache_groups_glm5_next, "_glmctl_dflash2", False):
        return "DFlash2 KV placement"
    stock_groups = kcu._get_kv_cache_groups_glm5_next
    stock_config = kcu.get_kv_cache_config_from_groups
    stock_bpb = kcu._get_kv_cache_bytes_per_block
    stock_usage = kcu._max_memory_usage_bytes_from_groups

    def _get_kv_cache_groups_glm5_next(vllm_config, kv_cache_spec):
        spec = getattr(vllm_config, "speculative_config", None)
        draft = draft_specs(kv_cache_spec) if getattr(spec, "method", None) == "dflash" else {}
        if not draft:
            return stock_groups(vllm_config, kv_cache_spec)
        groups = stock_groups(vllm_config, {k: v for k, v in kv_cache_spec.items() if k not in draft})
        if groups is None:
            return None
        return add_draft_groups(vllm_config, groups, draft)

    def get_kv_cache_config_from_groups(vllm_config, kv_cache_groups, available_memory):
        split = split_draft(kv_cache_groups)
        if split is None:
            return stock_config(vllm_config, kv_cache_groups, available_memory)
        target_groups, draft, mode = split
        bpb_target = stock_bpb(target_groups)
        bpb = bpb_target + (sum(s.page_size_bytes for s in draft.values()) if mode == "append" else 0)
        num_blocks = available_memory // bpb
        # the stock layout for the target's layers at this many blocks, then the draft tensors
        config = stock_config(vllm_config, target_groups, num_blocks * bpb_target)
        num_blocks = config.num_blocks  # vLLM's num_gpu_blocks_override applies inside
        config.kv_cache_tensors = _with_draft_tensors(config.kv_cache_tensors, target_groups, draft, mode,
                                                      num_blocks, bpb)
        config.kv_cache_groups = kv_cache_groups
        return config

    def _get_kv_cache_bytes_per_block(kv_cache_groups):
        split = split_draft(kv_cache_groups)
        if split is None:
            return stock_bpb(kv_cache_groups)
        target_groups, draft, mode = split
        extra = sum(s.page_size_bytes for s in draft.values()) if mode == "append" else 0
        return stock_bpb(target_groups) + extra

    def _max_memory_usage_bytes_from_groups(vllm_config, kv_cache_groups):
        split = split_draft(kv_cache_groups)
        if split is None:
            return stock_usage(vllm_config, kv_cache_groups)
        target_groups, draft, mode = split
        bpb_target = stock_bpb(target_groups)
        target_blocks = stock_usage(vllm_config, target_groups) // bpb_target
        if mode == "append":
            return target_blocks * (bpb_target + sum(s.page_size_bytes for s in draft.values()))
        return (target_blocks + _draft_blocks_per_request(vllm_config, draft)) * bpb_target

    for fn in (_get_kv_cache_groups_glm5_next, get_kv_cache_config_from_groups, _get_kv_cache_bytes_per_block,
               _max_memory_usage_bytes_from_groups):
        fn._glmctl_dflash2 = True
        setattr(kcu, fn.__name__, fn)
    return "DFlash2 KV placement"


def draft_specs(kv_cache_spec: dict) -> dict:
    """The plain attention layers next to GLM-5.3-Flash's MLA/KDA/tail layers: a drafter's."""
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        CrossAttentionSpec,
        EncoderOnlyAttentionSpec,
        KpoolTailSpec,
        MambaSpec,
        MLAAttentionSpec,
    )

    not_draft = (MLAAttentionSpec, MambaSpec, KpoolTailSpec, EncoderOnlyAttentionSpec, CrossAttentionSpec)
    specs = dict(_layer_specs(kv_cache_spec))
    if not any(isinstance(s, MambaSpec) for s in specs.values()):
        return {}
    if not any(type(s) is MLAAttentionSpec for s in specs.values()):
        return {}
    return {name: s for name, s in specs.items() if isinstance(s, AttentionSpec) and not isinstance(s, not_draft)}


def _layer_specs(kv_cache_spec: dict):
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    for name, spec in kv_cache_spec.items():
        if isinstance(spec, UniformTypeKVCacheSpecs):
            yield from spec.kv_cache_specs.items()
        else:
            yield name, spec


def pool_shape(vllm_config, groups) -> PoolShape:
    """The target's pool from vLLM's GLM-5.3-Flash groups (attention, tail, KDA state groups)."""
    from vllm.v1.kv_cache_interface import KpoolTailSpec, MambaSpec, MLAAttentionSpec

    attn = groups[0].kv_cache_spec.kv_cache_specs
    mla = [s for s in attn.values() if type(s) is MLAAttentionSpec and s.tokens_per_state == 1]
    idx = [s for s in attn.values() if type(s) is MLAAttentionSpec and s.tokens_per_state > 1]
    block = mla[0].block_size
    other = 0
    for group in groups[1:]:
        spec = group.kv_cache_spec
        inner = list(getattr(spec, "kv_cache_specs", {None: spec}).values())
        if all(isinstance(s, (MambaSpec, KpoolTailSpec)) for s in inner):
            other += cdiv(spec.max_memory_usage_bytes(vllm_config), spec.page_size_bytes)
    return PoolShape(block_size=block, num_mla_slots=len(mla), mla_page=mla[0].page_size_bytes,
                     num_idx_slots=len(idx), idx_page=idx[0].page_size_bytes if idx else 0,
                     attention_blocks=cdiv(mla[0].max_memory_usage_bytes(vllm_config), mla[0].page_size_bytes),
                     other_blocks=other)


def _draft_blocks_per_request(vllm_config, draft: dict) -> int:
    return max(cdiv(s.max_memory_usage_bytes(vllm_config), s.page_size_bytes) for s in draft.values())


def placement(vllm_config, target_groups, draft: dict) -> DraftPlacement:
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    pool = pool_shape(vllm_config, target_groups)
    sizes = {s.block_size for s in draft.values()}
    if sizes != {pool.block_size}:
        raise ValueError(f"the DFlash2 drafter's KV block size {sorted(sizes)} differs from GLM-5.3-Flash's "
                         f"{pool.block_size}; glmctl places its pages in the target's blocks")
    return choose(pool, [s.page_size_bytes for s in draft.values()], _draft_blocks_per_request(vllm_config, draft),
                  sliding_window=any(isinstance(s, SlidingWindowSpec) for s in draft.values()),
                  forced=requested_placement())


def add_draft_groups(vllm_config, groups: list, draft: dict) -> list:
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, UniformTypeKVCacheSpecs

    chosen = placement(vllm_config, groups, draft)
    logger.info("glmctl plugin: DFlash2 drafter KV %s (%s); pool block %d bytes, %d blocks per request",
                chosen.mode, chosen.reason, chosen.block_bytes, chosen.blocks_per_request)
    if chosen.mode == "alias":
        spec = UniformTypeKVCacheSpecs.from_specs(draft)
        if spec is None:
            raise ValueError("the DFlash2 drafter's layers do not share one KV cache type")
        return [*groups, KVCacheGroupSpec(list(draft), spec)]
    attn = groups[0]
    merged = UniformTypeKVCacheSpecs.from_specs({**attn.kv_cache_spec.kv_cache_specs, **draft})
    if merged is None:
        raise ValueError("the DFlash2 drafter's layers cannot join GLM-5.3-Flash's attention group")
    return [KVCacheGroupSpec([*attn.layer_names, *draft], merged), *groups[1:]]


def split_draft(kv_cache_groups: list):
    """(the target's groups as vLLM built them, {draft layer: spec}, mode), or None without a drafter."""
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, UniformTypeKVCacheSpecs

    if not kv_cache_groups:
        return None
    layers = {}
    for group in kv_cache_groups:
        spec = group.kv_cache_spec
        inner = spec.kv_cache_specs if isinstance(spec, UniformTypeKVCacheSpecs) else {}
        layers.update({name: inner.get(name, spec) for name in group.layer_names})
    draft = draft_specs(layers)
    if not draft:
        return None
    target = []
    mode = "append"
    for group in kv_cache_groups:
        names = [n for n in group.layer_names if n not in draft]
        if not names:
            mode = "alias"
            continue
        if len(names) == len(group.layer_names):
            target.append(group)
            continue
        specs = {n: group.kv_cache_spec.kv_cache_specs[n] for n in names}
        target.append(KVCacheGroupSpec(names, UniformTypeKVCacheSpecs.from_specs(specs)))
    return target, draft, mode


def _with_draft_tensors(tensors: list, target_groups: list, draft: dict, mode: str, num_blocks: int,
                        bpb: int) -> list:
    """The stock tensors resized to the pool with the draft pages, plus one tensor per draft layer."""
    from vllm.v1.kv_cache_interface import KVCacheTensor

    size = num_blocks * bpb
    out = [replace(t, size=size) for t in tensors]
    attn = target_groups[0].kv_cache_spec.kv_cache_specs
    mla_names = [n for n in target_groups[0].layer_names if attn[n].tokens_per_state == 1]
    mla_page = attn[mla_names[0]].page_size_bytes
    pages = [s.page_size_bytes for s in draft.values()]
    if mode == "alias":
        # the MLA page of layer `slot` for block b starts at slot * mla_page * num_blocks + b * mla_page
        pool = PoolShape(block_size=0, num_mla_slots=len(mla_names), mla_page=mla_page, num_idx_slots=0,
                         idx_page=0, attention_blocks=0, other_blocks=0)
        slots = pack_alias(pool, pages)
        assert slots is not None
        for name, page, slot in zip(draft, pages, slots, strict=True):
            out.append(KVCacheTensor(size=size, layers=[name], layer_stride=page * num_blocks,
                                     block_stride=mla_page, offset=slot.slot * mla_page * num_blocks + slot.offset))
        return out
    # append: the draft regions follow the target's MLA and indexer regions
    offset = (bpb - sum(pages)) * num_blocks
    for name, page in zip(draft, pages, strict=True):
        out.append(KVCacheTensor(size=size, layers=[name], layer_stride=page * num_blocks, block_stride=page,
                                 offset=offset))
        offset += page * num_blocks
    assert offset == size
    return out
