"""Which kernel runs a decode batch of EXL3 routed experts, and the glmctl-side paths.

Paths (`GLMCTL_EXL3_DECODE`, or `Exl3MoE.decode_kernel`):
  coop       exllamav3's `exl3_moe_coop` (up to 2 x 256 slots), torch dtype conversions around it
  coop_lean  the same kernel with its inputs prepared in one launch (glmctl.kernels.exl3_coop_io)
  triton     glmctl.kernels.exl3_moe_decode: each touched expert decoded once per run of up to
             16 slots, by programs split over projections, columns and K (4 bits per weight, up
             to 64 tokens)
  fused      exllamav3's `exl3_moe` at every size
  auto       `pick_decode_path` below
Every path is CUDA-graph safe and sync-free; sizes no path holds fall through to `exl3_moe`, or
with GLMCTL_EXL3_PREFILL=triton to `TritonDecode.prefill` (glmctl.kernels.exl3_moe_prefill).
"""

from __future__ import annotations

import torch

from glmctl import switches


def decode_path_from_env() -> str:
    return switches.read("GLMCTL_EXL3_DECODE")


def pick_decode_path(tokens: int, top_k: int, bits: float, triton_ok: bool) -> str:
    """The rule `auto` follows: exllamav3's coop kernel with its inputs prepared in one launch
    (coop_lean) at every decode size. On the H200 (bench/results/exl3-h200.md, CUDA graphs, one
    TP8 rank of GLM-5.3-Flash) it was the fastest path measured at every size: 32.6 / 133 / 374 /
    601 us at 1 / 8 / 32 / 48 tokens against coop's 43 / 150 / 393 / 626 (the same kernels; the
    seven torch conversions around them cost the difference). The Triton path is not picked
    until a GPU run shows it faster (bench/gpu/exl3_round.sh times the two side by side). Sizes
    beyond the coop kernel's slots fall through to exl3_moe in the caller, whatever the rule
    says."""
    del tokens, top_k, bits, triton_ok
    return "coop_lean"


class TritonDecode:
    """glmctl.kernels.exl3_moe_decode bound to one layer's projections (workspace shared per shape)."""

    _workspaces: dict[tuple, object] = {}

    def __init__(self, gate, up, down, act_limit: float) -> None:
        self.projections = tuple((p.trellis, p.suh, p.svh) for p in (gate, up, down))
        self.act_limit = act_limit
        self.experts, self.hidden, self.intermediate = gate.experts, gate.in_features, gate.out_features

    @staticmethod
    def supports(bits: float, hidden: int, intermediate: int) -> bool:
        return bits == 4 and hidden % 256 == 0 and intermediate % 128 == 0

    def workspace(self, device, top_k: int, prefill: bool = False):
        """The shared scratch of this shape: a decode batch's, or one prefill slice's."""
        from glmctl.kernels.exl3_moe_decode import DecodeWorkspace
        from glmctl.kernels.exl3_moe_prefill import prefill_workspace

        key = (device, self.hidden, self.intermediate, top_k, self.experts, prefill)
        ws = self._workspaces.get(key)
        if ws is None:
            make = prefill_workspace if prefill else DecodeWorkspace
            ws = self._workspaces[key] = make(device, self.hidden, self.intermediate, top_k, self.experts)
        return ws

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 clamped: torch.Tensor) -> torch.Tensor:
        from glmctl.kernels.exl3_moe_decode import exl3_moe_decode

        return exl3_moe_decode(x, topk_ids, topk_weights, *self.projections, self.act_limit, clamped,
                               self.workspace(x.device, topk_ids.shape[1]), _named_config(prefill=False))

    def prefill(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                clamped: torch.Tensor) -> torch.Tensor:
        """Any number of tokens, in slices of 64-slot runs (glmctl.kernels.exl3_moe_prefill)."""
        from glmctl.kernels.exl3_moe_prefill import exl3_moe_prefill

        return exl3_moe_prefill(x, topk_ids, topk_weights, *self.projections, self.act_limit, clamped,
                                self.workspace(x.device, topk_ids.shape[1], prefill=True), _named_config(prefill=True))


def _named_config(prefill: bool):
    """GLMCTL_EXL3_TRITON_CONFIG (benchmarks: one config at every size): a decode config (16-slot
    runs) applies to decode batches, a prefill config (longer runs) to prefill; None: the default."""
    from glmctl.kernels.exl3_moe_decode import DECODE_CONFIGS

    name = switches.read("GLMCTL_EXL3_TRITON_CONFIG")
    config = DECODE_CONFIGS[name] if name else None
    return config if config is not None and (config.rows > 16) == prefill else None
