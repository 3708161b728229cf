"""Calibration statistics for EXL3 experts, with GLM-5.3-Flash run one decoder layer at a time.

The model never has to fit in memory: `LayerStreamer` builds transformers' own
`Glm5NextTextDecoderLayer` (5.24, the reference implementation) for one layer on the meta device,
loads that layer's weights from the checkpoint, runs every calibration row through it, and drops
it. What flows from layer to layer is the residual state of every row: [rows, tokens, hc, hidden]
(GLM-5.3-Flash keeps `hc_mult` hyper-connection streams), plus the indexer top-k that "shared"
indexer layers reuse from the layer before them.

At a MoE layer being converted, `MoECapture` hooks the input of the MoE block and accumulates, in
fp32, the statistics exllamav3's converter gathers for a block-sparse MLP with
`calibration_all_experts`:
  - gate/up (all experts): one Hessian sum(x x^T) over the MoE block input of every token;
  - down of expert e: sum(a_e a_e^T) with a_e = silu(gate_e(x)) * up_e(x) (GLM's swiglu clamp
    applied) for EVERY calibration token, whatever the router picked, so no expert starves.
The layer's output (normal top-k routing, original weights) then feeds the next layer.

The MTP layer is not part of transformers' model: its experts are quantized calibration-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from glmctl.quantize.exl3_backend import LayerHessians
from glmctl.quantize.exl3_source import SourceReader

from glmctl.errors import UsageError

if TYPE_CHECKING:
    import torch
    from torch import nn

# Checkpoint leaf -> transformers 5.24 module key, for the names that differ (transformers'
# conversion_mapping["glm5_next"] says the same; the per-expert and conv1d merges are below).
_RENAMES = [
    (re.compile(r"^self_attn\.(f_a_proj|f_b_proj)\."), r"self_attn.forget_gate.\1."),
    (re.compile(r"^self_attn\.(dt_bias|A_log)$"), r"self_attn.forget_gate.\1"),
    (re.compile(r"^hc_attn_(fn|base|scale)$"), r"attn_hc.\1"),
    (re.compile(r"^hc_ffn_(fn|base|scale)$"), r"ffn_hc.\1"),
]
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_CONV = re.compile(r"^self_attn\.([qkv])_conv1d\.weight$")
STATE_FILE = "calibration-state.pt"


def calibration_rows(files: list[Path], tokenizer_file: Path, tokens: int, row: int) -> torch.Tensor:
    """Token rows [n, row] (int64) from the text of `files`, at most `tokens` tokens in all."""
    import torch
    from tokenizers import Tokenizer

    if not tokenizer_file.is_file():
        raise UsageError(f"calibration needs SRC's tokenizer ({tokenizer_file} is missing)",
                         hint="copy tokenizer.json into SRC, or pass --calibration none")
    tok = Tokenizer.from_file(str(tokenizer_file))
    ids: list[int] = []
    for f in files:
        try:
            text = Path(f).read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise UsageError(f"cannot read calibration file {f}: {exc.strerror or exc}") from exc
        ids += tok.encode(text, add_special_tokens=False).ids
        if len(ids) >= tokens:
            break
    n = min(len(ids), tokens) // row
    if n == 0:
        raise UsageError(f"the calibration text has {len(ids)} tokens, fewer than one row of {row}",
                         hint="pass more text, a smaller --calibration-row, or --calibration none")
    return torch.tensor(ids[: n * row], dtype=torch.int64).view(n, row)


@dataclass
class CalibrationState:
    """What enters decoder layer `next_layer` for every calibration row."""

    next_layer: int
    hidden: torch.Tensor  # [rows, tokens, hc, hidden] in the compute dtype, on the CPU
    topk: list | None  # per row: the previous layer's indexer top-k (or None)

    def save(self, path: Path) -> None:
        import torch

        tmp = path.with_suffix(".tmp")
        torch.save({"next_layer": self.next_layer, "hidden": self.hidden, "topk": self.topk}, tmp)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> CalibrationState | None:
        import torch

        try:
            d = torch.load(path, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, EOFError):
            return None
        return cls(d["next_layer"], d["hidden"], d["topk"])


class LayerStreamer:
    """Builds one transformers decoder layer at a time with its checkpoint weights."""

    def __init__(self, source: SourceReader, text_config: dict, device: str, dtype: torch.dtype) -> None:
        from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

        self.source = source
        self.config = Glm5NextTextConfig(**{k: v for k, v in text_config.items() if k != "quantization_config"})
        self.device = device
        self.dtype = dtype
        self.prefix = _text_prefix(source)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[rows, tokens] -> [rows, tokens, hc, hidden] on the CPU (the model's stream expansion)."""
        table = self.source.weight(f"{self.prefix}embed_tokens.weight").to(self.dtype)
        x = table[ids]
        return x.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()

    def build(self, index: int) -> nn.Module:
        import torch
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextDecoderLayer

        with torch.device("meta"):
            layer = Glm5NextTextDecoderLayer(self.config, index)
        layer.to_empty(device=self.device)
        wanted = dict(layer.state_dict())
        loaded = set()
        pending_experts: dict[str, dict[int, torch.Tensor]] = {}
        pending_conv: dict[str, torch.Tensor] = {}
        prefix = f"{self.prefix}layers.{index}."
        for name in [n for n in self.source.index if n.startswith(prefix)]:
            leaf = name[len(prefix):]
            if leaf.endswith("_scale_inv"):
                continue
            if (m := _EXPERT.match(leaf)) is not None:
                pending_experts.setdefault(m[2], {})[int(m[1])] = self.source.weight(name)
                continue
            if (m := _CONV.match(leaf)) is not None:
                pending_conv[m[1]] = self.source.weight(name)
                continue
            key = leaf
            for pattern, repl in _RENAMES:
                key = pattern.sub(repl, key)
            if key not in wanted:
                continue  # e.g. indexer weights of a "shared" indexer layer (transformers reuses top-k)
            _assign(layer, key, self.source.weight(name))
            loaded.add(key)
        if pending_conv:
            _assign(layer, "self_attn.conv1d.weight", torch.cat([pending_conv[c] for c in "qkv"], dim=0))
            loaded.add("self_attn.conv1d.weight")
        if pending_experts:
            n = len(pending_experts["down_proj"])
            gate_up = torch.stack([torch.cat([pending_experts["gate_proj"][e], pending_experts["up_proj"][e]])
                                   for e in range(n)])
            _assign(layer, "mlp.experts.gate_up_proj", gate_up)
            _assign(layer, "mlp.experts.down_proj", torch.stack([pending_experts["down_proj"][e] for e in range(n)]))
            loaded |= {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
        missing = sorted(set(wanted) - loaded)
        if missing:
            raise UsageError(f"layer {index}: the checkpoint has no weights for {', '.join(missing[:4])}",
                             hint="SRC does not match transformers' glm5_next layout; use --calibration none")
        return layer.to(self.dtype).eval()

    def run(self, layer: nn.Module, state: CalibrationState, batch_rows: int = 1) -> CalibrationState:
        """Every row through `layer`; returns the state entering the next layer."""
        import torch

        outs, topks = [], []
        with torch.inference_mode():
            for r0 in range(0, state.hidden.shape[0], batch_rows):
                h = state.hidden[r0:r0 + batch_rows].to(self.device)
                b, t = h.shape[:2]
                prev = None
                if state.topk is not None and state.topk[r0] is not None:
                    prev = torch.cat(state.topk[r0:r0 + batch_rows]).to(self.device)
                out, topk = layer(
                    h, attention_mask=torch.ones(b, t, dtype=torch.bool, device=self.device),
                    position_ids=torch.arange(t, device=self.device).unsqueeze(0).expand(b, -1),
                    position_embeddings=None, cache=None, prev_topk_indices=prev)
                outs.append(out.to("cpu"))
                topks += list(topk.to("cpu").split(1)) if topk is not None else [None] * b
        return CalibrationState(state.next_layer + 1, torch.cat(outs),
                                topks if any(t is not None for t in topks) else None)


class MoECapture:
    """Accumulates `LayerHessians` at the MoE block input of one transformers decoder layer."""

    def __init__(self, layer: nn.Module, expert_chunk: int = 16) -> None:
        import torch

        moe = layer.mlp
        experts = moe.experts
        self.experts = experts
        self.limit = float(experts.swiglu_limit) if experts.swiglu_limit is not None else None
        self.chunk = expert_chunk
        h = experts.hidden_dim
        i = experts.intermediate_dim
        dev = experts.gate_up_proj.device
        self.gate_up = torch.zeros(h, h, dtype=torch.float32, device=dev)
        self.down = torch.zeros(experts.num_experts, i, i, dtype=torch.float32, device=dev)
        self.rows = 0
        self._handle = moe.register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:
        import torch
        import torch.nn.functional as F

        x = args[0].reshape(-1, args[0].shape[-1])
        xf = x.float()
        self.gate_up.addmm_(xf.t(), xf)
        self.rows += x.shape[0]
        w_gu, i = self.experts.gate_up_proj, self.experts.intermediate_dim
        for e0 in range(0, self.experts.num_experts, self.chunk):
            gu = torch.matmul(x, w_gu[e0:e0 + self.chunk].transpose(1, 2))  # [chunk, tokens, 2I]
            gate, up = gu[..., :i], gu[..., i:]
            if self.limit is not None:
                gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
            a = (F.silu(gate) * up).float()
            self.down[e0:e0 + self.chunk].baddbmm_(a.transpose(1, 2), a)

    def close(self) -> LayerHessians:
        self._handle.remove()
        return LayerHessians(self.gate_up, self.down, self.rows)


def _assign(layer: nn.Module, key: str, value: torch.Tensor) -> None:
    import torch

    target = layer.get_parameter(key) if key in dict(layer.named_parameters()) else layer.get_buffer(key)
    if tuple(target.shape) != tuple(value.shape):
        raise UsageError(f"{key}: checkpoint shape {list(value.shape)} != model shape {list(target.shape)}",
                         hint="config.json does not match the weights; use --calibration none")
    with torch.no_grad():
        target.copy_(value.to(target.dtype))


def _text_prefix(source: SourceReader) -> str:
    for p in ("model.language_model.", "model."):
        if f"{p}embed_tokens.weight" in source:
            return p
    raise UsageError("SRC has no model.embed_tokens.weight (or model.language_model.embed_tokens.weight)",
                     hint="calibration needs the embedding table; use --calibration none")
