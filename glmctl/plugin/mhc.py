"""mHC (hyper-connection) ops with the input norm applied, on every platform the plugin serves.

vLLM CPU's mHC pre ops accept the layer's input-norm weight and silently drop it (tilelang and
the HIP fallback return RMSNorm(layer_input)), so GLM-5.3-Flash's input/post-attention norms are
never applied there: the model runs and computes the wrong thing (O(1) logit errors). On CUDA
vLLM uses tilelang; where tilelang is not installed (it is optional), the torch path with the
norm applied stands in.
"""

from __future__ import annotations


def install() -> str:
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers import mhc
    from vllm.model_executor.layers.mhc import MHCFusedPostPreOp, MHCPreOp, _apply_mhc_norm

    class GlmctlMHCPreOp(MHCPreOp):
        def forward_cpu(self, residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps,
                        hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, n_splits=1,
                        norm_weight=None, norm_eps=0.0):
            post, comb, layer_input = super().forward_cpu(
                residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
                hc_post_mult_value, sinkhorn_repeat, n_splits,
            )
            return post, comb, _apply_mhc_norm(layer_input, norm_weight, norm_eps)

        def forward_cuda(self, *args, norm_weight=None, norm_eps=0.0, **kwargs):
            if mhc.HAS_TILELANG_MHC:
                return super().forward_cuda(*args, norm_weight=norm_weight, norm_eps=norm_eps,
                                            **kwargs)
            post, comb, layer_input = self.forward_native(*args, **kwargs)
            return post, comb, _apply_mhc_norm(layer_input, norm_weight, norm_eps)

    class GlmctlMHCFusedPostPreOp(MHCFusedPostPreOp):
        def forward_cpu(self, x, residual, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base,
                        rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
                        sinkhorn_repeat, n_splits=1, tile_n=1, norm_weight=None, norm_eps=0.0):
            residual_cur, post, comb, layer_input = super().forward_cpu(
                x, residual, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base, rms_eps,
                hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, n_splits,
                tile_n,
            )
            return residual_cur, post, comb, _apply_mhc_norm(layer_input, norm_weight, norm_eps)

        def forward_cuda(self, *args, norm_weight=None, norm_eps=0.0, **kwargs):
            if mhc.HAS_TILELANG_MHC:
                return super().forward_cuda(*args, norm_weight=norm_weight, norm_eps=norm_eps,
                                            **kwargs)
            residual_cur, post, comb, layer_input = self.forward_native(*args, **kwargs)
            return residual_cur, post, comb, _apply_mhc_norm(layer_input, norm_weight, norm_eps)

    for stock, ours in ((MHCPreOp, GlmctlMHCPreOp), (MHCFusedPostPreOp, GlmctlMHCFusedPostPreOp)):
        if stock.__name__ not in op_registry_oot:
            stock.register_oot(ours)
    return "mHC norm fix"
