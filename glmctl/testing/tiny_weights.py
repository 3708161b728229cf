"""The tensors of the tiny GLM-5.3-Flash checkpoint: names, shapes, dtypes and how each is drawn.

Names are the *checkpoint* names of GLM-5.3-Flash, the ones vLLM 0.30's `Glm5NextModel.load_weights`
/ `Glm5NextMTP.load_weights` map and transformers 5.24's `glm5_next` conversion mapping reads
(per-expert `mlp.experts.{e}.{gate,up,down}_proj`, `self_attn.{q,k,v}_conv1d`, `self_attn.f_a_proj`,
`hc_attn_fn`, `indexer.wk`, ...). Dtypes follow the parameter dtypes vLLM allocates: fp32 for the
mHC mixers, the KDA gate/conv parameters, the indexer's pool positional bias and key LayerNorm and
the router (transformers keeps the router in fp32 too); bf16 for every other matrix and norm.

Every value is rounded to bf16 precision before it is stored, whatever the stored dtype: a side that
holds a tensor in bf16 (vLLM's router) and a side that holds it in fp32 (transformers) then see the
same numbers, and parity checks measure compute precision only.

Each tensor is drawn from its own generator seeded by sha256(seed, name), so a tensor's values do not
depend on which other tensors exist (changing --layers leaves layer 0 as it was).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Literal

from glmctl.quantize.glm5next import EXPERT_PROJECTIONS, Projection, projections
from glmctl.testing.tiny_spec import TinySpec

if TYPE_CHECKING:
    import torch

Dtype = Literal["bf16", "fp32"]


@dataclass(frozen=True)
class TensorPlan:
    """One checkpoint tensor: what it is called, its shape and dtype, and how it is initialised.

    `init` is (kind, a, b): "normal" -> a + b * N(0, 1); "uniform" -> U(a, b);
    "softplus_inv_uniform_log" -> inverse softplus of exp(U(a, b)) (the KDA dt bias);
    "copy" -> the tensor named by `source`.
    """

    name: str
    shape: tuple[int, ...]
    dtype: Dtype
    init: tuple[str, float, float]
    source: str | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _linear(name: str, out_f: int, in_f: int, gain: float = 1.0, dtype: Dtype = "bf16") -> TensorPlan:
    # std 1/sqrt(fan_in): unit-variance activations, so logits and indexer scores are spread out
    # (clear top-1 margins and few near-tie pool selections; transformers' 0.02 gives near-flat ones).
    return TensorPlan(name, (out_f, in_f), dtype, ("normal", 0.0, gain / math.sqrt(in_f)))


def _norm(name: str, dim: int, dtype: Dtype = "bf16") -> TensorPlan:
    # 1 + 0.1 N(0,1), not ones: an implementation that drops a norm weight then changes the output
    # (vLLM's CPU mHC ops drop it; with all-ones weights no test would notice).
    return TensorPlan(name, (dim,), dtype, ("normal", 1.0, 0.1))


def _mhc(prefix: str, spec: TinySpec) -> list[TensorPlan]:
    n = spec.hc_mult
    mix = (2 + n) * n
    out = []
    for site in ("attn", "ffn"):
        out += [
            TensorPlan(f"{prefix}hc_{site}_fn", (mix, n * spec.hidden_size), "fp32", ("normal", 0.0, 0.02)),
            TensorPlan(f"{prefix}hc_{site}_base", (mix,), "fp32", ("normal", 0.0, 0.1)),
            TensorPlan(f"{prefix}hc_{site}_scale", (3,), "fp32", ("normal", 1.0, 0.1)),
        ]
    return out


def _dims(spec: TinySpec) -> dict[str, int]:
    """The spec under config.json's names, as `Projection.shape` reads them (no RoPE dims)."""
    return {**asdict(spec), "qk_rope_head_dim": 0}


