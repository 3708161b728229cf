"""The KDA decode hook (`glmctl.plugin.platforms.kda_layer`) on CPU: when it is chosen, which steps glmctl's
kernel takes (pure MTP verification and pure plain decode; never a step with prefill tokens, more
draft tokens than the kernel unrolls, or a layer without counters), the normed output on both paths
(glmctl's kernel in the Triton interpreter against the torch reference; vLLM's `_forward` then the
o-norm in place), the layer's forward on a stand-in layer, and the patch on vLLM's real class."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from tests.unit.interpreted_kernels import interpreted_kernels  # noqa: E402

_modules, interpreted, test_in_fresh_process, _interpreter = interpreted_kernels(
    __file__, "glmctl.kernels.kda_decode")

from glmctl.kernels.kda_decode import gated_rms_norm_ref, kda_decode_ref, new_counters  # noqa: E402

from glmctl.plugin.platforms import kda_layer as hook  # noqa: E402

H, D, W, SPEC = 2, 16, 4, 3


def test_when_glmctl_runs_the_decode_step():
    assert hook.kda_decode_kernel(True, {}) == "vllm"  # auto
    assert hook.kda_decode_kernel(True, {"GLMCTL_KDA_DECODE": "glmctl"}) == "glmctl"
    assert hook.kda_decode_kernel(False, {"GLMCTL_KDA_DECODE": "glmctl"}) == "vllm"


class Norm:
    """Stands for vLLM's FusedRMSNormGated(head_dim, activation="sigmoid")."""

    activation, eps, bias = "sigmoid", 1e-5, None

    def __init__(self, g):
        self.weight = (torch.rand(D, generator=g) + 0.5).to(torch.bfloat16)

    def __call__(self, x, gate):
        return gated_rms_norm_ref(x, gate.reshape(x.shape), self.weight, self.eps)


def _layer(seed=0, slots=12, max_seqs=4):
    g = torch.Generator().manual_seed(seed)
    conv = [SimpleNamespace(weight=torch.randn(H * D, 1, W, generator=g) * 0.5, bias=None) for _ in range(3)]
    return SimpleNamespace(
        prefix="model.layers.0.self_attn", local_num_heads=H, head_dim=D, local_projection_size=H * D,
        kv_cache=(torch.randn(slots, W - 1 + SPEC, 3 * H * D, generator=g).to(torch.bfloat16),
                  torch.randn(slots, H, D, D, generator=g) * 0.3),
        _conv_state_dim_first=False, kda_safe_gate=True, kda_lower_bound=-5.0,
        q_conv1d=conv[0], k_conv1d=conv[1], v_conv1d=conv[2], _merged_conv_weight=None,
        A_log=torch.randn(1, 1, H, 1, generator=g) * 0.3, dt_bias=torch.randn(H * D, generator=g) * 0.2,
        o_norm=Norm(g), glmctl_kda_counters=new_counters(max_seqs, H, "cpu"),
    )


def _spec_meta(num_prefills=0):
    return SimpleNamespace(
        num_prefills=num_prefills, num_decodes=0, num_spec_decodes=2, num_actual_tokens=8,
        spec_sequence_masks=torch.ones(3, dtype=torch.bool),
        spec_query_start_loc=torch.tensor([0, 4, 7, 7], dtype=torch.int32),
        spec_state_indices_tensor=torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [0, 0, 0, 0]], dtype=torch.int32),
        num_accepted_tokens=torch.tensor([2, 1, 1], dtype=torch.int32),
        non_spec_query_start_loc=None, non_spec_state_indices_tensor=None,
    )


def _step_inputs(seed, tokens=8):
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(tokens, 3 * H * D + H + 2 * D, generator=g).to(torch.bfloat16)
    qkv, beta = proj[:, : 3 * H * D], proj[:, 3 * H * D : 3 * H * D + H].unsqueeze(0)
    g1 = torch.randn(1, tokens, H, D, generator=g).to(torch.bfloat16)
    norm_gate = torch.randn(tokens, H, D, generator=g).to(torch.bfloat16)
    return qkv, g1, beta, norm_gate


def _never(*args, **kwargs):
    raise AssertionError("vLLM's _forward ran on a step glmctl's kernel takes")


@interpreted
def test_mtp_verify_step_runs_the_fused_kernel_with_the_norm():
    layer, ref_layer = _layer(), _layer()
    qkv, g1, beta, norm_gate = _step_inputs(1)
    meta = _spec_meta()
    out = torch.full((1, 8, H, D), 5.0, dtype=torch.bfloat16)
    hook.forward_normed(layer, meta, _never, qkv, g1, beta, out, norm_gate)
    want = torch.full((8, H, D), 5.0, dtype=torch.bfloat16)
    conv_state, state = ref_layer.kv_cache
    kda_decode_ref(qkv, conv_state.transpose(1, 2), hook.merged_conv_weight(ref_layer), g1[0].reshape(8, H * D),
                   beta[0], ref_layer.A_log, ref_layer.dt_bias, state, meta.spec_query_start_loc[:3],
                   meta.spec_state_indices_tensor, -5.0, num_accepted_tokens=meta.num_accepted_tokens, out=want,
                   norm_gate=norm_gate, norm_weight=ref_layer.o_norm.weight, norm_eps=1e-5)
    diff = (out[0].float() - want.float()).abs()
    assert torch.all(diff <= 2 ** -7 * want.float().abs() + 1e-4)
    assert torch.equal(layer.kv_cache[0], ref_layer.kv_cache[0])
    torch.testing.assert_close(layer.kv_cache[1], ref_layer.kv_cache[1], rtol=1e-5, atol=1e-5)
    assert layer.glmctl_kda_counters.count_nonzero().item() == 0


