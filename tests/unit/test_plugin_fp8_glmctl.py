"""glmctl's block-FP8 linear method (`glmctl.plugin.quantization.fp8_glmctl`) on CPU: which GPUs
get the Triton kernel, the parameters it shares with vLLM's block `Fp8LinearMethod`, and a fused
two-shard layer loaded through vLLM's own loaders, run through torch.ops.glmctl.fp8_block_linear
in the Triton interpreter against the exact dequantised product; and the `Fp8Config` hook that
hands vLLM's block-FP8 linears to it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from tests.unit.interpreted_kernels import interpreted_kernels  # noqa: E402

_modules, interpreted, test_in_fresh_process, _interpreter = interpreted_kernels(
    __file__, "glmctl.kernels.fp8_block_linear")

from glmctl.errors import ConfigError  # noqa: E402
from glmctl.plugin.quantization import fp8_glmctl  # noqa: E402


@pytest.fixture(autouse=True)
def _tp1_without_process_groups(monkeypatch):
    # a TP-1 layer without vLLM's process groups: the block-shape check and the parameters ask them
    for module in ("vllm.distributed", "vllm.model_executor.parameter"):
        monkeypatch.setattr(f"{module}.get_tensor_model_parallel_world_size", lambda: 1)
        monkeypatch.setattr(f"{module}.get_tensor_model_parallel_rank", lambda: 0)


def test_which_gpus_get_the_triton_kernel():
    kernel = fp8_glmctl.linear_kernel
    glmctl = {"GLMCTL_FP8_LINEAR": "glmctl"}
    assert kernel(None, glmctl) == "vllm"  # not CUDA
    assert kernel((8, 9), glmctl) == "glmctl"  # L40
    assert kernel((9, 0), glmctl) == "glmctl"
    assert kernel((8, 9), {}) == "vllm"  # auto: vLLM's choice
    assert kernel((8, 9), {"GLMCTL_FP8_LINEAR": "vllm"}) == "vllm"
    assert kernel((8, 0), {"GLMCTL_FP8_LINEAR": "vllm"}) == "vllm"
    with pytest.raises(ConfigError, match="sm_89"):
        kernel((8, 6), glmctl)  # Ampere: no fp8e4nv in Triton
    with pytest.raises(ConfigError):
        kernel((9, 0), {"GLMCTL_FP8_LINEAR": "marlin"})


def test_only_128_blocks():
    with pytest.raises(ValueError, match="128x128"):
        fp8_glmctl.GlmctlFp8LinearMethod([64, 64])


def _fused_layer(shards, k):
    """A bare module with the method's parameters for a merged GEMM of `shards` rows (TP 1), each
    shard loaded the way vLLM's block loader places it."""
    method = fp8_glmctl.GlmctlFp8LinearMethod([128, 128])
    layer = torch.nn.Module()
    layer.tp_size = 1
    method.create_weights(layer, k, list(shards), k, sum(shards), torch.bfloat16, weight_loader=None)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight.shape == (sum(shards), k)
    assert layer.weight_scale_inv.shape == (-(-sum(shards) // 128), -(-k // 128))
    g = torch.Generator().manual_seed(sum(shards) + k)
    layer.weight.data.copy_((torch.randn(sum(shards), k, generator=g) * 0.5).to(torch.float8_e4m3fn))
    layer.weight_scale_inv.data.copy_(torch.rand(layer.weight_scale_inv.shape, generator=g) * 0.02 + 0.005)
    return method, layer


@interpreted
@pytest.mark.parametrize("rows", [1, 8, 32, 80])
def test_fused_layer_matches_dequantised_product(rows):
    from glmctl.kernels.fp8_block_linear import fp8_block_linear_ref

    from glmctl.plugin.quantization.fp8_linear import dequantized_weight

    shards, k = (256, 96), 512  # a whole-block shard, then a partial last one
    method, layer = _fused_layer(shards, k)
    exact = dequantized_weight(layer, 128).float()  # shard by shard, on each shard's own grid
    method.process_weights_after_loading(layer)
    assert layer.glmctl_fp8_counters.count_nonzero() == 0
    x = torch.randn(rows, k).to(torch.bfloat16)
    out = method.apply(layer, x)
    ref = fp8_block_linear_ref(x, layer.weight, layer.weight_scale_inv)
    assert out.shape == (rows, sum(shards)) and out.dtype == torch.bfloat16
    assert torch.allclose(ref, x.float() @ exact.t(), rtol=1e-2, atol=1e-2)  # the uniform grid is the shards'
    diff = (out.float() - ref).abs()
    assert torch.all(diff <= 2 ** -7 * ref.abs() + 1e-3 * ref.abs().max())
    assert layer.glmctl_fp8_counters.count_nonzero() == 0


def test_fp8_config_hook_swaps_block_linears_only(monkeypatch):
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod

    from glmctl.plugin.patching import wrap_once

    answers = {}

    class Linear:  # stands for a LinearBase layer
        pass

    def stock(self, layer, prefix):
        return answers[prefix]

    monkeypatch.setattr(fp8_glmctl, "LinearBase", Linear)

    class Config(Fp8Config):  # a subclass, so the real Fp8Config stays unpatched
        def __init__(self):
            pass

        get_quant_method = stock

    monkeypatch.setattr("vllm.model_executor.layers.quantization.fp8.Fp8Config", Config)
    fp8_glmctl.install_fp8_linear_kernel()
    assert not wrap_once(Config, "get_quant_method", lambda f: f, "fp8_linear")  # idempotent marker

    def vllm_method(block, e8m0=False):
        m = Fp8LinearMethod.__new__(Fp8LinearMethod)
        m.block_quant, m.weight_block_size, m.is_scale_e8m0 = block is not None, block, e8m0
        return m

    answers.update(block=vllm_method([128, 128]), tensor=vllm_method(None), e8m0=vllm_method([128, 128], True),
                   other=object())
    config = Config()
    for kernel, swapped in (("glmctl", True), ("vllm", False)):
        monkeypatch.setattr(fp8_glmctl, "current_linear_kernel", lambda k=kernel: k)
        got = config.get_quant_method(Linear(), "block")
        assert isinstance(got, fp8_glmctl.GlmctlFp8LinearMethod) is swapped
        assert config.get_quant_method(Linear(), "tensor") is answers["tensor"]
        assert config.get_quant_method(Linear(), "e8m0") is answers["e8m0"]
        assert config.get_quant_method(Linear(), "other") is answers["other"]
        assert config.get_quant_method(object(), "block") is answers["block"]  # not a linear