def _projections(prefix: str, rows: tuple[Projection, ...], spec: TinySpec) -> list[TensorPlan]:
    dims = _dims(spec)
    return [_linear(f"{prefix}{p.leaf}.weight", *p.shape(dims)) for p in rows]


def _kda(prefix: str, spec: TinySpec) -> list[TensorPlan]:
    d, nh, k = spec.linear_head_dim, spec.linear_num_heads, spec.linear_conv_kernel_dim
    p = nh * d
    a = f"{prefix}self_attn."
    return [
        *_projections(prefix, projections("kda"), spec),
        # Depthwise causal conv, [channels, 1, kernel] as transformers' Conv1d stores it.
        *(TensorPlan(f"{a}{x}_conv1d.weight", (p, 1, k), "fp32", ("normal", 0.0, 0.5)) for x in "qkv"),
        # dt in [1e-3, 1e-1] through inverse softplus (the FLA init transformers uses).
        TensorPlan(f"{a}dt_bias", (p,), "fp32", ("softplus_inv_uniform_log", math.log(1e-3), math.log(1e-1))),
        # Per-head decay rate exp(A_log) in [0.6, 2.7]: heads forget at visibly different speeds.
        TensorPlan(f"{a}A_log", (nh,), "fp32", ("uniform", -0.5, 1.0)),
        _norm(f"{a}o_norm.weight", d),
    ]


def _mla(prefix: str, spec: TinySpec, with_indexer: bool) -> list[TensorPlan]:
    h = spec.hidden_size
    a = f"{prefix}self_attn."
    attention = tuple(p for p in projections("mla") if not p.leaf.startswith("self_attn.indexer."))
    out = [
        *_projections(prefix, attention, spec),
        _norm(f"{a}q_a_layernorm.weight", spec.q_lora_rank),
        _norm(f"{a}kv_a_layernorm.weight", spec.kv_lora_rank),
    ]
    if with_indexer:
        i = f"{a}indexer."
        ihd = spec.index_head_dim
        out += [
            *_projections(prefix, projections("mla", "self_attn.indexer."), spec),
            _norm(f"{i}k_norm.weight", ihd, dtype="fp32"),
            TensorPlan(f"{i}k_norm.bias", (ihd,), "fp32", ("normal", 0.0, 0.1)),
            # Pool gate and positional bias: random so the softmax pooling weights differ per token
            # and per slot (transformers' ones/zeros init would make every pool a plain mean).
            TensorPlan(f"{i}index_kpool_compress_ape", (spec.index_kpool, ihd), "fp32", ("normal", 0.0, 0.5)),
            _linear(f"{i}index_kpool_compress_gate", ihd, h),
        ]
    return out


def _mlp(prefix: str, spec: TinySpec, kind: str) -> list[TensorPlan]:
    h = spec.hidden_size
    m = f"{prefix}mlp."
    dense = tuple(p for p in projections("mlp") if not p.leaf.startswith("mlp.shared_experts."))
    if kind == "dense":
        return _projections(prefix, dense, spec)
    e = spec.n_routed_experts
    out = [
        _linear(f"{m}gate.weight", e, h, dtype="fp32"),
        # Non-zero correction bias: an implementation that ignores it picks other experts.
        TensorPlan(f"{m}gate.e_score_correction_bias", (e,), "fp32", ("normal", 0.0, 0.05)),
    ]
    for x in range(e):
        out += _projections(f"{m}experts.{x}.", EXPERT_PROJECTIONS, spec)
    return out + _projections(prefix, projections("mlp", "mlp.shared_experts."), spec)


