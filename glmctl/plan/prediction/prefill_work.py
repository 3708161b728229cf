"""The work one TP8 rank's prefill chunk does, by kernel kind: FLOPs and the bytes it must move
(`chunk_work`). The prefill record (`bench/rank_prefill.py`) sets each kind's measured time against
them, and the node prediction takes each kind of a measured chunk on a roofline with them
(`node_prefill`). A stated model, not a measurement; pure Python.

One rank = the TP1 rank model of glmctl.plan.prediction.rank.
T = chunk tokens, c = context before the chunk, c_mid = c + T/2 (the keys an average query sees):
  - routed_experts: T x top-8 x three (h x I/8) matmuls x 2 per MoE layer; every expert's weights
    read (T x 8 / 288 = 57 picks per expert at T = 2,048), activations in and out;
  - fp8_linear (vLLM's Marlin W8A16: bf16 MMA): KDA q,k,v,o; MLA q_a+kv_a, q_b, o and the
    indexer's wq_b; shared experts; dense MLPs. Weights read once, activations in and out;
  - dense_gemm (bf16): KDA b, f_a, g_a, f_b, g_b; MLA's absorbed W_UK and W_UV (latent attention);
    the indexer's wk, weights_proj and kpool gate; the router; MTP's eh_proj; one LM-head row;
  - mla_attention: 4 x T x heads x min(top-k + kpool - 1, c_mid) x 512 (QK and PV over the selected
    latent rows, as bench/kernels.py counts it); bytes: every query's gathered rows;
  - indexer: T x 32 heads x 128 x (c_mid / 16 pooled keys) x 2, none while c + T <= top-k (the
    causal set is taken whole); bytes: the pooled keys, fp32 logits written and read, top-k out;
  - kda: the chunked delta rule, 6 d^2 + 10 C d per head and token (C = 64: K K^T, w and u, state
    update and read-out, Q K^T, A V; gates and conv not counted); bytes: q, k, v, g, o, chunk states;
  - norms_mhc: two mHC blocks per target layer, each a [T, 4h] x [4h, 24] mix; bytes: the four
    residual streams read and written (bf16) and the block's input and output.
The MTP drafter's layer (MLA + MoE + shared expert + eh_proj) runs once per chunk (`drafter_passes`;
the kernel table's MoE calls per chunk check it). """

from __future__ import annotations

from glmctl.plan.kv_cache import indexer_state_bytes, mla_bytes_per_token
from glmctl.plan.model import ModelSpec
from glmctl.plan.prediction.rank import rank_model_spec, variant_formats
from glmctl.plan.weights import BF16, matrix_bytes, routed_experts_bytes

KDA_CHUNK = 64  # FLA's chunk length (BT) in the chunked delta rule
MODELLED = ("routed_experts", "fp8_linear", "dense_gemm", "mla_attention", "indexer", "kda", "norms_mhc")


