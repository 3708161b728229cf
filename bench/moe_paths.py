"""The routed-expert paths bench/exl3.py times, by name, at one TP8 rank's GLM-5.3-Flash shape.

  exl3_coop            exllamav3's exl3_moe_coop behind the torch conversions (Exl3MoE "coop")
  exl3_coop_lean       the same kernel, inputs prepared in one launch ("coop_lean")
  exl3_auto            what the plugin runs by default (glmctl.plugin.quantization.exl3_decode.pick_decode_path)
  exl3_fused           exllamav3's exl3_moe at every size ("fused")
  exl3_triton          glmctl.kernels.exl3_moe_decode, the config picked by tokens
  exl3_triton.<cfg>    the same with one DECODE_CONFIGS entry at every size
  exl3_prefill_triton  decode as exl3_triton; above 64 tokens glmctl.kernels.exl3_moe_prefill (64-slot
                       runs; .<cfg> names a prefill config) instead of exllamav3's exl3_moe
  fp8_torch, bf16_torch   sort + torch._scaled_grouped_mm / torch._grouped_mm (sm_90 stand-ins)
  fp8_vllm.<cfg>       vLLM's fused_moe Triton kernel (bench/moe_fp8_vllm.py), torch glue included
  fp8_vllm_k.<cfg>     the same kernel's two launches alone (glue excluded: the kernel's own time)
<cfg> for fp8_vllm is `vllm_default` (vLLM 0.30's rule for this untuned shape) or a SWEEP name.
Each path is built lazily: `Paths.get(name)` -> (callable(x, ids, w, i), bytes_per_expert, note), the
callable taking the index i of the routing it is given (for per-routing precomputed state).
"""

from __future__ import annotations

import math
import os

EXPERTS, TOP_K, HIDDEN, INTER_FULL, TP = 288, 8, 4096, 2048, 8
INTER = INTER_FULL // TP
BITS = 4
SWIGLU_LIMIT = 10.0

EXL3_MODES = {"exl3_coop": "coop", "exl3_coop_lean": "coop_lean", "exl3_auto": "auto", "exl3_fused": "fused",
              "exl3_triton": "triton", "exl3_prefill_triton": "triton"}
PREFILL_MODES = {"exl3_prefill_triton": "triton"}  # Exl3MoE.prefill_mode; every other path: "recon"