def tensor_plan(spec: TinySpec) -> list[TensorPlan]:
    """Every tensor of the checkpoint, in a stable order (main model, then the MTP layers)."""
    h, vocab = spec.hidden_size, spec.vocab_size
    layer_types, indexer_types, mlp_types = spec.layer_types(), spec.indexer_types(), spec.mlp_layer_types()
    plan = [TensorPlan("model.embed_tokens.weight", (vocab, h), "bf16", ("normal", 0.0, 1.0))]
    for idx in range(spec.layers):
        p = f"model.layers.{idx}."
        plan += [_norm(f"{p}input_layernorm.weight", h), _norm(f"{p}post_attention_layernorm.weight", h)]
        plan += _mhc(p, spec)
        if layer_types[idx] == "linear_attention":
            plan += _kda(p, spec)
        else:
            # A "shared" layer reuses the previous layer's top-k in transformers and has no indexer
            # there; vLLM 0.30 ignores indexer_types and builds (and strictly loads) an indexer in
            # every MLA layer, so the weights are written unless the spec says otherwise.
            shared = indexer_types[idx] == "shared"
            plan += _mla(p, spec, with_indexer=not shared or spec.shared_indexer_weights)
        plan += _mlp(p, spec, mlp_types[idx])
    plan += [
        _norm("model.norm.weight", h),
        _linear("lm_head.weight", vocab, h, gain=2.0),  # logits ~ N(0, 4): decisive greedy picks
    ]
    for idx in range(spec.layers, spec.layers + spec.mtp_layers):
        # The MTP layer as Glm5NextMTP loads it: an MLA(+indexer) decoder layer without mHC, with the
        # last base layer's MLP kind, plus enorm/hnorm/eh_proj/shared_head and its own copies of the
        # embedding and head (vLLM shares the target's embedding but its strict load check wants the
        # tensor; DeepSeek-style checkpoints ship both copies).
        p = f"model.layers.{idx}."
        plan += [
            TensorPlan(f"{p}embed_tokens.weight", (vocab, h), "bf16", ("copy", 0, 0), "model.embed_tokens.weight"),
            _norm(f"{p}enorm.weight", h),
            _norm(f"{p}hnorm.weight", h),
            _linear(f"{p}eh_proj.weight", h, 2 * h),
            _norm(f"{p}input_layernorm.weight", h),
            _norm(f"{p}post_attention_layernorm.weight", h),
            *_mla(p, spec, with_indexer=True),
            *_mlp(p, spec, mlp_types[-1]),
            _norm(f"{p}shared_head.norm.weight", h),
            TensorPlan(f"{p}shared_head.head.weight", (vocab, h), "bf16", ("copy", 0, 0), "lm_head.weight"),
        ]
    return plan


def _generator(seed: int, name: str) -> torch.Generator:
    import torch

    digest = hashlib.sha256(f"glmctl-tiny:{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def _draw(t: TensorPlan, seed: int) -> torch.Tensor:
    import torch

    kind, a, b = t.init
    g = _generator(seed, t.name)
    if kind == "normal":
        x = torch.randn(t.shape, generator=g, dtype=torch.float32) * b + a
    elif kind == "uniform":
        x = torch.rand(t.shape, generator=g, dtype=torch.float32) * (b - a) + a
    elif kind == "softplus_inv_uniform_log":
        dt = (torch.rand(t.shape, generator=g, dtype=torch.float32) * (b - a) + a).exp().clamp_min(1e-4)
        x = dt + torch.log(-torch.expm1(-dt))
    else:
        raise ValueError(f"unknown init {kind!r} for {t.name}")
    return x


def materialize(plan: list[TensorPlan], seed: int, on_tensor: Callable[[int], None] | None = None) -> dict:
    """Draw every tensor of `plan`; returns {name: torch.Tensor} in plan order."""
    import torch

    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    out: dict[str, torch.Tensor] = {}
    for t in plan:
        if t.init[0] == "copy":
            assert t.source is not None
            out[t.name] = out[t.source].clone()
        else:
            # Round to bf16 first (see the module docstring), then store in the planned dtype.
            out[t.name] = _draw(t, seed).to(torch.bfloat16).to(dtypes[t.dtype]).contiguous()
        if on_tensor is not None:
            on_tensor(t.numel)
    return out
