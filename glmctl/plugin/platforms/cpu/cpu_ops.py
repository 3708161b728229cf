"""GLM-5.3-Flash ops that vLLM CPU lacks or gets wrong, wired in by name.

vLLM's GLM-5.3-Flash model imports its GPU ops into module namespaces (`kda`, `attention`,
`mtp`, `layers.mla`) and calls them from there; on the CPU platform we rebind exactly those
names to torch implementations (the maths in `glmctl.kernels`). Nothing else in the model
changes, so its data flow, caches and metadata stay vLLM's own.

  KDA          chunked prefill, recurrent decode and MTP verify, state gather/scatter, the conv
               decode update (vLLM's C++ one needs a bf16-prepacked weight; we keep fp32)
  (mHC: see `glmctl.plugin.mhc.mhc`, installed on every target)
  q/kv norm    the fused Triton q_a/kv_a RMSNorm
  indexer      Hadamard+FP8 query quantisation and three `torch.compile` helpers (eager)
  MTP          the fused Triton embed/hidden norm of the draft layer; draft step and
               verification in `cpu_mtp`
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glmctl.kernels.kda import chunk_kda_varlen, fused_recurrent_kda_varlen
from glmctl.kernels.kda_conv import causal_conv1d_update_ref
from glmctl.plugin.patching import after_init
from glmctl.plugin.platforms.cpu.cpu_mtp import WithoutWarmup


def install() -> list[str]:
    from glmctl.plugin.platforms.cpu import cpu_metadata, cpu_mtp

    _install_kda()
    _install_mla_q_kv_norm()
    _install_indexer_helpers()
    _install_mtp_norm()
    cpu_mtp.install()
    cpu_metadata.install()
    return ["KDA/conv (torch)", "q/kv RMSNorm", "indexer q-quant + metadata", "MTP eh-norm",
            "MTP verify (torch, greedy and sampled)"]


# -- KDA ----------------------------------------------------------------------------------------


def chunk_kda_with_fused_gate(q, k, v, raw_g, beta, A_log, g_bias, scale=None,
                              initial_state=None, output_final_state=False,
                              use_qk_l2norm_in_kernel=False, cu_seqlens=None, safe_gate=False,
                              lower_bound=-5.0, **_unused):
    assert use_qk_l2norm_in_kernel and safe_gate, "GLM-5.3-Flash KDA: l2-normed q/k, safe gate"
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, q.shape[1]])
    if initial_state is None:
        n = cu_seqlens.shape[0] - 1
        initial_state = q.new_zeros((n, q.shape[2], v.shape[-1], q.shape[-1]), dtype=torch.float32)
    out, final = chunk_kda_varlen(q, k, v, raw_g, beta, A_log, g_bias, initial_state,
                                  cu_seqlens, lower_bound, scale)
    return out, (final if output_final_state else None)


def fused_recurrent_kda(q, k, v, g, beta=None, scale=None, initial_state=None,
                        inplace_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=None,
                        ssm_state_indices=None, num_accepted_tokens=None, out=None,
                        sigmoid_beta=False, a_log=None, g_bias=None, compute_gate=False,
                        lower_bound=-5.0, **_unused):
    # vLLM's GLM-5.3-Flash layer always asks for the fused gate and sigmoid-in-kernel form.
    assert compute_gate and sigmoid_beta and use_qk_l2norm_in_kernel and inplace_final_state
    if out is not None and out.shape != v.shape:
        out = None
    result, state = fused_recurrent_kda_varlen(
        q, k, v, g, beta, a_log, g_bias, initial_state, cu_seqlens, ssm_state_indices,
        lower_bound, num_accepted_tokens=num_accepted_tokens, out=out, scale=scale,
    )
    return result, state


def gather_initial_states(state, indices, has_initial_state):
    rows = state[indices.long().clamp_min(0)]
    return torch.where(has_initial_state.view(-1, *([1] * (rows.dim() - 1))), rows,
                       torch.zeros_like(rows))


def scatter_states(state, src, indices):
    state[indices.long()] = src.to(state.dtype)


def _cast_sigmoid(x: torch.Tensor) -> torch.Tensor:
    return x.float().sigmoid()


def _install_kda() -> None:
    from vllm.models.glm5next.nvidia import kda

    kda.chunk_kda_with_fused_gate = chunk_kda_with_fused_gate
    kda.fused_recurrent_kda = fused_recurrent_kda
    kda.gather_initial_states = gather_initial_states
    kda.scatter_states = WithoutWarmup(scatter_states)
    kda.causal_conv1d_update = causal_conv1d_update_ref
    kda._cast_sigmoid = _cast_sigmoid

    # vLLM CPU would repack the fp32 [dim, 1, width] conv weights for its bf16 C++ conv kernel
    # (and fails on fp32); our conv update reads them as stored.
    def keep_conv_layout(layer, *args, **kwargs):
        for conv in (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d):
            conv.skip_weight_relayout = True

    after_init(kda.Glm5NextLinearAttention, "cpu_conv_layout", keep_conv_layout)


# -- MLA q/kv RMSNorm ---------------------------------------------------------------------------


def fused_q_kv_rmsnorm(qr, kv, q_weight, kv_weight, eps):
    """Two RMSNorms with one eps, as vLLM's fused Triton kernel computes them."""
    return _rms_norm(qr, q_weight, eps), _rms_norm(kv, kv_weight, eps)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def _install_mla_q_kv_norm() -> None:
    from vllm.model_executor.layers import mla

    mla.fused_q_kv_rmsnorm = fused_q_kv_rmsnorm


# -- indexer helpers ----------------------------------------------------------------------------


def _indexer_k_norm(x, weight, bias, dim, eps):
    return F.layer_norm(x.float(), (dim,), weight, bias, eps).type_as(x)


def _indexer_weight_scale(weights, q_scale, scale):
    return (weights.unsqueeze(-1) * q_scale * scale).squeeze(-1)


def _pad_indexer_heads(x, pad):
    return torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], dim=1)


def _install_indexer_helpers() -> None:
    from vllm.models.glm5next.nvidia import attention

    from glmctl.plugin.attention.kernel_table import indexer_kernels

    attention.fwht128_quant_fp8 = indexer_kernels().q_quant
    attention._fused_indexer_k_norm = _indexer_k_norm
    attention._fused_indexer_weight_scale = _indexer_weight_scale
    attention._pad_indexer_heads = _pad_indexer_heads

    # The indexer slices its fused wk|weights_proj weight by rows in forward; vLLM CPU would
    # repack that weight for its GEMM kernel and the slice would no longer be rows.
    def keep_row_layout(indexer, *args, **kwargs):
        indexer.wk_weights_proj.skip_weight_relayout = True

    after_init(attention.Indexer, "cpu_wk_layout", keep_row_layout)


# -- MTP ----------------------------------------------------------------------------------------


def fused_eh_norm(positions, inputs_embeds, previous_hidden, enorm_w, hnorm_w, eps):
    """cat([enorm(embeds, zeroed at position 0), hnorm(previous hidden)]) -> [N, 2H]."""
    embeds = torch.where((positions == 0)[:, None], torch.zeros_like(inputs_embeds), inputs_embeds)
    out = torch.cat([_rms_norm(embeds, enorm_w, eps), _rms_norm(previous_hidden, hnorm_w, eps)],
                    dim=-1)
    return out.to(inputs_embeds.dtype)


def _install_mtp_norm() -> None:
    from vllm.models.glm5next.nvidia import mtp

    mtp.fused_eh_norm = fused_eh_norm
