"""GLM-5.3-Flash pieces that vLLM 0.30 only runs on sm_90+, given an sm_8x path (CUDA target).

Found by reading vLLM's glm5next model and its imports:
  - sparse MLA (FlashMLA / FlashInfer, sm_90+): our backend (`sparse_mla`), Triton kernels;
  - the kpool indexer's logits (DeepGEMM) and its DeepGEMM-only construction check: our
    indexer (`indexer`), Triton logits / top-k, vLLM's Triton kpool cache writes;
  - the indexer metadata builder asks DeepGEMM for a paged-MQA schedule whenever the DeepGEMM
    package imports, which it does on sm_8x even though its kernels cannot run there;
  - mHC: tilelang when installed, else torch (`mhc`); the tilelang JIT warmup is skipped
    when tilelang is absent (config hook);
  - the MoE router's logits (GLMCTL_ROUTER_GEMM=glmctl): glmctl's GEMV instead of cuBLAS's
    split-K pair (`moe_router`);
  - KDA decode / MTP verify (GLMCTL_KDA_DECODE=glmctl): glmctl's one-launch conv + delta rule +
    gated norm instead of vLLM's three kernels (`kda_layer`);
  - FP8 KV cache: vLLM maps `--kv-cache-dtype fp8` to the 656-byte `fp8_ds_mla` record only
    for FLASHMLA_SPARSE; our backend keeps vLLM's standard 512-byte fp8 row (no RoPE tail,
    one per-tensor scale) and writes it with glmctl's Triton kernel (`fp8_ds_mla` on request).
Triton's fp8e4nv needs sm_89: on sm_8x below that (Ampere), the FP8 query quantisation and the
kpool writes fall back to the torch references.
"""

from __future__ import annotations


def install() -> list[str]:
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.mla import indexer

    # The schedule is only for DeepGEMM's paged-MQA kernel, which we do not call.
    indexer.has_deep_gemm = lambda: False
    installed = ["no DeepGEMM schedule"]
    from glmctl.plugin.platforms.moe_router import router_gemm_kernel

    if router_gemm_kernel(current_platform.is_cuda()) == "glmctl":
        from glmctl.plugin.platforms import moe_router

        installed.append(moe_router.install())
    from glmctl.plugin.platforms.kda_layer import kda_decode_kernel

    if kda_decode_kernel(current_platform.is_cuda()) == "glmctl":
        from glmctl.plugin.platforms import kda_layer

        installed.append(kda_layer.install())
    cap = current_platform.get_device_capability()
    if cap is not None and (cap.major, cap.minor) < (8, 9):
        from vllm.models.glm5next.nvidia import attention

        from glmctl.kernels.kpool_cache_write import indexer_q_quant_ref

        attention.fwht128_quant_fp8 = indexer_q_quant_ref
        installed.append("fp8 q-quant (torch, no fp8e4nv below sm_89)")
    return installed
