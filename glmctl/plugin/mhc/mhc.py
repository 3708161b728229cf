"""vLLM's mHC (hyper-connection) ops on every platform the plugin serves, with the input norm.

Two defects of vLLM 0.30 are covered here:
  - vLLM CPU's mHC pre ops accept the layer's input-norm weight and silently drop it, so
    GLM-5.3-Flash's input/post-attention norms are never applied there (O(1) logit errors):
    the CPU path applies the norm after vLLM's own torch pre block.
  - On CUDA every mHC op (`MHCPreOp`, `MHCFusedPostPreOp`, `MHCPostOp`, `MHCPreDelayedOp`,
    `HCHeadOp`) calls tilelang unconditionally, so where tilelang is missing, or is not
    chosen, the engine dies in its first forward. Each op gets a path without tilelang:
    glmctl's Triton kernels (`glmctl.kernels.mhc_pre_post`) for the three ops GLM-5.3-Flash calls,
    vLLM's torch reference for the delayed pre, vLLM's own Triton kernel for the HC head.

  - vLLM CPU's fused mHC kernels (`hc_pre_fused_cpu`, `hc_post_fused_cpu`) exist only in its
    AVX-512 build (`_C_AVX512`); on other x86 hosts (AVX2) every mHC op takes vLLM's torch path.

Which path runs is `policy.decide_mhc_path` (switch GLMCTL_MHC=auto|tilelang|triton|torch); on the
Triton path GLMCTL_MHC_DECODE=fused|split picks one launch per decode block or the two-launch pair.
glmctl's kernels are registered as torch ops (`torch.ops.glmctl.*`, with shape-only fake
implementations), so torch.compile treats them as opaque calls and CUDA graphs capture them.
"""

from __future__ import annotations

from glmctl import switches
from glmctl.plugin.policy import MhcPath, Target, decide_mhc_path


def install(target: Target) -> str:
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers import mhc as vllm_mhc

    path, why = _decide(target)
    if path is MhcPath.TRITON:
        _register_triton_ops()
        why += f"; decode {switches.read('GLMCTL_MHC_DECODE')}"
    for stock, ours in _op_classes(vllm_mhc, path).items():
        if stock.__name__ not in op_registry_oot:
            stock.register_oot(ours)
    return f"mHC {path} ({why})"


def uses_tilelang(target: Target) -> bool:
    """Whether vLLM's tilelang mHC kernels (and their JIT warm-ups) will run in this process."""
    try:
        return _decide(target)[0] is MhcPath.TILELANG
    except ValueError:
        return False  # install() reports the bad value


def _decide(target: Target) -> tuple[MhcPath, str]:
    capability = None
    tilelang = False
    if target is Target.TRITON:
        from vllm.platforms import current_platform
        from vllm.utils.import_utils import has_tilelang

        cap = current_platform.get_device_capability()
        capability = (cap.major, cap.minor) if cap is not None else None
        tilelang = has_tilelang()
    return decide_mhc_path(switches.read("GLMCTL_MHC"), target, capability, tilelang)


