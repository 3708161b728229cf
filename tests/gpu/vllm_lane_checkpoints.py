"""The quantised checkpoints the gpu lane serves, and their exactly dequantised BF16 twins.

- FP8 attention: `glmctl quantize fp8`'s default selection of the tiny checkpoint (CPU, seconds);
  its twin has every FP8 weight dequantised by transformers' own FP8 code
  (tests/vllm/test_quantize_vllm._dequantised_copy).
- EXL3 experts: `glmctl quantize exl3 --calibration none --tp 1` run as a user runs it (exllamav3's
  quantizer on the GPU); its twin is the BF16 source with every routed expert's weight replaced by
  what its EXL3 tensors encode (`glmctl.plugin.quantization.exl3_experts.dequantize`, the format's definition).
A served quantised model is judged against transformers fp32 on its twin (the same function up to
serving noise) and against the BF16 checkpoint (how much the quantisation moves it).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def fp8_attention_checkpoint(src: Path, dst: Path) -> Path:
    from glmctl.quantize.fp8_convert import convert_fp8
    from glmctl.quantize.fp8_plan import Fp8Settings

    convert_fp8(Path(src), dst, Fp8Settings())
    return dst


def fp8_dequantised_twin(fp8: Path, dst: Path) -> Path:
    from tests.vllm.test_quantize_vllm import _dequantised_copy

    return _dequantised_copy(fp8, dst)


def exl3_command(src: Path, dst: Path) -> list[str]:
    """`glmctl quantize exl3` exactly as a user types it (4 bits, calibration-free, TP 1 slices)."""
    return [sys.executable, "-m", "glmctl", "quantize", "exl3", str(src), str(dst), "--calibration", "none",
            "--tp", "1", "--json"]


def run_exl3_quantize(src: Path, dst: Path, log: Path, timeout: float = 240) -> dict:
    with log.open("w") as out:
        proc = subprocess.run(exl3_command(src, dst), stdout=subprocess.PIPE, stderr=out, text=True,
                              timeout=timeout, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"glmctl quantize exl3 exited {proc.returncode}: {log.read_text()[-2000:]}")
    return json.loads(proc.stdout)


def exl3_dequantised_twin(src: Path, exl3: Path, dst: Path) -> Path:
    """`src` (BF16) with each converted expert projection's weight replaced by its EXL3 value."""
    import torch
    from safetensors.torch import load_file, save_file

    from glmctl.plugin.quantization.exl3_experts import dequantize

    bits = json.loads((exl3 / "config.json").read_text())["quantization_config"]["experts"]["bits"]
    encoded: dict[str, torch.Tensor] = {}
    for shard in sorted(exl3.glob("model-exl3-layer-*.safetensors")):
        tensors = load_file(str(shard), device="cuda")
        for name in [n for n in tensors if n.endswith(".trellis")]:
            proj = name.removesuffix(".trellis")
            w = dequantize(tensors[name], tensors[f"{proj}.suh"], tensors[f"{proj}.svh"], bits)  # (in, out)
            encoded[f"{proj}.weight"] = w.t().contiguous().to(torch.bfloat16).cpu()
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    replaced = 0
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(dst / shard))
        hits = [n for n in tensors if n in encoded]
        for name in hits:
            assert tensors[name].shape == encoded[name].shape, (name, tensors[name].shape, encoded[name].shape)
            tensors[name] = encoded[name]
        if hits:
            save_file(tensors, str(dst / shard), metadata={"format": "pt"})
            replaced += len(hits)
    if replaced != len(encoded):
        raise RuntimeError(f"{len(encoded)} EXL3 projections but {replaced} weights replaced in {src}")
    return dst
