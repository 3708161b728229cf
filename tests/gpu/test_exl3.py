"""gpu lane: EXL3 experts end to end on a real GPU with exllamav3 1.6.5.

Quantizes real-shape random-weight experts (gate/up 4096x2048, down 2048x4096, (in, out)) with
and without calibration, then a small MoE layer at GLM-5.3-Flash's TP8 slice shape (hidden 4096,
256 intermediate channels), and checks the fused-kernel layer against a dequantised torch
reference: small batches, heavy experts in prefill, tensor-parallel slices, a captured CUDA graph
replayed with new routing, the fp16 range check, and exllamav3's sm_90 multi-GEMM barrier.
Measured numbers go to $GLMCTL_EXL3_RECORD (JSON) when set (bench/gpu/exl3.sh sets it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.gpu

RECORD: dict = {}
HIDDEN, INTER_FULL, INTER_TP8, BITS = 4096, 2048, 256, 4


@pytest.fixture(autouse=True)
def _record():
    yield
    path = os.environ.get("GLMCTL_EXL3_RECORD")
    if path:  # after every test: a run cut short still leaves what it measured
        with open(path, "w") as f:
            json.dump(RECORD, f, indent=2, default=str)


def _activations(torch, rows: int, k: int, seed: int):
    """Correlated, anisotropic inputs (what makes calibration matter): Z @ M with decaying columns."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    m = torch.randn(k, k, generator=g, device="cuda") / k**0.5
    m *= torch.exp(-torch.arange(k, device="cuda") / k * 3).unsqueeze(0)
    return torch.randn(rows, k, generator=g, device="cuda") @ m


def _quantize(weights: dict, hidden: int, inter: int, experts: int, hessians):
    from glmctl.quantize.exl3_backend import quantize_layer_experts

    out = {}
    quantize_layer_experts(lambda e, p: weights[(e, p)], experts, hidden, inter, BITS, hessians, seed=0,
                           on_linear=lambda e, p, q: out.__setitem__((e, p), q))
    return out


def _deq(q):
    from glmctl.plugin.quantization.exl3_experts import dequantize

    t = {k: v.cuda() for k, v in q.tensors.items()}
    return dequantize(t["trellis"], t["suh"], t["svh"], BITS)


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture(scope="module")
def real_shape():
    """One expert at GLM-5.3-Flash's full shape, quantized calibrated and calibration-free."""
    import torch
    from glmctl.quantize.exl3_backend import LayerHessians

    g = torch.Generator().manual_seed(1)
    w = {(0, p): (torch.randn(*s, generator=g) / s[1] ** 0.5).bfloat16()
         for p, s in (("gate_proj", (INTER_FULL, HIDDEN)), ("up_proj", (INTER_FULL, HIDDEN)),
                      ("down_proj", (HIDDEN, INTER_FULL)))}
    x = _activations(torch, 8192, HIDDEN, 0)
    gate, up = x @ w[(0, "gate_proj")].cuda().float().t(), x @ w[(0, "up_proj")].cuda().float().t()
    a = torch.nn.functional.silu(gate.clamp(max=10)) * up.clamp(-10, 10)
    hessians = LayerHessians(x.t() @ x, (a.t() @ a).unsqueeze(0), x.shape[0])
    _quantize({(0, p): t[:256, :256] if p != "down_proj" else t[:256, :256]  # warm-up: kernels, buffers
               for (_, p), t in w.items()}, 256, 256, 1, None)
    t0 = time.perf_counter()
    calibrated = _quantize(w, HIDDEN, INTER_FULL, 1, hessians)
    t1 = time.perf_counter()
    free = _quantize(w, HIDDEN, INTER_FULL, 1, None)
    t2 = time.perf_counter()
    return {"w": w, "H": {"gate_proj": hessians.gate_up, "up_proj": hessians.gate_up, "down_proj": hessians.down[0]},
            "calibrated": calibrated, "free": free, "wall": (t1 - t0, t2 - t1)}


