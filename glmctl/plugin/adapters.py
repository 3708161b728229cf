"""Install the GLM-5.3-Flash adapters into vLLM (called once per process by `activation`)."""

from __future__ import annotations

from glmctl.plugin.policy import Target

SPARSE_BACKEND_PATH = "glmctl.plugin.attention.sparse_mla.GlmctlSparseMLABackend"


def install(target: Target) -> list[str]:
    # vLLM's GLM-5.3-Flash package must be imported before its indexer op module (the two
    # import each other; this is the order vLLM itself uses).
    import vllm.models.glm5next  # noqa: F401

    from glmctl.plugin import model_hooks
    from glmctl.plugin.mhc import mhc
    from glmctl.plugin.spec_decode import dflash2, mtp

    installed = [_install_backend_selection(), _register_indexer(), model_hooks.install(),
                 mtp.install(), mhc.install(target), _install_kpool_block_alignment(),
                 *dflash2.install(target)]
    if target is Target.TORCH:
        from glmctl.plugin.platforms.cpu import cpu_ops

        installed += cpu_ops.install()
    else:
        from glmctl.plugin.platforms import cuda_ops

        installed += cuda_ops.install()
    return installed


def _install_backend_selection() -> str:
    """Sparse MLA layers get our backend; every other layer is selected by vLLM as shipped."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    # Also reachable as `--attention-backend CUSTOM`, vLLM's slot for out-of-tree backends.
    if not AttentionBackendEnum.CUSTOM.is_overridden():
        register_backend(AttentionBackendEnum.CUSTOM, SPARSE_BACKEND_PATH)

    platform_cls = type(current_platform)
    if getattr(platform_cls.get_attn_backend_cls, "_glmctl", False):
        return "sparse-MLA backend"
    stock = platform_cls.get_attn_backend_cls

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if attn_selector_config.use_mla and attn_selector_config.use_sparse:
            return SPARSE_BACKEND_PATH
        return stock(selected_backend, attn_selector_config, num_heads)

    get_attn_backend_cls._glmctl = True
    platform_cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    return "sparse-MLA backend"


def _register_indexer() -> str:
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.sparse_attn_indexer_kpool import SparseAttnIndexerKpool

    from glmctl.plugin.attention.indexer import GlmctlKpoolIndexer

    if SparseAttnIndexerKpool.__name__ not in op_registry_oot:
        SparseAttnIndexerKpool.register_oot(GlmctlKpoolIndexer)
    return "kpool indexer"


def _install_kpool_block_alignment() -> str:
    """vLLM's hook for the indexer's block-size multiple (`_get_indexer_block_alignment`, used
    when it sizes hybrid blocks) knows only the 32 * kpool page rule; the kpool tail page must
    also fit the indexer page (`layouts.kpool_indexer_alignment`), else vLLM asserts on small models."""
    from vllm.platforms import current_platform

    from glmctl.kernels.layouts import kpool_indexer_alignment
    from glmctl.plugin.policy import num_speculative_tokens

    platform_cls = type(current_platform)
    stock = platform_cls._get_indexer_block_alignment
    if getattr(stock, "_glmctl", False):
        return "kpool block size"

    def _get_indexer_block_alignment(cls, vllm_config):
        text = vllm_config.model_config.hf_text_config
        kpool = getattr(text, "index_kpool", None)
        if not getattr(text, "index_topk", None) or not kpool or kpool <= 1:
            return stock(vllm_config)
        return kpool_indexer_alignment(kpool, getattr(text, "index_head_dim", None) or 128,
                                       num_speculative_tokens(vllm_config), stock(vllm_config))

    _get_indexer_block_alignment._glmctl = True
    platform_cls._get_indexer_block_alignment = classmethod(_get_indexer_block_alignment)
    return "kpool block size"
