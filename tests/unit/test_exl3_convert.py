"""`glmctl quantize exl3` without CUDA: planning, selection, the writer/reader, resume, calibration.

exllamav3's quantizer needs CUDA, so these tests pass a CPU stand-in with its exact signature whose
output encodes where each tensor came from; the gpu lane runs the real one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from glmctl.quantize.checkpoint import open_checkpoint
from glmctl.quantize.exl3_convert import convert_exl3
from glmctl.quantize.exl3_format import (
    MUL1_MARKER,
    PROJECTIONS,
    Exl3ExpertsSpec,
    io_features,
    trellis_shape,
)
from glmctl.quantize.exl3_plan import Exl3Settings, plan_exl3

from glmctl.errors import UsageError

TP1 = Exl3Settings(tp_degrees=(1,))  # the tiny checkpoint's 128 intermediate channels cannot split


class FakeQuantizer:
    """quantize_layer_experts' signature; suh/svh carry the source weight's column/row means."""

    def __init__(self, stop_at_layer: int | None = None) -> None:
        self.calls: list[tuple[int, bool]] = []  # (seed, calibrated)
        self.hessians = {}
        self.stop_at_layer = stop_at_layer

    def __call__(self, weights, num_experts, hidden, intermediate, bits, hessians, *, seed, name, on_linear):
        import torch
        from glmctl.quantize.exl3_backend import QuantizedLinear

        layer = int(name(0, "gate_proj").split("layers.")[1].split(".")[0])
        if layer == self.stop_at_layer:
            raise KeyboardInterrupt  # the operator pressed Ctrl-C in the middle of this layer
        self.calls.append((layer, hessians is not None))
        if hessians is not None:
            self.hessians[layer] = hessians
        for e in range(num_experts):
            for p in PROJECTIONS:
                w = weights(e, p).float()
                in_f, out_f = io_features(p, hidden, intermediate)
                assert w.shape == (out_f, in_f)
                tensors = {"trellis": torch.full(trellis_shape(in_f, out_f, bits), e, dtype=torch.int16),
                           "suh": w.mean(0).half(), "svh": w.mean(1).half(),
                           "mul1": torch.tensor(MUL1_MARKER, dtype=torch.int32)}
                err = float(hessians.gate_up.trace()) if hessians is not None else 0.25
                on_linear(e, p, QuantizedLinear(tensors, "proxy_err" if hessians else "rmse", err,
                                                hessians is not None, 0.01))


def _load(path: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_plan_selects_experts_modules_by_glob_and_keeps_the_rest(tiny_checkpoint):
    ckpt = open_checkpoint(tiny_checkpoint.path)
    plan = plan_exl3(ckpt, Exl3Settings(tp_degrees=(1,), experts=("model.layers.[12].mlp.experts",)))
    assert [layer.layer for layer in plan.layers] == [1, 2]
    assert plan.skipped_modules == ["model.layers.3.mlp.experts", "model.layers.4.mlp.experts"]
    kept = {t.name for layout in plan.passthrough.values() for t in layout}
    assert "model.layers.3.mlp.experts.0.gate_proj.weight" in kept
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" not in kept
    assert "model.layers.1.mlp.shared_experts.gate_proj.weight" in kept  # the shared expert stays
    assert plan.quantization_config["experts"]["modules"] == ["model.layers.1.mlp.experts",
                                                              "model.layers.2.mlp.experts"]
    with pytest.raises(UsageError, match="matches none"):
        plan_exl3(ckpt, Exl3Settings(tp_degrees=(1,), experts=("*.mlp.shared_experts",)))


def test_plan_refuses_tp_degrees_that_cut_a_hadamard_block(tiny_checkpoint):
    with pytest.raises(UsageError, match="TP 2: each rank would hold 64"):
        plan_exl3(open_checkpoint(tiny_checkpoint.path), Exl3Settings(tp_degrees=(1, 2)))


def test_convert_writes_the_documented_format_and_copies_everything_else(tiny_checkpoint, tmp_path):
    import torch

    src = tiny_checkpoint.path
    fake = FakeQuantizer()
    result = convert_exl3(src, tmp_path / "out", TP1, quantizer=fake)
    out = tmp_path / "out"
    config = json.loads((out / "config.json").read_text())
    spec = Exl3ExpertsSpec.from_config(config["quantization_config"])
    assert spec.layers() == {1, 2, 3, 4} and spec.non_experts is None  # MTP layer 4 included
    assert config["quantization_config"]["experts"]["calibration"] == "none"
    assert sorted(layer for layer, _ in fake.calls) == [1, 2, 3, 4]

    before, after = _load(src), _load(out)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(after)
    for name, tensor in before.items():
        if ".mlp.experts." in name:
            assert name not in after
        else:
            assert torch.equal(after[name], tensor), name  # byte-identical copy
    hidden, inter = tiny_checkpoint.spec.hidden_size, tiny_checkpoint.spec.moe_intermediate_size
    p = "model.layers.3.mlp.experts.5.down_proj"
    assert after[f"{p}.trellis"].shape == (inter // 16, hidden // 16, 64)
    assert after[f"{p}.trellis"].dtype == torch.int16 and int(after[f"{p}.trellis"][0, 0, 0]) == 5
    assert after[f"{p}.mul1"].item() == MUL1_MARKER
    # the tensors of expert 5's down_proj came from expert 5's down_proj
    w = before[f"{p}.weight"].float()
    assert torch.equal(after[f"{p}.svh"], w.mean(1).half()) and torch.equal(after[f"{p}.suh"], w.mean(0).half())
    assert index[f"{p}.trellis"] == "model-exl3-layer-003.safetensors"

    report = json.loads((out / "glmctl-exl3-report.json").read_text())
    assert len(report["tensors"]) == result.linears == 4 * tiny_checkpoint.spec.n_routed_experts * 3
    assert {t["metric"] for t in report["tensors"]} == {"rmse"} and result.uncalibrated == result.linears
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert result.expert_bytes_out < 0.3 * result.expert_bytes_in  # bf16 -> 4 bit + scales
    assert not list(tmp_path.glob(".out*"))  # the partial directory was renamed away


def test_dry_run_writes_nothing(tiny_checkpoint, tmp_path):
    result = convert_exl3(tiny_checkpoint.path, tmp_path / "out", TP1, dry_run=True, quantizer=FakeQuantizer())
    assert result.dry_run and result.linears == 4 * 16 * 3 and not (tmp_path / "out").exists()


def test_interrupted_conversion_resumes_per_layer_and_refuses_other_settings(tiny_checkpoint, tmp_path):
    src, dst = tiny_checkpoint.path, tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        convert_exl3(src, dst, TP1, quantizer=FakeQuantizer(stop_at_layer=3))
    assert not dst.exists()
    partial = tmp_path / ".out.exl3-partial"
    assert (partial / "model-exl3-layer-002.safetensors").is_file()
    assert not list(partial.glob("*.part"))  # the half-written layer 3 unit was removed

    with pytest.raises(UsageError, match="pass --resume"):
        convert_exl3(src, dst, TP1, quantizer=FakeQuantizer())
    with pytest.raises(UsageError, match="different settings.*bits"):
        convert_exl3(src, dst, Exl3Settings(tp_degrees=(1,), bits=3), resume=True, quantizer=FakeQuantizer())

    again = FakeQuantizer()
    result = convert_exl3(src, dst, TP1, resume=True, quantizer=again)
    assert [layer for layer, _ in again.calls] == [3, 4]  # layers 1 and 2 were not redone
    assert result.units_resumed == 3 + 2  # three copied shards, two layers
    clean = tmp_path / "clean"
    convert_exl3(src, clean, TP1, quantizer=FakeQuantizer())
    for f in sorted(clean.iterdir()):
        assert (dst / f.name).read_bytes() == f.read_bytes(), f.name
    report = json.loads((dst / "glmctl-exl3-report.json").read_text())
    assert len(report["tensors"]) == 4 * 16 * 3  # resumed layers' errors are in the report too


def _calibration_text(tmp_path: Path) -> Path:
    words = "the quick brown fox jumps over the lazy dog while seven wizards quietly hex a jovial knight".split()
    text = " ".join(words[(i * 7) % len(words)] for i in range(3000))
    path = tmp_path / "calib.txt"
    path.write_text(text)
    return path


@pytest.mark.slow
def test_calibration_hessians_match_a_full_transformers_forward(tiny_checkpoint, tmp_path):
    """Layer-by-layer streaming gives the same MoE inputs as transformers' whole model."""
    import torch
    import torch.nn.functional as F
    from glmctl.quantize.exl3_calibrate import calibration_rows

    from tests.hf_reference import load_transformers_model

    corpus = _calibration_text(tmp_path)
    settings = Exl3Settings(tp_degrees=(1,), calibration=(str(corpus),), calibration_tokens=128, calibration_row=64)
    fake = FakeQuantizer()
    result = convert_exl3(tiny_checkpoint.path, tmp_path / "out", settings, quantizer=fake, device="cpu")
    assert fake.calls == [(1, True), (2, True), (3, True), (4, False)]  # MTP: calibration-free
    assert result.calibrated == 3 * 16 * 3 and result.uncalibrated == 16 * 3

    rows = calibration_rows([corpus], tiny_checkpoint.path / "tokenizer.json", 128, 64)
    model = load_transformers_model(tiny_checkpoint.path).model
    text = model.model.language_model
    seen = {}
    hooks = [text.layers[i].mlp.register_forward_pre_hook(
        lambda m, args, i=i: seen.setdefault(i, []).append(args[0].reshape(-1, args[0].shape[-1]))) for i in (1, 2, 3)]
    with torch.no_grad():
        model(input_ids=rows)
    for h in hooks:
        h.remove()
    for i in (1, 2, 3):
        x = torch.cat(seen[i]).float()
        got = fake.hessians[i]
        assert got.rows == x.shape[0] == 128
        torch.testing.assert_close(got.gate_up, x.t() @ x, rtol=2e-4, atol=2e-4)
        experts = text.layers[i].mlp.experts
        e, inter, lim = 7, experts.intermediate_dim, experts.swiglu_limit
        gu = x @ experts.gate_up_proj[e].float().t()
        a = F.silu(gu[:, :inter].clamp(max=lim)) * gu[:, inter:].clamp(-lim, lim)
        torch.testing.assert_close(got.down[e], a.t() @ a, rtol=2e-4, atol=2e-4)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"]["experts"]["calibration"] == {"tokens": 128, "sources": ["calib.txt"]}