def test_real_shape_experts_quantize_within_error_bounds(real_shape):
    import torch

    rows = {}
    for mode in ("calibrated", "free"):
        for p in ("gate_proj", "up_proj", "down_proj"):
            q = real_shape[mode][(0, p)]
            w = real_shape["w"][(0, p)].cuda().float().t()  # (in, out)
            deq = _deq(q)
            H = real_shape["H"][p].float()
            e = deq - w
            proxy = float(torch.trace(e.t() @ H @ e) / torch.trace(w.t() @ H @ w))
            rows[f"{mode} {p}"] = {"shape_in_out": list(w.shape), "seconds": q.seconds, "rel_weight_error": _rel(deq, w),
                                   "proxy_error": proxy, "exllamav3_metric": [q.metric, q.error]}
            assert q.calibrated is (mode == "calibrated")
            # 4 bits per Gaussian weight: trellis-coded quantization lands near 9% RMS error
            assert rows[f"{mode} {p}"]["rel_weight_error"] < 0.15, rows
    for p in ("gate_proj", "up_proj", "down_proj"):
        # LDLQ with the Hessian must beat ignoring it on the inputs it was calibrated for
        assert rows[f"calibrated {p}"]["proxy_error"] < rows[f"free {p}"]["proxy_error"], rows
    RECORD["quantize_real_shape"] = {"bits": BITS, "tensors": rows,
                                     "wall_seconds_3_matrices": {"calibrated": real_shape["wall"][0],
                                                                 "free": real_shape["wall"][1]}}


def test_format_dequantisation_matches_exllamav3_reconstruction(real_shape):
    import torch

    from glmctl.plugin.quantization.exl3_experts import ext

    q = real_shape["free"][(0, "down_proj")]
    t = {k: v.cuda() for k, v in q.tensors.items()}
    theirs = torch.empty((INTER_FULL, HIDDEN), dtype=torch.float16, device="cuda")
    ext().reconstruct_had_slice(theirs, t["trellis"], t["suh"], t["svh"], float(BITS), False, True, 0)
    assert _rel(_deq(q), theirs) < 2e-3  # the format docstring's W = diag(suh) Had T Had diag(svh)


@pytest.fixture(scope="module")
def small_layer():
    """8 experts at the TP8 slice shape (hidden 4096, 256 channels), calibration-free."""
    import torch

    from glmctl.plugin.quantization.exl3_experts import Exl3MoE, Exl3Projection

    g = torch.Generator().manual_seed(2)
    e = 8
    w = {(i, p): (torch.randn(*s, generator=g) / s[1] ** 0.5).bfloat16() for i in range(e)
         for p, s in (("gate_proj", (INTER_TP8, HIDDEN)), ("up_proj", (INTER_TP8, HIDDEN)),
                      ("down_proj", (HIDDEN, INTER_TP8)))}
    q = _quantize(w, HIDDEN, INTER_TP8, e, None)

    def stack(p, key):
        return torch.stack([q[(i, p)].tensors[key] for i in range(e)]).cuda()

    proj = {p: Exl3Projection(stack(p, "trellis"), stack(p, "suh"), stack(p, "svh"))
            for p in ("gate_proj", "up_proj", "down_proj")}
    moe = Exl3MoE(proj["gate_proj"], proj["up_proj"], proj["down_proj"], BITS, act_limit=10.0)
    deq = {p: torch.stack([_deq(q[(i, p)]) for i in range(e)]) for p in proj}
    orig = {p: torch.stack([w[(i, p)].cuda().float().t() for i in range(e)]) for p in proj}
    return {"moe": moe, "deq": deq, "orig": orig, "proj": proj, "experts": e}


def _routing(torch, tokens: int, experts: int, top_k: int, seed: int, skew: float = 0.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=g, device="cuda")
    scores[:, 0] += skew  # skew > 1: expert 0 is picked by every token (a heavy expert)
    w, ids = scores.topk(top_k, dim=-1)
    return ids.to(torch.int32), (w / w.sum(-1, keepdim=True) * 2.5).float()


def _check_layer(small_layer, x, ids, w, label, bound=1e-2, decode="coop"):
    from glmctl.plugin.quantization.exl3_experts import moe_reference

    moe = small_layer["moe"]
    moe.decode_kernel = decode
    try:
        y = moe(x, ids, w)
    finally:
        moe.decode_kernel = "coop"
    d, o = small_layer["deq"], small_layer["orig"]
    ref = moe_reference(x, ids, w, d["gate_proj"], d["up_proj"], d["down_proj"], 10.0)
    full = moe_reference(x, ids, w, o["gate_proj"], o["up_proj"], o["down_proj"], 10.0)
    err, qerr = _rel(y, ref), _rel(y, full)
    RECORD.setdefault("moe_vs_reference", {})[label] = {"rel_error_vs_dequantised": err,
                                                        "rel_error_vs_original_weights": qerr}
    assert y.dtype == x.dtype and y.shape == x.shape
    assert err < bound, (label, err)
    assert qerr < 0.3, (label, qerr)  # 4-bit weights: the layer stays close to the bf16 one
    return y


