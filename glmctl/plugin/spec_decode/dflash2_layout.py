"""Where a DFlash2 drafter's KV cache lives in GLM-5.3-Flash's KV pool: pure rules, no vLLM or torch.

The planner (`glmctl.plan.drafter_kv`) and the plugin (`glmctl.plugin.spec_decode.dflash2_kv`) both call these,
so `glmctl plan` and vLLM count the same bytes.

GLM-5.3-Flash's pool (vLLM 0.30, `kv_cache_utils._get_kv_cache_groups_glm5_next`): one block is M
MLA pages (`mla_page` bytes each, one per MLA layer) plus M indexer pages; the attention group
(MLA + indexer K) takes `ceil(len / block)` blocks per request, every KDA group takes 1 + drafts
blocks (2 + drafts with prefix caching) whose KDA states sit in the MLA pages, and the kpool tail
group one block whose rings sit in the indexer pages. Any group's block is a whole pool block.

A drafter adds L attention layers of `draft_page` bytes per block (block_size tokens x 2 x KV
heads x head_dim x element bytes). Two placements:

- ``alias``: the draft layers form their own KV-cache group with their own block table; their
  pages are laid over the MLA pages of the pool (first fit, several draft pages per MLA page when
  they fit), exactly as the KDA groups already are. A draft block is a pool block the target is
  not using; the drafter takes `ceil(len / block)` of them per request (fewer under a sliding
  window), and nothing else in the pool changes.
- ``append``: the draft layers join the attention group (the target's block table); every pool
  block grows by the L draft pages. No blocks of its own, but every block pays for the draft
  pages, KDA-state and tail blocks included, which never hold draft K/V.

Which holds more: per request at max_model_len, alias costs `block_bytes x draft_blocks` more,
append costs `draft_bytes x (all blocks of the request)` more. Alias wins when the drafter's K/V
per token is large against the target's (`draft_bytes / block_bytes` above roughly
`attention_blocks / all_blocks`); `choose` picks the placement with more KV tokens, alias on a
tie, and `GLMCTL_DFLASH2_KV=alias|append` forces one.
"""

from __future__ import annotations

from dataclasses import dataclass

from glmctl import switches


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class PoolShape:
    """The target's pool, as vLLM builds it, for one GPU."""

    block_size: int
    num_mla_slots: int
    mla_page: int
    num_idx_slots: int
    idx_page: int
    attention_blocks: int  # per request at max_model_len
    other_blocks: int  # per request: KDA state groups + kpool tail

    @property
    def block_bytes(self) -> int:
        return self.num_mla_slots * self.mla_page + self.num_idx_slots * self.idx_page


@dataclass(frozen=True)
class DraftSlot:
    """One draft layer's page inside a pool block: the MLA page `slot`, `offset` bytes in."""

    slot: int
    offset: int


@dataclass(frozen=True)
class DraftPlacement:
    mode: str  # "alias" | "append"
    slots: tuple[DraftSlot, ...]  # alias only: one per draft layer, in the given order
    block_bytes: int  # one pool block, draft pages included (append) or not (alias)
    blocks_per_request: int  # at max_model_len, every group
    reason: str

    def kv_tokens(self, available_bytes: int, max_model_len: int) -> int:
        """What vLLM logs as the KV cache size for this placement."""
        num_blocks = max(available_bytes, 0) // self.block_bytes
        return int(num_blocks / self.blocks_per_request * max_model_len)


def pack_alias(pool: PoolShape, draft_pages: list[int]) -> tuple[DraftSlot, ...] | None:
    """First-fit decreasing of the draft pages into the MLA pages of one pool block, or None."""
    free = [pool.mla_page] * pool.num_mla_slots
    placed: dict[int, DraftSlot] = {}
    for layer in sorted(range(len(draft_pages)), key=lambda i: -draft_pages[i]):
        page = draft_pages[layer]
        slot = next((s for s, room in enumerate(free) if room >= page), None)
        if slot is None:
            return None
        placed[layer] = DraftSlot(slot=slot, offset=pool.mla_page - free[slot])
        free[slot] -= page
    return tuple(placed[i] for i in range(len(draft_pages)))


def alias_placement(pool: PoolShape, draft_pages: list[int], draft_blocks: int) -> DraftPlacement | None:
    slots = pack_alias(pool, draft_pages)
    if slots is None:
        return None
    return DraftPlacement("alias", slots, pool.block_bytes,
                          pool.attention_blocks + pool.other_blocks + draft_blocks,
                          f"{len(draft_pages)} draft page(s) laid over {len({s.slot for s in slots})} of "
                          f"{pool.num_mla_slots} MLA page(s) of a block; {draft_blocks} draft blocks per request")


def append_placement(pool: PoolShape, draft_pages: list[int]) -> DraftPlacement:
    return DraftPlacement("append", (), pool.block_bytes + sum(draft_pages),
                          pool.attention_blocks + pool.other_blocks,
                          f"{len(draft_pages)} draft page(s) ({sum(draft_pages):,} bytes) added to every block")


def requested_placement() -> str | None:
    value = switches.read("GLMCTL_DFLASH2_KV")
    return None if value == "auto" else value


def choose(pool: PoolShape, draft_pages: list[int], draft_blocks: int, sliding_window: bool = False,
           forced: str | None = None) -> DraftPlacement:
    """The placement the plugin uses (and the planner plans): more KV tokens, alias on a tie.

    `draft_blocks`: blocks the draft group needs per request at max_model_len (vLLM's
    `max_memory_usage_bytes` of its spec / page). A sliding-window drafter can only be aliased
    (its own group frees blocks that leave the window); an append would pin them all.
    """
    alias = alias_placement(pool, draft_pages, draft_blocks)
    append = None if sliding_window else append_placement(pool, draft_pages)
    if forced == "alias" and alias is None:
        raise ValueError(f"GLMCTL_DFLASH2_KV=alias: the draft pages {draft_pages} do not fit the "
                         f"{pool.num_mla_slots} MLA pages of {pool.mla_page} bytes of a block")
    if forced == "append" and append is None:
        raise ValueError("GLMCTL_DFLASH2_KV=append: a sliding-window drafter can only be aliased")
    if forced == "alias" or append is None:
        assert alias is not None, "a sliding-window drafter whose pages do not fit the MLA pages"
        return alias
    if forced == "append" or alias is None:
        return append
    # more tokens <=> fewer bytes per request
    if alias.block_bytes * alias.blocks_per_request <= append.block_bytes * append.blocks_per_request:
        return alias
    return append


def serving_limits(platform: str) -> list[str]:
    """What glmctl's DFlash2 support cannot do on a platform (the serve preflight prints these)."""
    if platform == "cpu":
        return [
            "DFlash2 on vLLM CPU: drafts are always the candidate selector's greedy walk (vLLM's default "
            "on CUDA too); speculative_config.draft_sample_method=probabilistic samples the walk only in "
            "vLLM's V2 GPU runner, which needs Triton. Verification is exact either way",
        ]
    return [
        "DFlash2 on CUDA: vLLM's V2 speculator graphs the 1 + drafts query forward (FULL CUDA graphs, "
        "uniform decode batches); its context K/V projection runs eagerly each step (vLLM's design)",
    ]
