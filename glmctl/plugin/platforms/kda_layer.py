"""GLM-5.3-Flash's KDA decode and MTP-verify steps on glmctl's one-launch kernel (CUDA;
GLMCTL_KDA_DECODE=glmctl).

vLLM 0.30's `Glm5NextLinearAttention` runs a decode step's KDA as `causal_conv1d_update`,
`fused_recurrent_kda` and, back in `forward`, the o-norm (`FusedRMSNormGated`, sigmoid gate): three
kernels per layer, 34 layers. `glmctl.kernels.kda_decode` does all three in one launch. The layer's
`forward` is replaced by one that hands the o-norm's gate to `_forward`, and `_forward` by one that
always returns the normed output: on a step with no prefill (pure MTP verification, or pure plain
decode) it runs glmctl's kernel; on any other step it runs vLLM's own `_forward` and then the o-norm
in place. The decision is taken inside `_forward`, which vLLM's breakable CUDA graphs replay
eagerly, so a graph captured on one kind of step stays right on another. Each layer owns its
arrival counters (a non-persistent buffer, one per sequence and head).
"""

from __future__ import annotations

from glmctl import switches

COUNTERS = "glmctl_kda_counters"


def kda_decode_kernel(is_cuda: bool, env=None) -> str:
    """"glmctl" or "vllm". auto is vLLM's until glmctl's kernel has passed the GPU lane."""
    return "glmctl" if is_cuda and switches.read("GLMCTL_KDA_DECODE", env) == "glmctl" else "vllm"


def merged_conv_weight(layer):
    """The q|k|v conv weights as one [3 * H * D, width] fp32 tensor (vLLM's layer builds and keeps
    the same tensor under the same name on its first step)."""
    import torch

    if getattr(layer, "_merged_conv_weight", None) is None:
        parts = [m.weight.reshape(m.weight.shape[0], -1) for m in (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d)]
        layer._merged_conv_weight = torch.cat(parts, dim=0).contiguous()
    return layer._merged_conv_weight


def decode_call(layer, meta, qkv, g1, beta, core_attn_out, norm_gate) -> dict | None:
    """Keyword arguments of `kda_decode` for this step, or None where glmctl's kernel does not
    apply (a step with prefill tokens, a layer or cache it was not built for)."""
    from glmctl.kernels.kda_decode import MAX_TOKENS

    if meta is None or meta.num_prefills > 0:
        return None
    spec = meta.spec_sequence_masks is not None and meta.num_spec_decodes > 0
    if spec:
        if meta.num_decodes > 0 or meta.spec_state_indices_tensor.shape[1] > MAX_TOKENS:
            return None
        seqs = meta.num_spec_decodes
        cu = meta.spec_query_start_loc[: seqs + 1]
        indices, accepted = meta.spec_state_indices_tensor, meta.num_accepted_tokens
    elif meta.num_decodes > 0:
        seqs = meta.num_decodes
        cu = meta.non_spec_query_start_loc[: seqs + 1]
        indices, accepted = meta.non_spec_state_indices_tensor, None
    else:
        return None
    conv_state, state = layer.kv_cache
    if not layer._conv_state_dim_first:
        conv_state = conv_state.transpose(-1, -2)
    heads, dim = layer.local_num_heads, layer.head_dim
    counters = getattr(layer, COUNTERS, None)
    norm = layer.o_norm
    if (not getattr(layer, "kda_safe_gate", False) or layer.kda_lower_bound is None
            or layer.q_conv1d.bias is not None or dim & (dim - 1)
            or counters is None or counters.numel() < seqs * heads or conv_state.dtype != qkv.dtype
            or norm.activation != "sigmoid" or norm.weight is None or getattr(norm, "bias", None) is not None):
        return None
    tokens = meta.num_actual_tokens
    return dict(
        qkv=qkv[:tokens], conv_state=conv_state, conv_weight=merged_conv_weight(layer),
        raw_g=g1[0, :tokens].reshape(tokens, heads * dim), raw_beta=beta[0, :tokens],
        a_log=layer.A_log, g_bias=layer.dt_bias, state=state, cu_seqlens=cu, state_indices=indices,
        lower_bound=layer.kda_lower_bound, num_accepted_tokens=accepted, out=core_attn_out[0],
        norm_gate=norm_gate, norm_weight=norm.weight, norm_eps=norm.eps, counters=counters,
    )


