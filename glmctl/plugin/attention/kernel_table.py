"""Which kernel implementations the adapters call, per target.

CPU (Target.TORCH): the torch references of `glmctl.kernels` (vectorised, vLLM's layouts).
CUDA (Target.TRITON): the Triton kernels with the same signatures; the kpool cache writes keep
vLLM's own Triton kernels, which run unchanged on sm_8x. Adapters look functions up here once,
at construction, so the hot path has no dispatch logic.
"""

from __future__ import annotations

from types import SimpleNamespace

from glmctl.plugin.policy import Target

_process_target: Target | None = None

# The indexer's top-k on CUDA, by name (`kpool_topk.NAMED_CONFIGS`; GLMCTL_INDEXER_TOPK):
# "packed", whose decode call reads vLLM's positions and context lengths and writes every row
# itself (the decode step is the paged logits and this one launch), with sparse MLA's rows mapped
# by one Triton launch; or "threshold" / "radix", with the lengths, the padding rows and the rows
# mapping done by torch ops. auto is "threshold", the kernels the GPU lane has passed, until the
# packed path has run there.
def indexer_topk(env=None) -> str:
    from glmctl import switches

    value = switches.read("GLMCTL_INDEXER_TOPK", env)
    return "threshold" if value == "auto" else value


def use_target(target: Target) -> None:
    """The target this process's adapters look their kernels up for (set once, on activation)."""
    global _process_target
    _process_target = target


def _target() -> Target:
    return _process_target or Target.TORCH


def indexer_kernels(target: Target | None = None, topk: str | None = None) -> SimpleNamespace:
    from glmctl.kernels import indexer_logits_paged as paged
    from glmctl.kernels import indexer_logits_ragged as ragged
    from glmctl.kernels import kpool_cache_write as kw
    from glmctl.kernels import kpool_topk as topk_kernels

    target = target or _target()
    table = SimpleNamespace(
        q_quant=kw.indexer_q_quant_ref,
        prefill_write=kw.kpool_prefill_write_ref,
        tail_seed=kw.kpool_tail_seed_ref,
        decode_update=kw.kpool_decode_update_ref,
        gather_keys=ragged.gather_indexer_keys_ref,
        logits_ragged=ragged.indexer_logits_ragged_ref,
        logits_paged=paged.indexer_logits_paged_ref,
        topk=topk_kernels.kpool_topk_ref,
        # (logits, positions, context_pools, out, *, kpool, select_pools, valid_rows)
        topk_decode=topk_kernels.kpool_topk_decode_ref,
        topk_workspace=None,  # Triton radix only: (max_rows, select_pools, num_sms, device)
    )
    if target is Target.TRITON:
        _use_triton_indexer(table, topk or indexer_topk())
    return table


def sparse_mla_kernels(target: Target | None = None) -> SimpleNamespace:
    from glmctl.kernels import mla_cache_write as cw
    from glmctl.kernels import sparse_mla_decode as dec
    from glmctl.kernels import sparse_mla_prefill as pre
    from glmctl.kernels import sparse_slots

    target = target or _target()
    # cache_write(kv_c, slots, cache, kv_scale); attention(q, cache, rows, scale, kv_scale=)
    # -> (out, lse); decode (Triton only, split-K): (q, cache, rows, scale, out, lse, plan, ws,
    # kv_scale=). kv_scale: the fp8 (512-byte) layout's per-tensor scale, else None.
    table = SimpleNamespace(
        cache_write=cw.mla_cache_write_ref,
        attention=pre.sparse_mla_prefill_ref,
        rows=sparse_slots.sparse_rows_ref,
        decode=None,
        plan_decode=None,
        decode_workspace=None,
    )
    if target is Target.TRITON:
        table.cache_write = cw.mla_cache_write
        if indexer_topk() == "packed":
            table.rows = sparse_slots.sparse_rows
        table.attention = _out_allocating(pre.sparse_mla_prefill)
        table.decode = dec.sparse_mla_decode
        table.plan_decode = dec.plan_sparse_mla_decode
        table.decode_workspace = dec.sparse_mla_decode_workspace
    return table


def _out_allocating(kernel):
    """Give a kernel that writes into (out, lse) the references' return-value form."""
    import torch

    def call(q, kv_cache, indices, softmax_scale, out=None, lse=None, *, kv_scale=None):
        if out is None:
            out = torch.empty_like(q)
        if lse is None:
            lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        kernel(q, kv_cache, indices, softmax_scale, out, lse, kv_scale=kv_scale)
        return out, lse

    return call