@pytest.mark.parametrize("tokens, decode", [(1, "coop"), (7, "coop"), (40, "coop"), (128, "coop"), (200, "coop"),
                                            (1, "fused"), (7, "fused"), (40, "fused"), (257, "coop")])
def test_moe_kernels_match_the_dequantised_reference(small_layer, tokens, decode):
    """coop: exl3_moe_coop (256 slots per call, two calls at most); fused: exl3_moe. At top-2, 200
    tokens take two coop calls and 257 tokens go to exl3_moe."""
    import torch

    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    ids, w = _routing(torch, tokens, small_layer["experts"], 2, tokens)
    _check_layer(small_layer, x, ids, w, f"T={tokens} {decode if tokens <= 256 else 'fused'}", decode=decode)


@pytest.mark.parametrize("tokens, decode", [(1, "triton"), (7, "triton"), (40, "triton"), (64, "triton"),
                                            (1, "coop_lean"), (40, "coop_lean"), (5, "auto")])
def test_glmctl_decode_paths_match_the_dequantised_reference(small_layer, tokens, decode):
    """triton: glmctl.kernels.exl3_moe_decode (runs of up to 16 slots, 40 and 64 tokens make an
    expert hold more than one run at top-2 over 8 experts); coop_lean: exl3_moe_coop with the
    one-launch input preparation; auto: the plugin's rule."""
    import torch

    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    ids, w = _routing(torch, tokens, small_layer["experts"], 2, 300 + tokens)
    _check_layer(small_layer, x, ids, w, f"T={tokens} {decode}", decode=decode)


def test_reference_trellis_decode_is_exllamav3s_reconstruct(real_shape):
    """glmctl.kernels.exl3_trellis reads the stored tiles exactly as exllamav3's kernels do."""
    import torch
    from glmctl.kernels.exl3_trellis import decode_trellis_ref

    from glmctl.plugin.quantization.exl3_experts import ext

    q = real_shape["free"][(0, "gate_proj")]
    trellis = q.tensors["trellis"].cuda()
    theirs = torch.empty((HIDDEN, INTER_FULL), dtype=torch.float16, device="cuda")
    ext().reconstruct(theirs, trellis, float(BITS), False, True)
    ours = decode_trellis_ref(trellis[:64].cpu(), BITS)  # the first 1024 input rows: the reference is slow
    mismatch = int((ours.cuda() != theirs[:1024]).sum())
    RECORD["trellis_reference_mismatches"] = mismatch
    assert mismatch == 0


@pytest.mark.parametrize("mode", ["recon", "chunk"])
def test_heavy_experts_in_prefill_are_computed_correctly(small_layer, mode):
    """1200 tokens with expert 0 in every token's top-2: far more rows than the kernel's 256."""
    import torch

    moe = small_layer["moe"]
    moe.prefill_mode = mode
    try:
        x = torch.randn(1200, HIDDEN, device="cuda", dtype=torch.bfloat16)
        ids, w = _routing(torch, 1200, small_layer["experts"], 2, 5, skew=2.0)
        assert int((ids == 0).sum()) == 1200
        _check_layer(small_layer, x, ids, w, f"prefill 1200 tokens, heavy expert, {mode}")
    finally:
        moe.prefill_mode = "recon"


def test_tp_slices_of_the_layer_sum_to_the_whole_layer(small_layer):
    import torch
    from glmctl.quantize.exl3_format import tp_slice

    from glmctl.plugin.quantization.exl3_experts import Exl3MoE, Exl3Projection

    x = torch.randn(9, HIDDEN, device="cuda", dtype=torch.bfloat16)
    ids, w = _routing(torch, 9, small_layer["experts"], 2, 9)
    whole = small_layer["moe"](x, ids, w).float()
    total = torch.zeros_like(whole)
    for rank in range(2):  # TP2: 128 channels per rank, the smallest legal slice
        parts = {}
        for p, proj in small_layer["proj"].items():
            parts[p] = Exl3Projection(*(torch.stack([tp_slice(p, s, t[e], INTER_TP8, 2, rank).contiguous()
                                                     for e in range(t.shape[0])])
                                        for s, t in (("trellis", proj.trellis), ("suh", proj.suh), ("svh", proj.svh))))
        total += Exl3MoE(parts["gate_proj"], parts["up_proj"], parts["down_proj"], BITS, 10.0)(x, ids, w).float()
    err = _rel(total, whole)
    RECORD["tp2_slices_vs_whole_rel_error"] = err
    assert err < 5e-3


