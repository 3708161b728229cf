"""Per-GPU weight bytes of GLM-5.3-Flash by module group, for each storage format.

Shapes and tensor-parallel splits follow vLLM 0.30's modules (`vllm/models/glm5next/nvidia/`):
column/row-parallel projections hold 1/tp of their rows/columns; `fused_qkv_a_proj`, the indexer's
`wq_b`/`wk_weights_proj` and KDA's `f_a`/`g_a` shards are replicated on every rank; routed experts
split their intermediate dimension across ranks (TP MoE; expert parallelism holds the same bytes).

Formats: bf16 = 2 bytes per weight; fp8 = 1 byte per weight plus one fp32 scale per 128x128 block
(the FP8 checkpoint's block quantization); exl3:B = B bits per weight in the trellis plus fp16 input
and output channel scales (`suh`, `svh`), as ExLlamaV3 stores a linear layer. Norms, mHC mixers,
routers, convolution weights and biases are never quantized.

`--kda fp8` / `--mla fp8` are what `glmctl quantize fp8`'s default selection holds in GPU memory
with glmctl's plugin (`glmctl.plugin.quantization.fp8_selection`): KDA q,k,v and o_proj in FP8, its b, f_a,
g_a, f_b, g_b in bf16; MLA q_a/kv_a, q_b, o_proj and the indexer's wq_b in FP8, kv_b_proj and the
indexer's wk + weights_proj in bf16. kv_b_proj stays bf16 whatever the checkpoint holds: vLLM's
MLA attention keeps bf16 `W_UK_T`/`W_UV` derived from it, which alias a bf16 weight but would be a
second copy of an FP8 one. The vllm lane checks these counts against the parameters vLLM builds.
"""

from __future__ import annotations

from pydantic import BaseModel

from glmctl.plan.kv_cache import cdiv
from glmctl.plan.model import ModelSpec
from glmctl.plan.serving_setup import DrafterSpec, WeightFormat, WeightFormats

BF16 = WeightFormat(kind="bf16")
VOCAB_PADDING = 64  # vLLM pads the vocabulary to a multiple of 64 before splitting it


def matrix_bytes(fmt: WeightFormat, in_features: int, out_features: int) -> int:
    """Bytes of one linear layer's weight shard (in_features x out_features) in `fmt`."""
    n = in_features * out_features
    if fmt.kind == "bf16":
        return 2 * n
    if fmt.kind == "fp8":
        return n + 4 * cdiv(in_features, 128) * cdiv(out_features, 128)
    return int(n * fmt.bits / 8) + 2 * (in_features + out_features)


class WeightGroup(BaseModel):
    group: str
    label: str
    format: str
    bytes: int


def _mla_bytes(m: ModelSpec, tp: int, fmt: WeightFormat) -> int:
    heads = m.num_attention_heads // tp
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    proj = (
        matrix_bytes(fmt, m.hidden_size, m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim)  # replicated
        + matrix_bytes(fmt, m.q_lora_rank, heads * qk)
        # kv_b_proj stays bf16 (see the module docstring)
        + matrix_bytes(BF16, m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim))
        + matrix_bytes(fmt, heads * m.v_head_dim, m.hidden_size)
        + 2 * (m.q_lora_rank + m.kv_lora_rank)  # q_a / kv_a norms
    )
    if not m.has_indexer:
        return proj
    d = m.index_head_dim
    indexer = (
        matrix_bytes(fmt, m.q_lora_rank, m.index_n_heads * d)  # wq_b, replicated
        + matrix_bytes(BF16, m.hidden_size, d + m.index_n_heads)  # wk + weights_proj, kept bf16
        + matrix_bytes(BF16, m.hidden_size, d)  # kpool compress gate
        + 4 * m.index_kpool * d  # kpool positional term, fp32
        + 2 * 4 * d  # k_norm weight + bias (fp32: vLLM's LayerNorm)
    )
    return proj + indexer