@pytest.mark.slow
def test_calibrated_conversion_resumes_from_the_saved_row_state(tiny_checkpoint, tmp_path):
    import torch

    corpus = _calibration_text(tmp_path)
    settings = Exl3Settings(tp_degrees=(1,), calibration=(str(corpus),), calibration_tokens=128, calibration_row=64)
    clean = FakeQuantizer()
    convert_exl3(tiny_checkpoint.path, tmp_path / "clean", settings, quantizer=clean, device="cpu")
    with pytest.raises(KeyboardInterrupt):
        convert_exl3(tiny_checkpoint.path, tmp_path / "out", settings, quantizer=FakeQuantizer(stop_at_layer=3),
                     device="cpu")
    resumed = FakeQuantizer()
    convert_exl3(tiny_checkpoint.path, tmp_path / "out", settings, resume=True, quantizer=resumed, device="cpu")
    assert resumed.calls == [(3, True), (4, False)]
    torch.testing.assert_close(resumed.hessians[3].gate_up, clean.hessians[3].gate_up)
    torch.testing.assert_close(resumed.hessians[3].down, clean.hessians[3].down)
    assert not (tmp_path / "out" / "calibration-state.pt").exists()


def test_cli_dry_run_reports_the_plan_as_json_and_refuses_bad_tp(tiny_checkpoint, tmp_path, run_cli):
    done = run_cli("quantize", "exl3", str(tiny_checkpoint.path), str(tmp_path / "out"), "--dry-run", "--tp", "1",
                   "--experts", "model.layers.1.mlp.experts,model.layers.4.mlp.experts", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["dry_run"] and data["layers"] == ["model.layers.1.mlp.experts", "model.layers.4.mlp.experts"]
    assert data["linears"] == 2 * 16 * 3 and data["quantization_config"]["quant_method"] == "glmctl_exl3"
    assert not (tmp_path / "out").exists()
    bad = run_cli("quantize", "exl3", str(tiny_checkpoint.path), str(tmp_path / "out"), "--dry-run", "--tp", "1,2")
    assert bad.returncode == 2 and "not a multiple of 128" in bad.stderr


def test_default_tp_degrees_come_from_the_shipped_exl3_profiles(tmp_path, monkeypatch):
    from importlib import resources

    from glmctl.quantize.exl3_plan import default_tp_degrees

    (tmp_path / "commercial.yaml").write_text("model: {weights: exl3}\ntensor_parallel_size: 8\n")
    (tmp_path / "latency.yaml").write_text("model: {weights: fp8}\ntensor_parallel_size: 4\n")
    monkeypatch.setattr(resources, "files", lambda package: tmp_path)
    assert default_tp_degrees() == (8,)  # only profiles that serve EXL3 experts count
    (tmp_path / "commercial.yaml").unlink()
    assert default_tp_degrees() == (1, 2, 4, 8)  # none shipped: every degree up to a node of 8


def test_exl3_over_an_fp8_attention_checkpoint_keeps_its_fp8_attention(tiny_checkpoint, tmp_path):
    """The commercial chain: `glmctl quantize fp8` (attention projections), then `glmctl quantize
    exl3` (routed experts). The attention tensors and scales pass through byte for byte, the FP8
    config rides along as glmctl_exl3's non-expert config, the planner sees FP8 attention, and the
    plugin's FP8-attention hooks find the block-FP8 config inside vLLM's glmctl_exl3 config."""
    import torch
    from glmctl.quantize.fp8_convert import convert_fp8
    from glmctl.quantize.fp8_plan import Fp8Settings

    from glmctl.plan.model import load_model_spec
    from glmctl.plugin.quantization.exl3_config import Exl3ExpertsConfig
    from glmctl.plugin.quantization.fp8_attention import _block_fp8

    fp8 = tmp_path / "fp8"
    convert_fp8(Path(tiny_checkpoint.path), fp8, Fp8Settings())
    out = tmp_path / "exl3"
    convert_exl3(fp8, out, TP1, quantizer=FakeQuantizer())

    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    spec = Exl3ExpertsSpec.from_config(quant)
    assert spec.non_experts["quant_method"] == "fp8" and spec.non_experts["weight_block_size"] == [128, 128]
    before, after = _load(fp8), _load(out)
    scales = [n for n in before if n.endswith(".weight_scale_inv") and ".self_attn." in n]
    assert len(scales) > 20
    for name in scales:
        weight = name.removesuffix("_scale_inv")
        assert torch.equal(after[name], before[name]), name
        assert torch.equal(after[weight].view(torch.uint8), before[weight].view(torch.uint8)), weight

    model = load_model_spec(out)
    assert model.checkpoint_quant == "exl3:4" and model.fp8_attention == ["kda", "mla"]
    block = _block_fp8(Exl3ExpertsConfig.from_config(quant))
    assert block is not None and block.block == 128


def test_dry_run_refuses_calibration_files_that_do_not_exist(tiny_checkpoint, tmp_path, run_cli):
    proc = run_cli("quantize", "exl3", str(tiny_checkpoint.path), str(tmp_path / "out"), "--dry-run",
                   "--tp", "1", "--calibration", f"{tmp_path / 'nope.txt'}")
    assert proc.returncode == 2 and "nope.txt is not a file" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()