def forward_normed(layer, meta, stock_forward, qkv, g1, beta, core_attn_out, norm_gate) -> None:
    """`_forward` with the o-norm folded in: `core_attn_out` ends up normed either way."""
    call = decode_call(layer, meta, qkv, g1, beta, core_attn_out, norm_gate)
    if call is not None:
        from glmctl.kernels.kda_decode import kda_decode

        kda_decode(**call)
        return
    stock_forward(layer, qkv_proj_states=qkv, g1=g1, beta=beta, core_attn_out=core_attn_out)
    normed = layer.o_norm(core_attn_out, norm_gate)
    if normed.data_ptr() != core_attn_out.data_ptr():
        core_attn_out.copy_(normed)


def layer_forward(layer, hidden_states):
    """The layer's forward as vLLM 0.30 computes it, with the o-norm inside `_forward`."""
    import torch

    tokens = hidden_states.shape[0]
    heads, dim = layer.local_num_heads, layer.head_dim
    projected = layer.in_proj_qkvbfg_a(hidden_states)[0]
    qkv, beta, f_a, g_a = projected.split([3 * layer.local_projection_size, heads, dim, dim], dim=-1)
    g1 = layer.f_b_proj(f_a)[0].reshape(1, tokens, heads, dim)
    norm_gate = layer.g_b_proj(g_a)[0].reshape(tokens, heads, dim)
    core_attn_out = torch.empty((1, tokens, heads, dim), dtype=hidden_states.dtype, device=hidden_states.device)
    layer._forward(qkv_proj_states=qkv, g1=g1, beta=beta.unsqueeze(0), core_attn_out=core_attn_out,
                   norm_gate=norm_gate)
    return layer.o_proj(core_attn_out.reshape(tokens, heads * dim))[0]


def install() -> str:
    """Patch `Glm5NextLinearAttention` (idempotent): counters after `__init__`, `forward` and
    `_forward` as above."""
    import torch
    from vllm.compilation.breakable_cudagraph import eager_break_during_capture
    from vllm.forward_context import get_forward_context
    from vllm.models.glm5next.nvidia.kda import Glm5NextLinearAttention

    from glmctl.kernels.kda_decode import new_counters
    from glmctl.plugin.patching import after_init, wrap_once

    def add_counters(layer, config, vllm_config, *args, **kwargs):
        seqs = vllm_config.scheduler_config.max_num_seqs
        layer.register_buffer(COUNTERS, new_counters(seqs, layer.local_num_heads, layer.dt_bias.device),
                              persistent=False)

    def make_forward(_stock):
        def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return layer_forward(self, hidden_states)

        return forward

    def make_inner(stock):
        stock_forward = getattr(stock, "__wrapped__", stock)  # without vLLM's eager-break wrapper

        @eager_break_during_capture
        def _forward(self, qkv_proj_states, g1, beta, core_attn_out, norm_gate):
            metadata = get_forward_context().attn_metadata
            meta = metadata.get(self.prefix) if isinstance(metadata, dict) else None
            forward_normed(self, meta, stock_forward, qkv_proj_states, g1, beta, core_attn_out, norm_gate)

        return _forward

    after_init(Glm5NextLinearAttention, "kda_decode", add_counters)
    wrap_once(Glm5NextLinearAttention, "_forward", make_inner, "kda_decode")
    wrap_once(Glm5NextLinearAttention, "forward", make_forward, "kda_decode")
    return "KDA decode (glmctl one-launch kernel)"