class TorchExperts:
    """Sort by expert, grouped GEMMs, SwiGLU, weighted scatter-add: sync-free and capturable."""

    def __init__(self, torch, device, fp8: bool) -> None:
        self.torch, self.fp8 = torch, fp8
        g = torch.Generator(device=device).manual_seed(1)
        w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=device, generator=g, dtype=torch.bfloat16) / 64
        w2 = torch.randn(EXPERTS, HIDDEN, INTER, device=device, generator=g, dtype=torch.bfloat16) / 16
        if fp8:
            self.w13, self.s13 = self._quant_rows(w13)
            self.w2, self.s2 = self._quant_rows(w2)
        else:
            self.w13, self.w2 = w13, w2

    def _quant_rows(self, w):
        torch = self.torch
        scale = w.float().abs().amax(-1).clamp(min=1e-8) / 448.0  # per output channel
        return (w.float() / scale.unsqueeze(-1)).to(torch.float8_e4m3fn), scale

    @property
    def weight_bytes(self) -> int:
        ts = [self.w13, self.w2] + ([self.s13, self.s2] if self.fp8 else [])
        return sum(t.numel() * t.element_size() for t in ts)

    def _gemm(self, a, w, s, offs):
        torch = self.torch
        if not self.fp8:
            return torch._grouped_mm(a, w.transpose(1, 2), offs=offs)
        a_scale = a.float().abs().amax(-1).clamp(min=1e-8) / 448.0
        a8 = (a.float() / a_scale.unsqueeze(-1)).to(torch.float8_e4m3fn)
        return torch._scaled_grouped_mm(a8, w.transpose(1, 2), a_scale, s, offs=offs, out_dtype=torch.bfloat16)

    def __call__(self, x, ids, weights):
        torch = self.torch
        flat = ids.reshape(-1).long()
        order = torch.argsort(flat)
        tok = torch.div(order, ids.shape[1], rounding_mode="floor")
        counts = torch.zeros(EXPERTS, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        offs = torch.cumsum(counts, 0).to(torch.int32)
        gu = self._gemm(x[tok], self.w13, self.s13 if self.fp8 else None, offs)
        g = gu[:, :INTER].float().clamp(max=SWIGLU_LIMIT)
        u = gu[:, INTER:].float().clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
        y = self._gemm((torch.nn.functional.silu(g) * u).to(torch.bfloat16), self.w2, self.s2 if self.fp8 else None,
                       offs)
        out = torch.zeros(x.shape[0], HIDDEN, dtype=torch.float32, device=x.device)
        out.index_add_(0, tok, y.float() * weights.reshape(-1)[order].float().unsqueeze(1))
        return out.to(x.dtype)


def exl3_layer(torch, device):
    from glmctl.plugin.quantization.exl3_experts import Exl3MoE, Exl3Projection

    g = torch.Generator(device=device).manual_seed(0)

    def proj(k, n):
        trellis = torch.randint(-2**15, 2**15, (EXPERTS, k // 16, n // 16, 16 * BITS), dtype=torch.int16,
                                device=device, generator=g)
        scale = k ** -0.25  # |suh * svh| ~ 1/sqrt(k): unit-variance outputs, fp16-safe
        suh = (torch.randint(0, 2, (EXPERTS, k), device=device, generator=g) * 2 - 1).half() * scale
        svh = (torch.randint(0, 2, (EXPERTS, n), device=device, generator=g) * 2 - 1).half() * scale
        return Exl3Projection(trellis, suh, svh)

    return Exl3MoE(proj(HIDDEN, INTER), proj(HIDDEN, INTER), proj(INTER, HIDDEN), BITS, SWIGLU_LIMIT)


def fp8_block_bytes(block: int = 128) -> int:
    """Per-layer, per-rank bytes of block-FP8 experts as vLLM 0.30 holds them (e4m3 + fp32 scales)."""
    per = 0
    for k, n in ((HIDDEN, INTER), (HIDDEN, INTER), (INTER, HIDDEN)):
        per += k * n + math.ceil(k / block) * math.ceil(n / block) * 4
    return EXPERTS * per


class Paths:
    """Builds each path once, on first use, and keeps the layers they share."""

    def __init__(self, torch, device, vllm_fused_moe: str | None = None) -> None:
        self.torch, self.device, self.vllm_fused_moe = torch, device, vllm_fused_moe
        self._exl3 = self._torch = self._vllm = None
        self._torch_layers: dict[bool, TorchExperts] = {}
        self.routes: dict[tuple, list] = {}  # (config, tokens) -> per-routing alignment (fp8_vllm)

    @property
    def exl3(self):
        if self._exl3 is None:
            self._exl3 = exl3_layer(self.torch, self.device)
        return self._exl3

    def vllm(self):
        if self._vllm is None:
            if not self.vllm_fused_moe or not os.path.exists(self.vllm_fused_moe):
                raise RuntimeError(f"no vLLM fused_moe.py at {self.vllm_fused_moe!r} (--vllm-fused-moe)")
            from moe_fp8_vllm import BlockFp8Experts, load_kernel

            self._vllm = BlockFp8Experts(self.torch, self.device, load_kernel(self.vllm_fused_moe), EXPERTS, HIDDEN,
                                         INTER, TOP_K, SWIGLU_LIMIT)
        return self._vllm

    def supports(self, name: str, tokens: int) -> bool:
        if name.startswith("exl3_prefill_triton"):
            return True
        if name.startswith("exl3_triton"):
            from glmctl.kernels.exl3_moe_decode import DECODE_CONFIGS, MAX_TOKENS

            if tokens > MAX_TOKENS:
                return False
            cfg = DECODE_CONFIGS.get(name.partition(".")[2])
            # the workspace holds split-k partials for split_k * tokens <= 2 * MAX_TOKENS
            return cfg is None or ((HIDDEN // cfg.block_k) % cfg.split_k == 0 and cfg.split_k * tokens <= 2 * MAX_TOKENS)
        return True

    def get(self, name: str, inputs: list):
        """(fn(x, ids, w, i), bytes per expert, note) for the routings `inputs`."""
        torch = self.torch
        base, _, cfg = name.partition(".")
        if base in EXL3_MODES:
            layer, mode = self.exl3, EXL3_MODES[base]

            def fn(x, ids, w, i):
                layer.decode_kernel = mode  # read while a graph is captured: each capture bakes one path
                layer.prefill_mode = PREFILL_MODES.get(base, "recon")
                if cfg:
                    os.environ["GLMCTL_EXL3_TRITON_CONFIG"] = cfg
                try:
                    return layer(x, ids, w)
                finally:
                    os.environ.pop("GLMCTL_EXL3_TRITON_CONFIG", None)
            return fn, layer.weight_bytes / EXPERTS, ""
        if base in ("fp8_torch", "bf16_torch"):
            fp8 = base == "fp8_torch"
            if fp8 not in self._torch_layers:
                self._torch_layers[fp8] = TorchExperts(torch, self.device, fp8)
            layer = self._torch_layers[fp8]
            return (lambda x, ids, w, i: layer(x, ids, w)), layer.weight_bytes / EXPERTS, ""
        if base in ("fp8_vllm", "fp8_vllm_k"):
            from moe_fp8_vllm import SWEEP, vllm_default

            layer = self.vllm()
            tokens = inputs[0][0].shape[0]
            config = vllm_default(tokens) if cfg in ("", "vllm_default") else {c.name: c for c in SWEEP}[cfg]
            routes = [layer.align(ids, config) for _, ids, _ in inputs]
            pre = None
            if base == "fp8_vllm_k":  # quantized inputs of both GEMMs, made once outside the graph
                pre = []
                for x, _ids, _ in inputs:
                    a = torch.randn((x.shape[0] * TOP_K, INTER), device=x.device, dtype=torch.bfloat16)
                    pre.append((*layer.quant(x), *layer.quant(a)))
            note = f"{config.as_dict()} swap_ab={config.swap_ab} smem={config.smem_bytes()} B"

            def fn(x, ids, w, i):
                return layer.forward(x, ids, w, routes[i], config, pre[i] if pre else None)
            return fn, layer.weight_bytes / EXPERTS, note
        raise KeyError(f"unknown path {name!r}")