@pytest.mark.parametrize("tokens, decode", [(8, "coop"), (40, "coop"), (40, "fused"), (300, "coop")])
def test_captured_graph_replays_with_new_routing(small_layer, tokens, decode):
    import torch

    from glmctl.plugin.quantization.exl3_experts import moe_reference

    moe, d = small_layer["moe"], small_layer["deq"]
    moe.decode_kernel = decode
    moe.warm_up([tokens], 2)
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    ids, w = _routing(torch, tokens, small_layer["experts"], 2, 100 + tokens)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        y = moe(x, ids, w)  # tokens > 256: the sync-free sliced path is what gets captured
    for seed in (1, 2, 3):
        x.copy_(torch.randn_like(x))
        new_ids, new_w = _routing(torch, tokens, small_layer["experts"], 2, 200 + seed)
        ids.copy_(new_ids)
        w.copy_(new_w)
        graph.replay()
        torch.cuda.synchronize()
        ref = moe_reference(x, ids, w, d["gate_proj"], d["up_proj"], d["down_proj"], 10.0)
        err = _rel(y, ref)
        assert err < 1e-2, (tokens, seed, err)
    moe.decode_kernel = "coop"
    RECORD.setdefault("cuda_graph_replay_rel_error", {})[f"T={tokens} {decode}"] = err


@pytest.mark.parametrize("tokens, decode", [(8, "triton"), (40, "triton"), (40, "coop_lean")])
def test_glmctl_decode_paths_replay_from_a_captured_graph(small_layer, tokens, decode):
    test_captured_graph_replays_with_new_routing(small_layer, tokens, decode)


def test_fp16_range_check_clamps_and_counts(small_layer):
    import torch

    moe = small_layer["moe"]
    before = int(moe.fp16_clamped)
    x = torch.randn(4, HIDDEN, device="cuda", dtype=torch.bfloat16)
    x[0, :3] = torch.tensor([1e6, -3e5, float("inf")])
    ids, w = _routing(torch, 4, small_layer["experts"], 2, 4)
    y = moe(x, ids, w)
    assert int(moe.fp16_clamped) - before == 3
    assert torch.isfinite(y[1:]).all()  # the other tokens are unaffected


def test_converter_end_to_end_on_the_tiny_checkpoint(tiny_checkpoint, tmp_path):
    """`glmctl quantize exl3` with exllamav3's real quantizer; its output runs in the runtime."""
    import torch
    from glmctl.quantize.exl3_convert import convert_exl3
    from glmctl.quantize.exl3_plan import Exl3Settings
    from safetensors.torch import load_file

    from glmctl.plugin.quantization.exl3_experts import (
        Exl3MoE,
        Exl3Projection,
        dequantize,
        moe_reference,
    )

    spec = tiny_checkpoint.spec
    t0 = time.perf_counter()
    result = convert_exl3(tiny_checkpoint.path, tmp_path / "out", Exl3Settings(tp_degrees=(1,)))
    seconds = time.perf_counter() - t0
    assert result.linears == (spec.layers - 1 + spec.mtp_layers) * spec.n_routed_experts * 3
    layer = load_file(str(tmp_path / "out" / "model-exl3-layer-002.safetensors"), device="cuda")
    src = {}
    for f in tiny_checkpoint.path.glob("*.safetensors"):
        src.update({k: v for k, v in load_file(str(f), device="cuda").items() if ".layers.2.mlp.experts." in k})
    e = spec.n_routed_experts
    proj = {p: Exl3Projection(*(torch.stack([layer[f"model.layers.2.mlp.experts.{i}.{p}.{s}"] for i in range(e)])
                                for s in ("trellis", "suh", "svh")))
            for p in ("gate_proj", "up_proj", "down_proj")}
    moe = Exl3MoE(proj["gate_proj"], proj["up_proj"], proj["down_proj"], BITS, act_limit=10.0)
    x = torch.randn(5, spec.hidden_size, device="cuda", dtype=torch.bfloat16)
    ids, w = _routing(torch, 5, e, spec.num_experts_per_tok, 3)
    y = moe(x, ids, w)
    deq = [torch.stack([dequantize(*(t[i] for t in (p.trellis, p.suh, p.svh)), BITS) for i in range(e)])
           for p in proj.values()]
    orig = [torch.stack([src[f"model.layers.2.mlp.experts.{i}.{p}.weight"].float().t() for i in range(e)])
            for p in proj]
    err = _rel(y, moe_reference(x, ids, w, *deq, 10.0))
    qerr = _rel(y, moe_reference(x, ids, w, *orig, 10.0))
    RECORD["tiny_checkpoint_conversion"] = {"seconds": seconds, "linears": result.linears,
                                            "rel_error_vs_dequantised": err, "rel_error_vs_bf16": qerr}
    assert err < 1e-2 and qerr < 0.3, (err, qerr)


