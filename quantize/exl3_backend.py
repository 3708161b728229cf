"""exllamav3 1.6.5's own quantizer, driven for the routed experts of one MoE layer (CUDA only).

exllamav3 quantizes a linear from its weight in (in, out) orientation and an `H_data` dict: the
calibration Hessian sum(x x^T) over the inputs that reach the linear, and its row count (or a
meta tensor: no calibration, the `fallback_quant` path). `quantize_exl3_batch` runs many linears
in one pass in two layouts, and this module feeds it both the way exllamav3's converter does for
a block-sparse MLP:

  - gate_proj and up_proj of every expert share ONE H_data (the MoE block input): passed as the
    same dict object, which makes exllamav3 concatenate their outputs into one LDLQ pass and draw
    one input sign vector for the layer;
  - each expert's down_proj has its own H_data (its intermediate activations): same shapes, so
    exllamav3 stacks them into a batched LDLQ with per-tensor factors.

Groups of `group_experts` experts go through at a time to bound device memory (a whole GLM-5.3-
Flash layer at once would need ~50 GB of fp32 work buffers).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from glmctl.quantize.exl3_format import MUL1_MARKER, PROJECTIONS, io_features, trellis_shape

from glmctl.errors import DependencyError, require_module

if TYPE_CHECKING:
    import torch

QUANTIZE_MODULE = "exllamav3.modules.quant.exl3_lib.quantize"


@dataclass
class QuantizedLinear:
    """One converted projection: the tensors to store and how well it went."""

    tensors: dict  # suffix -> CPU tensor (trellis, suh, svh, mul1)
    metric: str  # "proxy_err" (calibrated: tr(E H E^T) / tr(W H W^T)) or "rmse" (calibration-free)
    error: float
    calibrated: bool
    seconds: float


@dataclass
class LayerHessians:
    """Calibration statistics of one MoE layer (sums, not means; exllamav3 divides by count)."""

    gate_up: torch.Tensor  # [hidden, hidden] fp32: sum of x x^T over the MoE block inputs
    down: torch.Tensor  # [experts, intermediate, intermediate] fp32: per expert, over its activations
    rows: int  # calibration rows (tokens) behind every sum


def load_quantizer():
    """exllamav3's quantize module; raises DependencyError without exllamav3 or CUDA."""
    import torch

    if not torch.cuda.is_available():
        raise DependencyError("EXL3 quantization runs exllamav3's CUDA kernels and no CUDA device is visible",
                              hint="run `glmctl quantize exl3` on a machine with an NVIDIA GPU "
                                   "(`--dry-run` works anywhere)")
    return require_module(QUANTIZE_MODULE, "gpu", "EXL3 quantization")


def _h_data(sums: torch.Tensor | None, rows: int, k: int, key: str, device) -> dict:
    import torch

    if sums is None:  # calibration-free: exllamav3 takes a meta H as "no capture"
        H = torch.zeros((k, k), dtype=torch.float32, device="meta")
    else:
        H = sums.to(device=device, dtype=torch.float32, copy=True)  # finalize works in place
    return {"H": H, "packed": False, "n": k, "first_key": key, "count": rows if sums is not None else 0,
            "finalized": False, "num_total": rows * k, "inf_nan": torch.zeros(2, dtype=torch.long, device=device),
            "device": device}


def quantize_layer_experts(
    weights: Callable[[int, str], torch.Tensor],
    num_experts: int,
    hidden: int,
    intermediate: int,
    bits: int,
    hessians: LayerHessians | None,
    *,
    seed: int,
    device: int = 0,
    group_experts: int = 16,
    name: Callable[[int, str], str] = lambda e, p: f"experts.{e}.{p}",
    on_linear: Callable[[int, str, QuantizedLinear], None],
) -> None:
    """Quantize every routed expert of one layer; `on_linear(expert, proj, result)` per projection.

    `weights(e, proj)` returns the nn.Linear weight, shape (out, in), any float dtype, on the CPU.
    """
    import torch

    q = load_quantizer()
    dev = torch.device("cuda", device)
    shapes = {p: expected_shapes(p, hidden, intermediate, bits) for p in PROJECTIONS}
    gu_data = _h_data(hessians.gate_up if hessians else None, hessians.rows if hessians else 0,
                      hidden, name(0, "gate_proj"), dev)

    def quant_args(layer_seed: int) -> dict:
        return {"K": bits, "seed": layer_seed, "devices": [device], "device_ratios": None,
                "apply_out_scales": None, "mul1": True}

    for first in range(0, num_experts, group_experts):
        experts = list(range(first, min(first + group_experts, num_experts)))
        # gate/up: one shared H_data object (exllamav3's shared-Hessian layout)
        gu = [(e, p) for e in experts for p in ("gate_proj", "up_proj")]
        _run(q, gu, weights, [gu_data] * len(gu), [quant_args(seed) for _ in gu], hessians is not None,
             shapes, on_linear)
        # down: one H_data per expert (stacked same-shape layout)
        downs = [(e, "down_proj") for e in experts]
        d_data = [_h_data(hessians.down[e] if hessians else None, hessians.rows if hessians else 0,
                          intermediate, name(e, "down_proj"), dev) for e in experts]
        _run(q, downs, weights, d_data, [quant_args(seed) for _ in downs], hessians is not None, shapes,
             on_linear)
        del d_data
    torch.cuda.synchronize(dev)


def _run(q, keys, weights, h_datas, qargs, calibrated, shapes, on_linear) -> None:
    import torch

    # exllamav3 takes (in, out): the transpose of nn.Linear.weight, in checkpoint precision
    mats = [weights(e, p).t().contiguous() for e, p in keys]
    started = time.perf_counter()
    results = q.quantize_exl3_batch(mats, h_datas, qargs)
    torch.cuda.synchronize()
    per = (time.perf_counter() - started) / len(keys)
    for (e, p), qa, (err, out) in zip(keys, qargs, results, strict=True):
        fallback = bool(qa.get("q_fallback"))
        tensors = {
            "trellis": out["trellis"].to("cpu", torch.int16).contiguous(),
            "suh": out["suh"].to("cpu", torch.float16).contiguous(),
            "svh": out["svh"].to("cpu", torch.float16).contiguous(),
            "mul1": torch.tensor(MUL1_MARKER, dtype=torch.int32),
        }
        if "mul1" not in out:
            raise RuntimeError(f"exllamav3 returned no mul1 marker for expert {e} {p}: wrong codebook")
        got = {k: tuple(v.shape) for k, v in tensors.items()}
        if got != shapes[p]:
            raise RuntimeError(f"exllamav3 returned {got} for expert {e} {p}, the format says {shapes[p]}: "
                               "is exllamav3 1.6.5 installed?")
        on_linear(e, p, QuantizedLinear(tensors, "rmse" if fallback else "proxy_err", float(err),
                                        calibrated and not fallback, per))


def expected_shapes(proj: str, hidden: int, intermediate: int, bits: int) -> dict[str, tuple]:
    in_f, out_f = io_features(proj, hidden, intermediate)  # type: ignore[arg-type]
    return {"trellis": trellis_shape(in_f, out_f, bits), "suh": (in_f,), "svh": (out_f,), "mul1": ()}
