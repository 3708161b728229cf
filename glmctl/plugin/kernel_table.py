"""Which kernel implementations the adapters call, per target.

CPU (Target.TORCH): the torch references of `glmctl.kernels` (vectorised, vLLM's layouts).
CUDA (Target.TRITON): the Triton kernels with the same signatures; the kpool cache writes keep
vLLM's own Triton kernels, which run unchanged on sm_8x. Adapters look functions up here once,
at construction, so the hot path has no dispatch logic.
"""

from __future__ import annotations

from types import SimpleNamespace

from glmctl.plugin.policy import Target


def _target() -> Target:
    from glmctl.plugin.activation import active_target

    return active_target() or Target.TORCH


def indexer_kernels(target: Target | None = None) -> SimpleNamespace:
    from glmctl.kernels import indexer_logits_paged as paged
    from glmctl.kernels import indexer_logits_ragged as ragged
    from glmctl.kernels import kpool_cache_write as kw
    from glmctl.kernels import kpool_topk as topk

    target = target or _target()
    table = SimpleNamespace(
        q_quant=kw.indexer_q_quant_ref,
        prefill_write=kw.kpool_prefill_write_ref,
        tail_seed=kw.kpool_tail_seed_ref,
        decode_update=kw.kpool_decode_update_ref,
        gather_keys=ragged.gather_indexer_keys_ref,
        logits_ragged=ragged.indexer_logits_ragged_ref,
        logits_paged=paged.indexer_logits_paged_ref,
        topk=topk.kpool_topk_ref,
    )
    if target is Target.TRITON:
        _use_triton_indexer(table)
    return table


def sparse_mla_kernels(target: Target | None = None) -> SimpleNamespace:
    from glmctl.kernels import mla_cache_write as cw
    from glmctl.kernels import sparse_mla_decode as dec
    from glmctl.kernels import sparse_mla_prefill as pre
    from glmctl.kernels import sparse_slots

    target = target or _target()
    table = SimpleNamespace(
        cache_write=cw.mla_cache_write_ref,
        attention=pre.sparse_mla_prefill_ref,
        rows=sparse_slots.sparse_rows_ref,
        decode=None,  # split-K decode (Triton only): (q, cache, rows, scale, out, lse, plan, ws)
        plan_decode=None,
        decode_workspace=None,
    )
    if target is Target.TRITON:
        table.cache_write = cw.mla_cache_write
        table.attention = _out_allocating(pre.sparse_mla_prefill)
        table.decode = dec.sparse_mla_decode
        table.plan_decode = dec.plan_sparse_mla_decode
        table.decode_workspace = dec.sparse_mla_decode_workspace
    return table


def _out_allocating(kernel):
    """Give a kernel that writes into (out, lse) the references' return-value form."""
    import torch

    def call(q, kv_cache, indices, softmax_scale, out=None, lse=None):
        if out is None:
            out = torch.empty_like(q)
        if lse is None:
            lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        kernel(q, kv_cache, indices, softmax_scale, out, lse)
        return out, lse

    return call


def _use_triton_indexer(table: SimpleNamespace) -> None:
    """Triton indexer kernels where `glmctl.kernels` has them; vLLM's kpool writes otherwise."""
    import importlib

    for attr, module, name in (
        ("logits_ragged", "glmctl.kernels.indexer_logits_ragged", "indexer_logits_ragged"),
        ("logits_paged", "glmctl.kernels.indexer_logits_paged", "indexer_logits_paged"),
        ("topk", "glmctl.kernels.kpool_topk", "kpool_topk"),
    ):
        fn = getattr(importlib.import_module(module), name, None)
        if fn is not None:
            setattr(table, attr, fn)