def _op_classes(m, path: MhcPath) -> dict:
    """Subclasses of vLLM's five mHC ops whose CUDA method follows `path`; the CPU method of
    the pre ops applies the norm vLLM CPU drops."""
    tilelang = path is MhcPath.TILELANG
    triton = path is MhcPath.TRITON

    class GlmctlMHCPreOp(m.MHCPreOp):
        def forward_cpu(self, residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps,
                        hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, n_splits=1,
                        norm_weight=None, norm_eps=0.0):
            cpu_op = super().forward_cpu if _cpu_kernels() else self.forward_native
            post, comb, layer_input = cpu_op(
                residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
                hc_post_mult_value, sinkhorn_repeat, n_splits,
            )
            return post, comb, m._apply_mhc_norm(layer_input, norm_weight, norm_eps)

        def forward_cuda(self, residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps,
                         hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, n_splits=1,
                         norm_weight=None, norm_eps=0.0):
            args = (residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
                    hc_post_mult_value, sinkhorn_repeat)
            if tilelang:
                return super().forward_cuda(*args, n_splits, norm_weight, norm_eps)
            if triton:
                return _glmctl_ops().mhc_pre(*_flat(residual), *args[1:], norm_weight, norm_eps,
                                             _outer(residual))
            post, comb, layer_input = self.forward_native(*args, n_splits)
            return post, comb, m._apply_mhc_norm(layer_input, norm_weight, norm_eps)

    class GlmctlMHCFusedPostPreOp(m.MHCFusedPostPreOp):
        def forward_cpu(self, x, residual, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base,
                        rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
                        sinkhorn_repeat, n_splits=1, tile_n=1, norm_weight=None, norm_eps=0.0):
            cpu_op = super().forward_cpu if _cpu_kernels() else self.forward_native
            residual_cur, post, comb, layer_input = cpu_op(
                x, residual, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base, rms_eps,
                hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, n_splits,
                tile_n,
            )
            return residual_cur, post, comb, m._apply_mhc_norm(layer_input, norm_weight, norm_eps)

        def forward_cuda(self, x, residual, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base,
                         rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
                         sinkhorn_repeat, n_splits=1, tile_n=1, norm_weight=None, norm_eps=0.0):
            gates = (fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
                     hc_post_mult_value, sinkhorn_repeat)
            if tilelang:
                return super().forward_cuda(x, residual, post_layer_mix, comb_res_mix, *gates,
                                            n_splits, tile_n, norm_weight, norm_eps)
            if triton:
                return _glmctl_ops().mhc_fused_post_pre(
                    x.reshape(-1, x.shape[-1]), *_flat(residual), post_layer_mix, comb_res_mix,
                    *gates, norm_weight, norm_eps, _outer(residual))
            cur, post, comb, layer_input = self.forward_native(
                x, residual, post_layer_mix, comb_res_mix, *gates, n_splits, tile_n)
            return cur, post, comb, m._apply_mhc_norm(layer_input, norm_weight, norm_eps)

    class GlmctlMHCPostOp(m.MHCPostOp):
        def forward_cpu(self, x, residual, post_layer_mix, comb_res_mix):
            if _cpu_kernels():
                return super().forward_cpu(x, residual, post_layer_mix, comb_res_mix)
            return self.forward_native(x, residual, post_layer_mix, comb_res_mix)

        def forward_cuda(self, x, residual, post_layer_mix, comb_res_mix):
            if tilelang:
                return super().forward_cuda(x, residual, post_layer_mix, comb_res_mix)
            if triton:
                return _glmctl_ops().mhc_post(x.reshape(-1, x.shape[-1]), *_flat(residual),
                                              post_layer_mix, comb_res_mix, _outer(residual))
            return self.forward_native(x, residual, post_layer_mix, comb_res_mix)

    class GlmctlMHCPreDelayedOp(m.MHCPreDelayedOp):
        # Not on GLM-5.3-Flash's path (DeepSeek-V4's seam); vLLM's torch reference applies the
        # post, the collapse and the norm.
        def forward_cuda(self, *args, **kwargs):
            if tilelang:
                return super().forward_cuda(*args, **kwargs)
            return self.forward_native(*args, **kwargs)

    class GlmctlHCHeadOp(m.HCHeadOp):
        def forward_cuda(self, hidden_states, hc_fn, hc_scale, hc_base, rms_norm_eps, hc_eps):
            if tilelang:
                return super().forward_cuda(hidden_states, hc_fn, hc_scale, hc_base,
                                            rms_norm_eps, hc_eps)
            import torch

            hc_mult, hidden_size = hidden_states.shape[-2:]
            flat = hidden_states.reshape(-1, hc_mult, hidden_size)
            out = torch.empty(flat.shape[0], hidden_size, dtype=torch.bfloat16,
                              device=hidden_states.device)
            # vLLM's own Triton HC-head kernel (what its ROCm platform runs without tilelang).
            torch.ops.vllm.hc_head_triton(flat, hc_fn, hc_scale, hc_base, out, hidden_size,
                                          rms_norm_eps, hc_eps, hc_mult)
            return out.view(*hidden_states.shape[:-2], hidden_size)

    return {m.MHCPreOp: GlmctlMHCPreOp, m.MHCFusedPostPreOp: GlmctlMHCFusedPostPreOp,
            m.MHCPostOp: GlmctlMHCPostOp, m.MHCPreDelayedOp: GlmctlMHCPreDelayedOp,
            m.HCHeadOp: GlmctlHCHeadOp}


def _flat(residual):
    """[..., n, H] -> ([T, n, H],): the kernels take a flat token dimension."""
    return (residual.reshape(-1, *residual.shape[-2:]),)


def _outer(residual) -> list[int]:
    return list(residual.shape[:-2])


def _glmctl_ops():
    import torch

    return torch.ops.glmctl


def _register_triton_ops() -> None:
    from glmctl.plugin.mhc import mhc_ops

    mhc_ops.register()


def _cpu_kernels() -> bool:
    """vLLM CPU's fused mHC kernels are in its AVX-512 build only."""
    import torch

    return hasattr(torch.ops._C, "hc_pre_fused_cpu")