def _lin(t: int, fmt, n_in: int, n_out: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one linear on t tokens: weights once, bf16 activations in and out."""
    return 2.0 * t * n_in * n_out, matrix_bytes(fmt, n_in, n_out) + 2.0 * t * (n_in + n_out)


def _add(acc: dict, name: str, work: tuple[float, float], times: float = 1.0) -> None:
    f, b = acc.get(name, (0.0, 0.0))
    acc[name] = (f + times * work[0], b + times * work[1])


def chunk_work(m: ModelSpec, context: int, tokens: int = 2048, drafter_passes: int = 1, variant: str = "exl3",
               kv: str = "fp8", tp: int = 8) -> dict[str, tuple[float, float]]:
    """(FLOPs, bytes) per component of one rank's prefill chunk (the model of the module doc)."""
    r = rank_model_spec(m, tp)
    fmt = variant_formats(variant)
    t, h, p = tokens, r.hidden_size, drafter_passes
    n_kda, n_mla, n_moe = len(r.kda_layers), len(r.mla_layers) + p, len(r.moe_layers) + p
    heads, qk, kv_r = r.num_attention_heads, r.qk_nope_head_dim + r.qk_rope_head_dim, r.kv_lora_rank
    k_heads, d = r.linear_num_heads, r.linear_head_dim
    w: dict[str, tuple[float, float]] = {}
    # routed experts: intermediate split over ranks (rank model's moe_intermediate_size)
    i_r = r.moe_intermediate_size
    e_flop = 2.0 * t * r.num_experts_per_tok * 3 * h * i_r
    e_bytes = routed_experts_bytes(m, tp, fmt.experts) + t * h * (2 + 4) + t * r.num_experts_per_tok * 3 * i_r * 2
    _add(w, "routed_experts", (e_flop, e_bytes), n_moe)
    # FP8 linears
    local = k_heads * d
    for n_in, n_out in ((h, 3 * local), (local, h)):
        _add(w, "fp8_linear", _lin(t, fmt.kda, n_in, n_out), n_kda)
    for n_in, n_out in ((h, r.q_lora_rank + kv_r + r.qk_rope_head_dim), (r.q_lora_rank, heads * qk),
                        (heads * r.v_head_dim, h), (r.q_lora_rank, r.index_n_heads * r.index_head_dim)):
        _add(w, "fp8_linear", _lin(t, fmt.mla, n_in, n_out), n_mla)
    shared = r.moe_intermediate_size * r.n_shared_experts
    for n_in, n_out in ((h, 2 * shared), (shared, h)):
        _add(w, "fp8_linear", _lin(t, fmt.dense, n_in, n_out), n_moe)
    for n_in, n_out in ((h, 2 * r.intermediate_size), (r.intermediate_size, h)):
        _add(w, "fp8_linear", _lin(t, fmt.dense, n_in, n_out), len(r.dense_mlp_layers))
    # bf16 GEMMs
    for n_in, n_out in ((h, k_heads + 2 * d), (d, local), (d, local)):
        _add(w, "dense_gemm", _lin(t, BF16, n_in, n_out), n_kda)
    absorbed = 2.0 * t * heads * (r.qk_nope_head_dim * kv_r + kv_r * r.v_head_dim)
    _add(w, "dense_gemm", (absorbed, 2.0 * heads * kv_r * (r.qk_nope_head_dim + r.v_head_dim)
                           + 2.0 * t * heads * 2 * (qk + kv_r)), n_mla)
    _add(w, "dense_gemm", _lin(t, BF16, h, 2 * r.index_head_dim + r.index_n_heads), n_mla)
    _add(w, "dense_gemm", _lin(t, BF16, h, r.n_routed_experts), n_moe)
    _add(w, "dense_gemm", _lin(t, BF16, 2 * h, h), p)
    _add(w, "dense_gemm", _lin(1, BF16, h, r.vocab_size), 1 + p)
    # sparse MLA over the selected latent rows
    c_mid = context + t / 2
    selected = min(r.index_topk + r.index_kpool - 1, c_mid) if r.index_topk else c_mid
    row = mla_bytes_per_token(r, kv)
    _add(w, "mla_attention", (4.0 * t * heads * selected * kv_r,
                              t * selected * row + 2.0 * t * heads * kv_r * 2 + t * row), n_mla)
    # indexer logits + top-k over the pooled keys
    if r.index_topk and context + t > r.index_topk:
        pools = c_mid / r.index_kpool
        i_flop = 2.0 * t * r.index_n_heads * r.index_head_dim * pools
        i_bytes = ((context + t) / r.index_kpool * indexer_state_bytes(r) + 2 * 4.0 * t * pools
                   + 4.0 * t * r.index_topk + t * r.index_n_heads * (r.index_head_dim + 4))
        _add(w, "indexer", (i_flop, i_bytes), n_mla)
    else:
        _add(w, "indexer", (0.0, 4.0 * t * (r.index_topk or 0)), n_mla)
    # KDA chunked delta rule
    per_token = 6.0 * d * d + 10.0 * KDA_CHUNK * d
    k_bytes = 2.0 * t * local * 5 + 2 * 4.0 * k_heads * d * d * (1 + t / KDA_CHUNK)
    _add(w, "kda", (t * k_heads * per_token, k_bytes), n_kda)
    # mHC: two blocks per target layer (the drafter has none)
    n = r.hc_mult
    if n:
        mix = (2 + n) * n
        blocks = 2 * r.num_hidden_layers
        _add(w, "norms_mhc", (2.0 * t * n * h * mix, 4.0 * mix * n * h + t * n * h * 2 * 2 + t * h * 2 * 2), blocks)
    return w
