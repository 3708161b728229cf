"""Which kernel implementations the adapters call, per target.

CPU (Target.TORCH): the torch references. CUDA (Target.TRITON): the Triton kernels, same
signatures. The adapters look functions up here once, at construction, so the hot path has no
dispatch logic.
"""

from __future__ import annotations

from types import SimpleNamespace

from glmctl.plugin.policy import Target


def _target() -> Target:
    from glmctl.plugin.activation import active_target

    return active_target() or Target.TORCH


def indexer_kernels() -> SimpleNamespace:
    # TEMPORARY: the torch stand-ins until glmctl.kernels provides the indexer references.
    from glmctl.plugin import _interim_kernels as k

    return SimpleNamespace(
        fwht128_quant_fp8=k.fwht128_quant_fp8,
        kpool_compress_and_write_cache=k.kpool_compress_and_write_cache,
        kpool_seed_tail_cache=k.kpool_seed_tail_cache,
        kpool_decode_update_and_maybe_write_cache_batched=(
            k.kpool_decode_update_and_maybe_write_cache_batched
        ),
        gather_indexer_k_cache=k.gather_indexer_k_cache,
        mqa_logits=k.mqa_logits,
        paged_mqa_logits=k.paged_mqa_logits,
        top_k_rows=k.top_k_rows,
        expand_pools_and_append_tail=k.expand_pools_and_append_tail,
    )


def sparse_mla_kernels() -> SimpleNamespace:
    # TEMPORARY: the torch stand-in until glmctl.kernels provides sparse MLA.
    from glmctl.plugin import _interim_kernels as k

    return SimpleNamespace(sparse_mla_attention=k.sparse_mla_attention,
                           mla_cache_write=k.mla_cache_write)
