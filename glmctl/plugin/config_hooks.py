"""Config defaults GLM-5.3-Flash needs on the platforms where the plugin acts.

Runs inside the platform's `check_and_update_config`, around vLLM's own version (`stock`), and
only for GLM-5.3-Flash (see `activation`). Every change is logged by vLLM's config dump and is
the minimum that lets the model run; nothing here applies to other models.
"""

from __future__ import annotations

import logging

from glmctl.kernels.layouts import kpool_block_size
from glmctl.plugin.mhc import mhc
from glmctl.plugin.policy import Target, num_speculative_tokens

logger = logging.getLogger("vllm.glmctl")


def update_glm5_next_config(vllm_config, stock, target: Target | None) -> None:
    if target is None or not mhc.uses_tilelang(target):
        # The model registers tilelang mHC JIT warm-ups whenever warm-ups are on; where the
        # plugin's mHC path runs instead (CPU, sm_8x, no tilelang) they would compile kernels
        # that never run, or fail. The other warm-ups are Triton kernels, compiled on first use.
        vllm_config.kernel_config.enable_jit_warmup = False
    stock(vllm_config)
    if target is Target.TORCH:
        _fix_cpu_cache_config(vllm_config)


def _fix_cpu_cache_config(vllm_config) -> None:
    cache_config = vllm_config.cache_config
    model_config = vllm_config.model_config
    text_config = model_config.hf_text_config

    # vLLM CPU pins block_size=16 for its CPU_MLA decode kernel, which GLM-5.3-Flash never
    # uses (our sparse backend serves its MLA layers); the kpool indexer cache needs a
    # multiple of 32 * index_kpool.
    if getattr(text_config, "index_topk", None):
        wanted = kpool_block_size(cache_config.block_size, getattr(text_config, "index_kpool", None),
                                  getattr(text_config, "index_head_dim", None) or 128,
                                  num_speculative_tokens(vllm_config))
        if wanted != cache_config.block_size:
            cache_config.block_size = wanted

    # On a CPU with AMX tiles vLLM CPU keeps chunked prefill and prefix caching on for MLA models,
    # for its AMX MLA backend (platforms/cpu.py, `amx_mla_or_dsv4_enabled`). GLM-5.3-Flash's MLA
    # layers run on glmctl's sparse backend instead, and prefix caching's "align" mode for the KDA
    # state needs vLLM's Triton mamba kernels, which vLLM CPU does not have. Apply what vLLM CPU
    # does on every other CPU, so that a run (and the planner's prediction) is the same on any host.
    scheduler_config = vllm_config.scheduler_config
    if model_config.use_mla and (cache_config.enable_prefix_caching or scheduler_config.enable_chunked_prefill):
        logger.info("glmctl config: chunked prefill and prefix caching off on vLLM CPU (GLM-5.3-Flash's "
                    "MLA layers run on glmctl's sparse backend, not vLLM's AMX MLA backend)")
        scheduler_config.enable_chunked_prefill = False
        cache_config.enable_prefix_caching = False
        scheduler_config.max_num_batched_tokens = max(model_config.max_model_len,
                                                      scheduler_config.DEFAULT_MAX_NUM_BATCHED_TOKENS)

    # vLLM CPU turns prefix caching off for MLA models *after* the hybrid-model defaults set
    # mamba_block_size for prefix caching, which then fails validation
    # ("--mamba-block-size can only be set with --enable-prefix-caching"). Restore the
    # no-prefix-caching defaults vLLM uses for hybrid models.
    if not cache_config.enable_prefix_caching and not cache_config.user_specified_mamba_block_size:
        cache_config.mamba_cache_mode = "none"
        cache_config.mamba_block_size = model_config.max_model_len
