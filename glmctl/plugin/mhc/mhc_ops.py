"""torch.ops.glmctl.mhc_pre / mhc_fused_post_pre / mhc_post: glmctl's Triton mHC kernels as torch
ops, so torch.compile sees opaque calls (shape-only fake implementations) and CUDA graphs
capture the launches. Inputs are flat ([T, n, H] residuals, [T, H] layer outputs); ``outer``
restores the caller's leading shape on the outputs. Imported only where the Triton path runs.
Decode batches take the kernels' partials + finalize pair, or with GLMCTL_MHC_DECODE=fused their
one-launch path (read once, when the ops are registered; auto is the pair until the one-launch
path has passed the GPU lane).
"""

# No `from __future__ import annotations`: torch infers the op schemas from these annotations.
import torch
from torch import Tensor

from glmctl.kernels import mhc_pre_post as k

_lib = None  # the library fragment owning the ops; they live as long as it does
_decode = k.DEFAULT_DECODE  # GLMCTL_MHC_DECODE, set by register()


def mhc_pre(residual: Tensor, fn: Tensor, hc_scale: Tensor, hc_base: Tensor, rms_eps: float,
            hc_pre_eps: float, hc_sinkhorn_eps: float, hc_post_mult_value: float,
            sinkhorn_repeat: int, norm_weight: Tensor | None, norm_eps: float,
            outer: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    post, comb, lin = k.mhc_pre(residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps,
                                hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat,
                                norm_weight, norm_eps, decode=_decode)
    return _unflatten(outer, post, comb, lin)


def mhc_pre_fake(residual: Tensor, fn: Tensor, hc_scale: Tensor, hc_base: Tensor,
                 rms_eps: float, hc_pre_eps: float, hc_sinkhorn_eps: float,
                 hc_post_mult_value: float, sinkhorn_repeat: int, norm_weight: Tensor | None,
                 norm_eps: float, outer: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    return _fake_gates(residual, outer)


def mhc_fused_post_pre(x: Tensor, residual: Tensor, post_layer_mix: Tensor,
                       comb_res_mix: Tensor, fn: Tensor, hc_scale: Tensor, hc_base: Tensor,
                       rms_eps: float, hc_pre_eps: float, hc_sinkhorn_eps: float,
                       hc_post_mult_value: float, sinkhorn_repeat: int,
                       norm_weight: Tensor | None, norm_eps: float,
                       outer: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    cur, post, comb, lin = k.mhc_fused_post_pre(
        x, residual, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base, rms_eps, hc_pre_eps,
        hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, norm_weight, norm_eps,
        decode=_decode)
    return (cur.view(*outer, *cur.shape[1:]), *_unflatten(outer, post, comb, lin))


def mhc_fused_post_pre_fake(x: Tensor, residual: Tensor, post_layer_mix: Tensor,
                            comb_res_mix: Tensor, fn: Tensor, hc_scale: Tensor,
                            hc_base: Tensor, rms_eps: float, hc_pre_eps: float,
                            hc_sinkhorn_eps: float, hc_post_mult_value: float,
                            sinkhorn_repeat: int, norm_weight: Tensor | None, norm_eps: float,
                            outer: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return (residual.new_empty(*outer, *residual.shape[1:]), *_fake_gates(residual, outer))


def mhc_post(x: Tensor, residual: Tensor, post_layer_mix: Tensor, comb_res_mix: Tensor,
             outer: list[int]) -> Tensor:
    cur = k.mhc_post(x, residual, post_layer_mix, comb_res_mix)
    return cur.view(*outer, *cur.shape[1:])


def mhc_post_fake(x: Tensor, residual: Tensor, post_layer_mix: Tensor, comb_res_mix: Tensor,
                  outer: list[int]) -> Tensor:
    return residual.new_empty(*outer, *residual.shape[1:])


def _unflatten(outer, post, comb, lin):
    return (post.view(*outer, *post.shape[1:]), comb.view(*outer, *comb.shape[1:]),
            lin.view(*outer, lin.shape[-1]))


def _fake_gates(residual, outer):
    n, h = residual.shape[-2:]
    return (residual.new_empty(*outer, n, 1, dtype=torch.float32),
            residual.new_empty(*outer, n, n, dtype=torch.float32),
            residual.new_empty(*outer, h))


OPS = (("mhc_pre", mhc_pre, mhc_pre_fake),
       ("mhc_fused_post_pre", mhc_fused_post_pre, mhc_fused_post_pre_fake),
       ("mhc_post", mhc_post, mhc_post_fake))


def register(dispatch_key: str = "CUDA") -> None:
    """Define the ops once per process."""
    global _lib, _decode
    if _lib is not None:
        return
    from glmctl import switches

    value = switches.read("GLMCTL_MHC_DECODE")
    _decode = "split" if value == "auto" else value
    from torch.library import Library
    from vllm.utils.torch_utils import direct_register_custom_op

    lib = Library("glmctl", "FRAGMENT")
    for name, func, fake in OPS:
        direct_register_custom_op(name, func, mutates_args=[], fake_impl=fake, target_lib=lib,
                                  dispatch_key=dispatch_key)
    _lib = lib