def _kda_bytes(m: ModelSpec, tp: int, fmt: WeightFormat) -> int:
    heads, d = m.linear_num_heads, m.linear_head_dim
    local = heads * d // tp
    return (
        matrix_bytes(fmt, m.hidden_size, 3 * local)  # q,k,v (sharded)
        + matrix_bytes(BF16, m.hidden_size, heads // tp + 2 * d)  # b sharded, f_a, g_a replicated: bf16
        + 2 * matrix_bytes(BF16, d, local)  # f_b, g_b: bf16
        + matrix_bytes(fmt, local, m.hidden_size)  # o_proj
        + 4 * (3 * local * m.linear_conv_kernel_dim + local + heads // tp)  # conv1d, dt_bias, A_log (fp32)
        + 2 * d  # gated output norm
    )


def _mlp_bytes(fmt: WeightFormat, hidden: int, intermediate: int) -> int:
    return 2 * matrix_bytes(fmt, hidden, intermediate) + matrix_bytes(fmt, intermediate, hidden)


def routed_experts_bytes(m: ModelSpec, tp: int, fmt: WeightFormat) -> int:
    return m.n_routed_experts * _mlp_bytes(fmt, m.hidden_size, m.moe_intermediate_size // tp)


def _moe_small_bytes(m: ModelSpec) -> int:
    """Router weight (bf16) and its fp32 score-correction bias, replicated."""
    return 2 * m.n_routed_experts * m.hidden_size + 4 * m.n_routed_experts


def _mhc_bytes(m: ModelSpec) -> int:
    """Attention and FFN mixers of the mHC residual streams of one layer (fp32, replicated)."""
    if not m.hc_mult:
        return 0
    mix = (2 + m.hc_mult) * m.hc_mult
    return 2 * 4 * (mix * m.hc_mult * m.hidden_size + mix + 3)


def weight_groups(m: ModelSpec, tp: int, formats: WeightFormats) -> list[WeightGroup]:
    """The target model's weights on one GPU, by group (the drafter is `drafter_weights`)."""
    moe, dense = m.moe_layers, m.dense_mlp_layers
    shared_i = m.moe_intermediate_size * m.n_shared_experts // tp
    vocab_rank = cdiv(cdiv(m.vocab_size, VOCAB_PADDING) * VOCAB_PADDING, tp)
    embed = matrix_bytes(formats.embeddings, vocab_rank, m.hidden_size)
    layers = m.num_hidden_layers
    other = (
        layers * (2 * 2 * m.hidden_size + _mhc_bytes(m))
        + len(moe) * _moe_small_bytes(m)
        + 2 * m.hidden_size
    )
    rows = [
        ("experts", "routed experts", formats.experts,
         len(moe) * routed_experts_bytes(m, tp, formats.experts)),
        ("dense", "shared experts + dense MLPs", formats.dense,
         len(moe) * (_mlp_bytes(formats.dense, m.hidden_size, shared_i) if shared_i else 0)
         + len(dense) * _mlp_bytes(formats.dense, m.hidden_size, m.intermediate_size // tp)),
        ("mla", "MLA + indexer projections", formats.mla, len(m.mla_layers) * _mla_bytes(m, tp, formats.mla)),
        ("kda", "KDA (linear attention) projections", formats.kda,
         len(m.kda_layers) * _kda_bytes(m, tp, formats.kda)),
        ("embeddings", "embedding + LM head", formats.embeddings, embed * (1 if m.tie_word_embeddings else 2)),
        ("other", "norms, mHC mixers, routers", BF16, other),
    ]
    return [WeightGroup(group=g, label=label, format=str(fmt), bytes=b) for g, label, fmt, b in rows]


def mtp_drafter_bytes(m: ModelSpec, tp: int, formats: WeightFormats, layers: int) -> int:
    """MTP layers (vLLM shares the target's embedding and LM head with them, llm_base_proposer.py):
    an MLA decoder layer with MoE plus the eh_proj (2H -> H, bf16, replicated) and three norms."""
    shared_i = m.moe_intermediate_size * m.n_shared_experts // tp
    per_layer = (
        _mla_bytes(m, tp, formats.mla)
        + routed_experts_bytes(m, tp, formats.experts)
        + (_mlp_bytes(formats.dense, m.hidden_size, shared_i) if shared_i else 0)
        + _moe_small_bytes(m)
        + matrix_bytes(BF16, 2 * m.hidden_size, m.hidden_size)
        + 5 * 2 * m.hidden_size
    )
    return layers * per_layer


def dflash_drafter_bytes(d: DrafterSpec, tp: int) -> int:
    """A dense bf16 drafter split over tp (attention and MLP); embedding/head shared with the target."""
    q = d.num_attention_heads * d.head_dim // tp
    kv = max(d.num_key_value_heads // tp, 1) * d.head_dim
    per_layer = (
        matrix_bytes(BF16, d.hidden_size, q + 2 * kv)
        + matrix_bytes(BF16, q, d.hidden_size)
        + _mlp_bytes(BF16, d.hidden_size, d.intermediate_size // tp)
        + 2 * 2 * d.hidden_size
    )
    return d.num_hidden_layers * per_layer