MGEMM_PROBE = textwrap.dedent("""
    import json, sys, torch
    from glmctl.plugin.quantization.exl3_experts import ext
    mode = sys.argv[1]
    e, k, n, bits = 64, 4096, 256, 4
    gen = torch.Generator(device="cuda").manual_seed(0)
    trellis = torch.randint(-2**15, 2**15, (e, k // 16, n // 16, 16 * bits), dtype=torch.int16, device="cuda", generator=gen)
    suh = torch.full((e, k), 1 / 8, dtype=torch.half, device="cuda")
    svh = torch.full((e, n), 1 / 8, dtype=torch.half, device="cuda")
    tab = lambda t: torch.arange(e, device="cuda", dtype=torch.int64) * t.stride(0) * t.element_size() + t.data_ptr()
    B, S, V = tab(trellis), tab(suh), tab(svh)
    def run(m, topk, a, c, had, idx, wts):
        ext().exl3_mgemm(a, B, c, S, had, V, idx, wts, float(bits), -1, False, True, -1, -1, 0, 1, None, None)
    cases = []
    for m in (1, 8):
        a = torch.randn(1, m, k, device="cuda").half()
        idx = torch.randperm(e, device="cuda")[:8].view(1, 8)
        wts = torch.full((1, 8), 0.125, dtype=torch.half, device="cuda")
        c = torch.empty(8, m, n, dtype=torch.half, device="cuda")
        had = torch.empty(8, m, k, dtype=torch.half, device="cuda")
        cases.append((m, a, c, had, idx, wts))
        run(m, 8, a, c, had, idx, wts)  # autotune (host syncs) before any capture
    torch.cuda.synchronize()
    if mode == "eager":
        for _ in range(500):
            for m, a, c, had, idx, wts in cases:
                run(m, 8, a, c, had, idx, wts)
    elif mode == "graph":
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for m, a, c, had, idx, wts in cases:
                run(m, 8, a, c, had, idx, wts)
        for _ in range(500):
            g.replay()
    elif mode == "two_streams":
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        for _ in range(200):
            with torch.cuda.stream(s1):
                run(*cases[0][:1], 8, *cases[0][1:])
            with torch.cuda.stream(s2):
                run(*cases[1][:1], 8, *cases[1][1:])
    torch.cuda.synchronize()
    print(json.dumps({"mode": mode, "ok": True, "finite": bool(torch.isfinite(cases[1][2]).all())}))
""")


def _probe(mode: str, timeout: float) -> dict:
    started = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-c", MGEMM_PROBE, mode], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "ok": False, "hung": True, "seconds": time.perf_counter() - started}
    out = {"mode": mode, "ok": done.returncode == 0, "hung": False, "seconds": time.perf_counter() - started}
    if done.returncode:
        out["stderr"] = done.stderr[-800:]
    return out


def test_mgemm_group_barrier_on_sm90_does_not_deadlock():
    """exllamav3 1.6.5 still compiles exl3_mgemm's sm_90 path with its hand-rolled group barrier
    (`__CUDA_ARCH__ > 890` in exl3_gemm_kernel.cuh). Run it hard, eagerly and replayed from a
    captured graph, each in a child process with a deadline (a deadlock would hang forever).
    Two streams at once is recorded but not asserted: the barrier counters are device-global,
    and glmctl never runs two exllamav3 kernels concurrently."""
    import torch

    assert torch.cuda.get_device_capability()[0] >= 9 or pytest.skip("the sm_90 barrier path needs sm_90+")
    results = [_probe("eager", 30), _probe("graph", 30), _probe("two_streams", 15)]
    RECORD["mgemm_barrier_sm90"] = {"device": torch.cuda.get_device_name(), "probes": results}
    for r in results[:2]:
        assert r["ok"] and not r["hung"], r