def test_other_steps_run_vllms_forward_then_the_norm_in_place():
    layer = _layer()
    qkv, g1, beta, norm_gate = _step_inputs(2)
    out = torch.zeros(1, 8, H, D, dtype=torch.bfloat16)
    raw = torch.randn(1, 8, H, D).to(torch.bfloat16)
    calls = []

    def stock(layer_, qkv_proj_states, g1, beta, core_attn_out):
        calls.append(layer_)
        core_attn_out.copy_(raw)

    for meta in (_spec_meta(num_prefills=1), None):
        hook.forward_normed(layer, meta, stock, qkv, g1, beta, out, norm_gate)
        assert torch.equal(out, gated_rms_norm_ref(raw, norm_gate[None], layer.o_norm.weight, 1e-5))
    assert calls == [layer, layer]


def test_which_steps_and_layers_the_kernel_takes():
    layer = _layer()
    qkv, g1, beta, norm_gate = _step_inputs(3)
    out = torch.empty(1, 8, H, D, dtype=torch.bfloat16)
    call = hook.decode_call(layer, _spec_meta(), qkv, g1, beta, out, norm_gate)
    assert call is not None and call["num_accepted_tokens"] is not None and call["cu_seqlens"].numel() == 3
    assert call["conv_state"].shape == (12, 3 * H * D, W - 1 + SPEC)  # the dim-first view
    plain = SimpleNamespace(num_prefills=0, num_decodes=3, num_spec_decodes=0, spec_sequence_masks=None,
                            num_actual_tokens=3, non_spec_query_start_loc=torch.tensor([0, 1, 2, 3, 3]),
                            non_spec_state_indices_tensor=torch.tensor([1, 2, 3, 0]))
    call = hook.decode_call(layer, plain, qkv, g1, beta, out, norm_gate)
    assert call["num_accepted_tokens"] is None and call["state_indices"].dim() == 1 and call["qkv"].shape[0] == 3
    five = _spec_meta()
    five.spec_state_indices_tensor = torch.ones(3, 5, dtype=torch.int32)  # MTP-4: more than the kernel unrolls
    assert hook.decode_call(layer, five, qkv, g1, beta, out, norm_gate) is None
    assert hook.decode_call(layer, _spec_meta(num_prefills=1), qkv, g1, beta, out, norm_gate) is None
    small = _layer(max_seqs=1)  # counters for one sequence, two in the step
    assert hook.decode_call(small, _spec_meta(), qkv, g1, beta, out, norm_gate) is None
    fp32_cache = _layer()
    fp32_cache.kv_cache = (fp32_cache.kv_cache[0].float(), fp32_cache.kv_cache[1])
    assert hook.decode_call(fp32_cache, _spec_meta(), qkv, g1, beta, out, norm_gate) is None


def test_the_layer_forward_hands_the_norm_gate_to_forward():
    tokens, hidden = 3, 10
    seen = {}

    def linear(out_features):
        w = torch.randn(out_features, hidden if out_features == 3 * H * D + H + 2 * D else D)
        return lambda x: (x @ w.t(),)

    layer = SimpleNamespace(local_num_heads=H, head_dim=D, local_projection_size=H * D,
                            in_proj_qkvbfg_a=linear(3 * H * D + H + 2 * D), f_b_proj=linear(H * D),
                            g_b_proj=linear(H * D))

    def _forward(qkv_proj_states, g1, beta, core_attn_out, norm_gate):
        seen.update(qkv=qkv_proj_states, g1=g1, beta=beta, gate=norm_gate)
        core_attn_out.fill_(2.0)

    layer._forward = _forward
    layer.o_proj = lambda x: (x.sum(-1),)
    x = torch.randn(tokens, hidden)
    y = hook.layer_forward(layer, x)
    assert seen["qkv"].shape == (tokens, 3 * H * D) and seen["beta"].shape == (1, tokens, H)
    assert seen["g1"].shape == (1, tokens, H, D) and seen["gate"].shape == (tokens, H, D)
    assert torch.equal(y, torch.full((tokens,), 2.0 * H * D))


def test_install_patches_vllms_layer_once():
    pytest.importorskip("vllm")
    from glmctl.plugin.platforms.cpu.env_fixes import serve_pil_image_processors

    serve_pil_image_processors()  # vLLM CPU's model package imports image processors (no torchvision here)
    import inspect

    from vllm.models.glm5next.nvidia.kda import Glm5NextLinearAttention as cls

    saved = {k: v for k, v in vars(cls).items() if k in ("__init__", "forward", "_forward") or "_glmctl_" in k}
    try:
        assert hook.install().startswith("KDA decode")
        hook.install()
        assert "norm_gate" in inspect.signature(inspect.unwrap(cls._forward)).parameters
        assert cls.forward.__qualname__.endswith("make_forward.<locals>.forward")
        assert cls.__dict__["_glmctl_kda_decode__forward"] and cls.__dict__["_glmctl_kda_decode___init__"]
    finally:
        for k in [k for k in vars(cls) if "_glmctl_kda_decode" in k]:
            delattr(cls, k)
        for k, v in saved.items():
            setattr(cls, k, v)
