"""GPU lane: glmctl's one-launch KDA decode / MTP-verify kernel (glmctl.kernels.kda_decode) at the
TP8 rank's shapes of GLM-5.3-Flash (8 heads x 128, conv width 4, MTP-3) against vLLM 0.30's own
kernels on the same inputs (`causal_conv1d_update`, `fused_recurrent_kda`, `rms_norm_gated`, as the
layer calls them; `bench/gpu/kda_bench.py` holds both calls), every config, 8 x 4 and 1 x 4 tokens,
padded rows and -1 / 0 draft slots, plain decode; against the torch reference; CUDA-graph replay with
new inputs, accepted counts and slots; bit-for-bit repeatability.

Tolerances: the conv is computed in vLLM's order and rounded to bf16 as vLLM stores it, so the
conv state must match exactly; the recurrence sums its dot products in another order (fp32), so
states agree to 1e-5 relative and outputs to one bf16 step."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import REPO

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")


@pytest.fixture(scope="module")
def kb():
    sys.path.insert(0, str(REPO / "bench" / "gpu"))
    import kda_bench

    return kda_bench


@pytest.fixture(scope="module")
def vllm_kernels(kb):
    pytest.importorskip("vllm")
    try:
        from vllm.models.glm5next.nvidia.ops.third_party.kda import fused_recurrent_kda  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a vLLM without the model's ops: nothing to compare with
        pytest.skip(f"vLLM's KDA kernels do not import: {exc}")
    return kb


def _case(kb, name):
    if name == "8x4":
        return kb.make_layer(8, seed=1)
    if name == "1x4":
        return kb.make_layer(1, seed=2)
    if name == "plain8":
        return kb.make_layer(8, seed=3, tokens_per_seq=1, spec=False)
    # the FULL-graph padding vLLM builds: short sequences, then empty rows with null slots and one
    # accepted token; a draft column whose slot is -1 (its state is not stored); a sequence whose
    # starting slot is null (vLLM's conv runs, its recurrence does not)
    layer = kb.make_layer(8, seed=4)
    dev = layer["cu"].device
    layer["cu"] = torch.tensor([0, 4, 8, 10, 11, 15, 15, 15, 15], dtype=torch.int32, device=dev)
    layer["idx"][5:] = 0
    layer["acc"][5:] = 1
    layer["idx"][0, 3] = -1
    layer["acc"][0] = 2
    layer["idx"][4, 2] = 0
    layer["acc"][4] = 3
    return layer


def _fill(layer, value):
    layer["out"].fill_(value)
    return layer


def _within_one_step(out, ref):
    out, ref = out.float(), ref.float()
    assert torch.isfinite(out).all()
    tol = 2 ** -8 * ref.abs() + 1e-3 * ref.abs().max()
    diff = (out - ref).abs()
    assert torch.all(diff <= tol), f"max excess {(diff - tol).max().item():.3g}"


def _states_close(a, b):
    scale = b.abs().max().item()
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("case", ["8x4", "1x4", "padded", "plain8"])
@pytest.mark.parametrize("config", ["v8w1", "v16w2", "v32w4"])
def test_matches_vllm_kernels(vllm_kernels, case, config):
    kb = vllm_kernels
    from glmctl.kernels.kda_decode import CONFIGS

    layer = _case(kb, case)
    ours, theirs = _fill(kb.clone_caches(layer), 0.0), _fill(kb.clone_caches(layer), 0.0)
    kb.vllm_step(theirs)
    kb.glmctl_step(ours, config=CONFIGS[config])
    torch.cuda.synchronize()
    _within_one_step(ours["out"], theirs["out"])
    assert torch.equal(ours["conv_state"], theirs["conv_state"])
    _states_close(ours["state"], theirs["state"])
    assert ours["counters"].count_nonzero().item() == 0


@pytest.mark.parametrize("case", ["8x4", "padded", "plain8"])
def test_matches_torch_reference(kb, case):
    from glmctl.kernels.kda_decode import kda_decode_ref

    layer = _case(kb, case)
    ours, ref = _fill(kb.clone_caches(layer), 0.0), _fill(kb.clone_caches(layer), 0.0)
    kb.glmctl_step(ours)
    kda_decode_ref(ref["qkv"], ref["conv_state"], ref["conv_w"], ref["g1"], ref["beta"][0], ref["a_log"],
                   ref["g_bias"], ref["state"], ref["cu"], ref["idx"], kb.LOWER_BOUND,
                   num_accepted_tokens=ref["acc"], out=ref["out"][0], norm_gate=ref["norm_gate"],
                   norm_weight=ref["norm_w"], norm_eps=kb.EPS)
    _within_one_step(ours["out"], ref["out"])
    assert torch.equal(ours["conv_state"], ref["conv_state"])
    _states_close(ours["state"], ref["state"])


def test_cuda_graph_replay_with_new_inputs(vllm_kernels):
    kb = vllm_kernels
    layer = kb.make_layer(8, seed=10)
    proj = layer["qkv"]._base if layer["qkv"]._base is not None else layer["qkv"]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # JIT outside the capture
        kb.glmctl_step(kb.clone_caches(layer))
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kb.glmctl_step(layer)
    g = torch.Generator(device="cuda").manual_seed(99)
    for round_ in range(3):
        proj.copy_(torch.randn(proj.shape, generator=g, device="cuda").to(proj.dtype))
        layer["g1"].copy_(torch.randn(layer["g1"].shape, generator=g, device="cuda").to(torch.bfloat16))
        layer["norm_gate"].copy_(torch.randn(layer["norm_gate"].shape, generator=g, device="cuda").to(torch.bfloat16))
        layer["acc"].copy_(torch.randint(1, 5, (8,), generator=g, device="cuda", dtype=torch.int32))
        layer["idx"].copy_(layer["idx"][torch.randperm(8, generator=g, device="cuda")])  # other slots per row
        theirs = _fill(kb.clone_caches(layer), 0.0)
        kb.vllm_step(theirs)
        layer["out"].fill_(0.0)
        graph.replay()
        torch.cuda.synchronize()
        _within_one_step(layer["out"], theirs["out"])
        assert torch.equal(layer["conv_state"], theirs["conv_state"]), round_
        _states_close(layer["state"], theirs["state"])
        assert layer["counters"].count_nonzero().item() == 0


def test_bit_for_bit_repeatable(kb):
    layer = kb.make_layer(8, seed=20)
    first = kb.clone_caches(layer)
    kb.glmctl_step(first)
    for _ in range(10):
        again = kb.clone_caches(layer)
        kb.glmctl_step(again)
        assert torch.equal(again["out"], first["out"])
        assert torch.equal(again["state"], first["state"])
        assert torch.equal(again["conv_state"], first["conv_state"])
