"""The bytes one decode step of a TP rank of GLM-5.3-Flash must move, by kernel kind: the floor each
kind is held to (`bench/rank_decode.py`) and the bandwidth part of the node prediction's roofline
(`node_prediction`). A stated model, not a measurement; pure Python.

  - passes per step: the target forward on S x (k + 1) tokens, then the MTP drafter's k passes of
    its one layer on [S x (k + 1), S, ...] tokens (vLLM 0.30's V2 runner);
  - routed experts: the distinct experts of a pass under uniform top-8 routing,
    E (1 - (1 - 8/E)^T), x one expert's bytes on the rank (`glmctl.plan.weights`), per MoE layer
    (an upper bound: correlated hidden states may touch fewer);
  - FP8 / bf16 linears: the weights of every linear the pass runs once (`glmctl.plan.weights`, the
    FP8 and bf16 shares of each group), the LM head once per pass, the router once per MoE layer;
  - mHC: the mixer weights (fp32) and the residual streams read and written, per block;
  - attention: sparse MLA reads top-k cached latents per token and MLA layer, the indexer reads
    every pooled key of the context, KDA reads and writes each request's recurrent state;
  - activations of the linears are counted once per pass (small beside the weights).
"""

from __future__ import annotations

from glmctl.plan.kv_cache import indexer_state_bytes, kda_state_bytes, mla_bytes_per_token
from glmctl.plan.model import ModelSpec
from glmctl.plan.prediction.rank import variant_formats
from glmctl.plan.weights import BF16, matrix_bytes, routed_experts_bytes, weight_groups


def distinct_experts(tokens: int, experts: int, top_k: int) -> float:
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def _fp8_bf16_split(m, formats, tp: int) -> dict[str, tuple[int, int]]:
    """(FP8 bytes, bf16 bytes) of each linear group: an FP8 group's bf16-held parts (kv_b_proj, KDA's
    b/f/g projections, the indexer's wk) are what stays when the group is priced in bf16 instead.
    The FP8 share is priced from the difference (2 - 1 bytes per weight; block scales, 1/16384 of it,
    inside the rounding)."""
    out = {}
    fp8_groups = {g.group: g.bytes for g in weight_groups(m, tp, formats)}
    for group in ("dense", "mla", "kda"):
        as_bf16 = {g.group: g.bytes for g in weight_groups(m, tp, formats.model_copy(update={group: BF16}))}
        fp8 = as_bf16[group] - fp8_groups[group] if getattr(formats, group).kind == "fp8" else 0
        out[group] = (fp8, fp8_groups[group] - fp8)
    return out


def step_bytes(m: ModelSpec, sessions: int, context: int, mtp: int, variant: str = "exl3",
               tp: int = 8) -> dict[str, float]:
    """Bytes each kind must move in one decode step of a rank (the model of the module doc)."""
    formats = variant_formats(variant)
    t_target = sessions * (mtp + 1)
    drafter = [t_target] + [sessions] * max(0, mtp - 1) if mtp else []
    per_expert = routed_experts_bytes(m, tp, formats.experts) / m.n_routed_experts
    moe, h = len(m.moe_layers), m.hidden_size
    experts = per_expert * (moe * distinct_experts(t_target, m.n_routed_experts, m.num_experts_per_tok)
                            + sum(distinct_experts(t, m.n_routed_experts, m.num_experts_per_tok) for t in drafter))
    split = _fp8_bf16_split(m, formats, tp)
    mla_layers = len(m.mla_layers)
    # the drafter's one MLA layer + shared expert: its FP8 and bf16 shares as one target MLA layer + one shared MLP
    shared_i = m.moe_intermediate_size * m.n_shared_experts // tp
    shared_fp8 = 2 * matrix_bytes(formats.dense, h, shared_i) + matrix_bytes(formats.dense, shared_i, h)
    mla_fp8_1, mla_bf16_1 = split["mla"][0] / mla_layers, split["mla"][1] / mla_layers
    fp8 = sum(v[0] for v in split.values()) + len(drafter) * (mla_fp8_1 + shared_fp8)
    vocab_rank = -(-m.vocab_size // 64) * 64 // tp
    head = matrix_bytes(BF16, vocab_rank, h)
    router = 2 * m.n_routed_experts * h
    eh_proj = matrix_bytes(BF16, 2 * h, h)
    bf16 = (sum(v[1] for v in split.values()) + (1 + len(drafter)) * head + moe * router
            + len(drafter) * (mla_bf16_1 + router + eh_proj))
    n = m.hc_mult
    mix = (2 + n) * n
    blocks = 2 * m.num_hidden_layers
    mhc = blocks * (4 * mix * n * h + t_target * n * h * 2 * 2 + t_target * h * 2 * 2)
    tokens_all = t_target * mla_layers + sum(drafter)
    mla = tokens_all * min(m.index_topk or context, context) * mla_bytes_per_token(m, "fp8")
    pooled = -(-context // m.index_kpool)
    indexer = (mla_layers + len(drafter)) * sessions * pooled * indexer_state_bytes(m)
    conv, recurrent = kda_state_bytes(m, tp, mtp)
    kda = len(m.kda_layers) * sessions * 2 * (conv + recurrent)
    return {"routed_experts": experts, "fp8_linear": fp8, "dense_gemm": bf16, "norms_mhc": mhc,
            "mla_attention": mla, "indexer": indexer, "kda": kda}