def _use_triton_indexer(table: SimpleNamespace, topk: str) -> None:
    """CUDA: glmctl's Triton logits and top-k (`topk` names its configuration); vLLM's own
    Triton kpool cache writes (they need nothing newer than sm_80 and keep the cache
    bit-identical to vLLM's GPU path), but for the tail seed and the MTP ring (see
    `_vllm_kpool_writes`)."""
    from functools import partial

    import torch

    from glmctl.kernels.indexer_logits_paged import indexer_logits_paged
    from glmctl.kernels.indexer_logits_ragged import indexer_logits_ragged
    from glmctl.kernels.kpool_topk import (
        NAMED_CONFIGS,
        RADIX,
        kpool_topk,
        kpool_topk_decode,
        kpool_topk_workspace,
    )

    if topk not in NAMED_CONFIGS:
        raise ValueError(f"unknown indexer top-k {topk!r}; one of {sorted(NAMED_CONFIGS)}")
    config = NAMED_CONFIGS[topk]

    def logits_ragged(q_fp8, weights, k_fp8, k_scale, row_starts, row_ends):
        out = torch.empty((q_fp8.shape[0], k_fp8.shape[0]), dtype=torch.float32,
                          device=q_fp8.device)
        return indexer_logits_ragged(q_fp8.contiguous(), weights.contiguous(), k_fp8, k_scale,
                                     row_starts, row_ends, out)

    def logits_paged(q_fp8, weights, kv_cache, block_table, context_lens):
        width = block_table.shape[1] * kv_cache.shape[1]
        out = torch.empty((q_fp8.shape[0] * q_fp8.shape[1], width), dtype=torch.float32,
                          device=q_fp8.device)
        return indexer_logits_paged(q_fp8.contiguous(), weights.contiguous(), kv_cache,
                                    block_table, context_lens.contiguous(), out)

    table.logits_ragged = logits_ragged
    table.logits_paged = logits_paged
    table.topk = partial(kpool_topk, config=config)
    table.topk_decode = partial(kpool_topk_decode, config=config)
    table.topk_workspace = kpool_topk_workspace if config is RADIX else None
    table.prefill_write, table.tail_seed, table.decode_update = _vllm_kpool_writes()


def _vllm_kpool_writes():
    import torch
    from vllm.models.glm5next.nvidia.ops import kpool_compress as ops

    from glmctl.kernels import kpool_cache_write as kw
    from glmctl.kernels.kpool_decode_write import kpool_decode_update

    def prefill_write(kv_cache, k, gate, ape, slot_mapping, kpool):
        n = slot_mapping.shape[0]
        if n < kpool:
            return
        pos = torch.arange(n, device=k.device)
        write = (slot_mapping >= 0) & (pos >= kpool - 1)
        window = (pos - (kpool - 1)).clamp_min(0)[:, None] + torch.arange(kpool, device=k.device)
        ops.kpool_compress_and_write_cache(
            kv_cache, k[window], gate[window], ape, slot_mapping.to(torch.int64), pool_size=kpool,
            head_dim=k.shape[-1], write_mask=write, round_scale=True,
        )

    def tail_seed(tail_cache, k, gate, tail_slots, kpool):
        # vLLM's seed kernel addresses block b at b * 2 * ring * 128 elements: a dense tail
        # cache. vLLM's hybrid allocator pads every page of a model to its largest (the pooled
        # indexer page, 8,448 B, against the tail's 8,192 B), so the tail is a strided view of
        # the shared KV memory and that kernel writes other blocks' memory (on the H200 it
        # corrupted pooled keys of the request being prefilled: wrong pools selected from
        # ~128 tokens on). The reference honours the strides; it runs once per prefill, outside
        # any CUDA graph (the indexer op runs eagerly under capture).
        if tail_cache.stride(0) == 2 * tail_cache.shape[2] * k.shape[-1]:
            ops.kpool_seed_tail_cache(tail_cache, k.contiguous(), gate.contiguous(), tail_slots,
                                      tail_cache.shape[2], k.shape[-1])
        else:
            kw.kpool_tail_seed_ref(tail_cache, k, gate, tail_slots, kpool)

    def decode_update(kv_cache, tail_cache, tail_slots, k, gate, ape, slot_mapping, positions,
                      kpool):
        # positions: vLLM's int64 (ours reads them as they are; vLLM's kernel takes int32)
        if tail_cache.shape[2] != kpool:  # MTP's longer ring: vLLM's kernel assumes one pool
            kpool_decode_update(kv_cache, tail_cache, tail_slots, k, gate, ape, slot_mapping,
                                positions, kpool)
            return
        ops.kpool_decode_update_and_maybe_write_cache_batched(
            kv_cache, tail_cache, tail_slots, k, gate, ape, slot_mapping,
            positions.to(torch.int32), kpool, k.shape[-1], round_scale=True,
        )

    return prefill_write, tail_seed, decode_update
