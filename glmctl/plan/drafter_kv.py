"""A DFlash2 drafter's KV cache in the plan: the pages the plugin places and what they cost.

The drafter's attention layers store K and V of every context token (DFlash projects them from
the target's hidden states), `block_size x 2 x KV heads / tp x head_dim` values per layer and
block, in the KV cache dtype (bf16, or one byte for fp8). Where those pages go is
`glmctl.plugin.spec_decode.dflash2_layout.choose` (the plugin calls the same function inside vLLM):
aliased over the target's MLA pages in a group of their own, or appended to every block. Both
change the capacity vLLM logs; `capacity_with_drafter` is `kv_cache.kv_capacity` with them.
"""

from __future__ import annotations

from pydantic import BaseModel

from glmctl.kernels.layouts import kv_format
from glmctl.plan.kv_cache import KvCacheLayout, KvCapacity, cdiv
from glmctl.plan.serving_setup import DrafterSpec
from glmctl.plugin.spec_decode.dflash2_layout import (
    DraftPlacement,
    PoolShape,
    choose,
    requested_placement,
)


class DrafterKv(BaseModel):
    placement: str  # "alias" | "append"
    reason: str
    num_layers: int
    page_bytes: int  # one draft layer's page (one block of tokens)
    bytes_per_token: float  # all draft layers, per GPU
    block_bytes: int  # one pool block as vLLM allocates it with the drafter
    draft_blocks_per_request: int  # alias: the drafter's own blocks; append: 0
    blocks_per_request: int  # every group, at max_model_len


def draft_page_bytes(drafter: DrafterSpec, tp: int, kv_cache_dtype: str, block_size: int) -> int:
    """One draft layer's page: vLLM's FullAttentionSpec (KV heads split over TP, at least one)."""
    heads = max(drafter.num_key_value_heads // tp, 1)
    element = kv_format(kv_cache_dtype).value_bytes
    return block_size * 2 * heads * drafter.head_dim * element


def pool_shape(layout: KvCacheLayout, max_model_len: int) -> PoolShape:
    return PoolShape(
        block_size=layout.block_size,
        num_mla_slots=layout.num_mla_layers,
        mla_page=layout.mla_page_bytes,
        num_idx_slots=layout.num_indexer_layers,
        idx_page=layout.indexer_page_bytes,
        attention_blocks=layout.attention_blocks(max_model_len),
        other_blocks=layout.tail_blocks + layout.num_kda_groups * layout.kda_blocks_per_group,
    )


def drafter_kv(layout: KvCacheLayout, drafter: DrafterSpec, tp: int, max_model_len: int,
               forced: str | None = None) -> DrafterKv:
    """Where the plugin puts the drafter's KV for this layout, and the pool it makes.

    `forced`: "alias" or "append" (default: `GLMCTL_DFLASH2_KV` as the plugin reads it, else the
    placement with more KV tokens).
    """
    page = draft_page_bytes(drafter, tp, layout.kv_cache_dtype, layout.block_size)
    pages = [page] * drafter.num_hidden_layers
    draft_blocks = cdiv(max_model_len, layout.block_size)
    chosen: DraftPlacement = choose(pool_shape(layout, max_model_len), pages, draft_blocks,
                                    forced=forced if forced is not None else requested_placement())
    return DrafterKv(
        placement=chosen.mode,
        reason=chosen.reason,
        num_layers=drafter.num_hidden_layers,
        page_bytes=page,
        bytes_per_token=drafter.num_hidden_layers * page / layout.block_size,
        block_bytes=chosen.block_bytes,
        draft_blocks_per_request=draft_blocks if chosen.mode == "alias" else 0,
        blocks_per_request=chosen.blocks_per_request,
    )


def capacity_with_drafter(draft: DrafterKv, available_bytes: int, max_model_len: int) -> KvCapacity:
    """`kv_cache.kv_capacity` for the pool with the drafter's pages (same vLLM rules)."""
    num_blocks = max(available_bytes, 0) // draft.block_bytes
    concurrency = num_blocks / draft.blocks_per_request
    return KvCapacity(
        num_blocks=num_blocks,
        blocks_per_request=draft.blocks_per_request,
        max_concurrency=concurrency,
        kv_tokens=int(concurrency * max_model_len),
        needed_bytes=(draft.blocks_per_request + 1) * draft.block_bytes,
    )
