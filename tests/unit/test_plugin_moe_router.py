"""The router-logits op (`glmctl.plugin.platforms.moe_router`) on CPU: when it is chosen, which gate calls it
takes, both of its paths (glmctl's GEMV in the Triton interpreter for decode batches, torch.mm
above) against the fp32 product, and the GateLinear hook on a stand-in class."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from tests.unit.interpreted_kernels import interpreted_kernels  # noqa: E402

_modules, interpreted, test_in_fresh_process, _interpreter = interpreted_kernels(
    __file__, "glmctl.kernels.fp8_block_linear")

from glmctl.plugin.platforms import moe_router  # noqa: E402


def test_when_glmctl_computes_the_logits():
    assert moe_router.router_gemm_kernel(True, {}) == "vllm"  # auto
    assert moe_router.router_gemm_kernel(True, {"GLMCTL_ROUTER_GEMM": "glmctl"}) == "glmctl"
    assert moe_router.router_gemm_kernel(False, {"GLMCTL_ROUTER_GEMM": "glmctl"}) == "vllm"


class Gate(torch.nn.Module):
    """Stands for vLLM's GateLinear: weight [E, H], out_dtype, bias."""

    def __init__(self, experts=288, hidden=256, weight_dtype=torch.bfloat16, out_dtype=torch.float32):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, hidden).to(weight_dtype), requires_grad=False)
        self.out_dtype = out_dtype
        self.bias = None

    def forward(self, x):
        return torch.nn.functional.linear(x.to(self.weight.dtype), self.weight).to(self.out_dtype), None


def test_which_calls_it_takes():
    from glmctl.kernels.fp8_block_linear import new_counters

    gate = Gate()
    x = torch.randn(4, 256).to(torch.bfloat16)
    assert not moe_router.takes(gate, x)  # no counters: built before the hook
    gate.register_buffer("glmctl_router_counters", new_counters("cpu"), persistent=False)
    assert moe_router.takes(gate, x)
    assert not moe_router.takes(gate, x.float())
    assert not moe_router.takes(gate, x.view(2, 2, 256))
    gate.out_dtype = torch.bfloat16
    assert not moe_router.takes(gate, x)
    fp32 = Gate(weight_dtype=torch.float32)
    fp32.register_buffer("glmctl_router_counters", new_counters("cpu"), persistent=False)
    assert not moe_router.takes(fp32, x)


@interpreted
@pytest.mark.parametrize("tokens", [1, 8, 32, 70])
def test_logits_match_the_fp32_product(tokens):
    from glmctl.kernels.fp8_block_linear import new_counters

    weight = torch.randn(288, 512).to(torch.bfloat16)
    x = torch.randn(tokens, 512).to(torch.bfloat16)
    counters = new_counters("cpu")
    out = moe_router.router_logits(x, weight, counters)
    assert out.dtype == torch.float32 and out.shape == (tokens, 288)
    assert torch.allclose(out, x.float() @ weight.float().t(), rtol=1e-4, atol=1e-3)
    assert counters.count_nonzero() == 0
    assert moe_router.router_logits_fake(x, weight, counters).shape == out.shape


@interpreted
def test_gate_hook(monkeypatch):
    import vllm.model_executor.layers.fused_moe.router.gate_linear as gate_linear

    class StandIn(Gate):
        pass

    monkeypatch.setattr(gate_linear, "GateLinear", StandIn)
    assert moe_router.install() == "router logits (glmctl GEMV)"
    moe_router.install()  # idempotent: one counters buffer, one wrapper
    gate = StandIn()
    assert gate.glmctl_router_counters.dtype == torch.int32
    x = torch.randn(8, 256).to(torch.bfloat16)
    calls = []
    monkeypatch.setattr(torch.ops.glmctl, "router_logits",
                        lambda *a: calls.append(a) or moe_router.router_logits(*a), raising=False)
    logits, bias = gate(x)
    assert calls and bias is None
    assert torch.allclose(logits, x.float() @ gate.weight.float().t(), rtol=1e-4, atol=1e-3)
    calls.clear()
    gate(x.float())  # not a call it takes: vLLM's path
    assert not calls
