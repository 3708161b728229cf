"""One tensor-parallel rank as a TP1 model: its `ModelSpec`, and the weight bytes the planner predicts
for it next to what one GPU of the TP node holds.

The split follows vLLM 0.30's module sharding (table in `glmctl.testing.rank_config`, which writes
the checkpoint directory): attention heads, KDA heads, expert / shared-expert / dense intermediate
sizes and the padded vocabulary are divided by tp; everything replicated (latent, indexer, router,
mHC, norms, MTP's eh_proj) is kept. `rank_weights()` is the check the rank simulation makes: the
bytes vLLM loads for the TP1 rank model should equal the planner's per-GPU figure for the TP node,
group by group, except the embedding and LM head, where vLLM pads the rank vocabulary to 64 again.
"""

from __future__ import annotations

from pydantic import BaseModel

from glmctl.errors import UsageError
from glmctl.plan.kv_cache import cdiv
from glmctl.plan.model import ModelSpec, load_model_spec
from glmctl.plan.serving_setup import WeightFormat, WeightFormats
from glmctl.plan.weights import (
    BF16,
    VOCAB_PADDING,
    WeightGroup,
    matrix_bytes,
    mtp_drafter_bytes,
    weight_groups,
)

GIB = 1 << 30
# The rank-config variants (`glmctl testing rank-config --experts`) as the checkpoint formats the
# planner knows: fp8 = the FP8 checkpoint; exl3 = EXL3 routed experts over the FP8 checkpoint.
VARIANT_CHECKPOINT = {"bf16": "bf16", "fp8": "fp8", "exl3": "exl3:{bits}"}
FP8_BLOCK = 128


def rank_model_spec(model: ModelSpec, tp: int) -> ModelSpec:
    """The TP1 model one rank of TP `tp` is (refuses splits vLLM refuses, or FP8 blocks would)."""
    if tp < 1 or tp & (tp - 1):
        raise UsageError(f"--tp {tp} is not a power of two", hint="use 1, 2, 4 or 8")
    padded_vocab = cdiv(model.vocab_size, VOCAB_PADDING) * VOCAB_PADDING
    for what, n, unit in (("attention heads", model.num_attention_heads, 1),
                          ("KDA heads", model.linear_num_heads, 1),
                          ("expert intermediate size", model.moe_intermediate_size, FP8_BLOCK),
                          ("dense intermediate size", model.intermediate_size, FP8_BLOCK),
                          ("padded vocabulary", padded_vocab, 1)):
        if n % (tp * unit):
            raise UsageError(f"--tp {tp} does not split the model's {what} ({n})"
                             + (f" into multiples of {unit} (FP8 blocks)" if unit > 1 else ""),
                             hint="use a smaller --tp")
    return model.model_copy(update={
        "name": f"{model.name} (one rank of TP{tp})",
        "num_attention_heads": model.num_attention_heads // tp,
        "linear_num_heads": model.linear_num_heads // tp,
        "moe_intermediate_size": model.moe_intermediate_size // tp,
        "intermediate_size": model.intermediate_size // tp,
        "vocab_size": padded_vocab // tp,
    })


def truncated_model_spec(model: ModelSpec, num_layers: int | None = None, mtp_layers: int | None = None,
                         dense_mlps: bool = False) -> ModelSpec:
    """The first `num_layers` layers of the schedule (same shapes, a cheaper model); `dense_mlps`:
    every MLP dense (no MoE weights, for tests of the KV layout); `mtp_layers` replaces the count."""
    layers = model.num_hidden_layers if num_layers is None else num_layers
    if not 1 <= layers <= model.num_hidden_layers:
        raise UsageError(f"--num-layers must be between 1 and {model.num_hidden_layers}, got {layers}")
    layer_types = model.layer_types[:layers]
    if "indexed_attention" not in layer_types:
        first = model.layer_types.index("indexed_attention")
        raise UsageError(f"--num-layers {layers} keeps no MLA layer (the first is layer {first})",
                         hint=f"use --num-layers {first + 1} or more")
    if mtp_layers is not None and mtp_layers < 0:
        raise UsageError("--mtp-layers must be >= 0")
    return model.model_copy(update={
        "num_hidden_layers": layers,
        "layer_types": layer_types,
        "mlp_layer_types": ["dense"] * layers if dense_mlps else model.mlp_layer_types[:layers],
        "num_nextn_predict_layers": model.num_nextn_predict_layers if mtp_layers is None else mtp_layers,
    })


# The rank-config directory holds no tensors, so glmctl's plugin goes by its block-FP8 quantization
# config and builds every attention family FP8 (`glmctl.plan.model._fp8_attention`); a node's
# checkpoint from `glmctl quantize fp8` holds the same families FP8.
VARIANT_FP8_ATTENTION = {"bf16": (), "fp8": ("kda", "mla"), "exl3": ("kda", "mla")}


def variant_formats(variant: str, exl3_bits: int = 4) -> WeightFormats:
    if variant not in VARIANT_CHECKPOINT:
        raise UsageError(f"--experts {variant!r} is not one of {', '.join(VARIANT_CHECKPOINT)}")
    return WeightFormats.for_checkpoint(VARIANT_CHECKPOINT[variant].format(bits=exl3_bits),
                                        VARIANT_FP8_ATTENTION[variant])


class WeightComparison(BaseModel):
    group: str
    label: str
    format: str
    node_gpu_bytes: int  # one GPU of the TP node (the planner's per-GPU figure)
    rank_model_bytes: int  # the TP1 rank model vLLM loads on the H200

    @property
    def difference_bytes(self) -> int:
        return self.rank_model_bytes - self.node_gpu_bytes


class RankWeights(BaseModel):
    """Per-GPU weight bytes for one rank-config variant: the TP node's GPU vs the TP1 rank model."""

    variant: str
    tp: int
    mtp_layers: int  # MTP layers loaded (vLLM loads them only with MTP speculation)
    groups: list[WeightComparison]
    node_gpu_bytes: int
    rank_model_bytes: int
    notes: list[str]


def _groups(model: ModelSpec, tp: int, formats: WeightFormats, mtp_layers: int) -> list[WeightGroup]:
    groups = weight_groups(model, tp, formats)
    if mtp_layers:
        groups.append(WeightGroup(group="mtp", label=f"MTP layer(s) ({mtp_layers})", format=str(formats.experts),
                                  bytes=mtp_drafter_bytes(model, tp, formats, mtp_layers)))
    return groups


def rank_weights(variant: str, tp: int = 8, mtp: bool = False, exl3_bits: int = 4,
                 model: ModelSpec | None = None) -> RankWeights:
    """What `glmctl plan` predicts one GPU of a TP-`tp` node holds for `variant`, beside what it
    predicts for the TP1 rank model (`mtp`: with the MTP layer, which vLLM loads only for MTP)."""
    model = model or load_model_spec("glm-5.3-flash")
    formats = variant_formats(variant, exl3_bits)
    mtp_layers = model.num_nextn_predict_layers if mtp else 0
    node = _groups(model, tp, formats, mtp_layers)
    rank = _groups(rank_model_spec(model, tp), 1, formats, mtp_layers)
    rows = [WeightComparison(group=n.group, label=n.label, format=n.format, node_gpu_bytes=n.bytes,
                             rank_model_bytes=r.bytes) for n, r in zip(node, rank, strict=True)]
    padded = cdiv(model.vocab_size, VOCAB_PADDING) * VOCAB_PADDING
    rank_vocab = padded // tp
    notes = [
        f"vocabulary: {rank_vocab:,} rows per GPU at TP{tp}; vLLM pads the rank model's {rank_vocab:,} to "
        f"{cdiv(rank_vocab, VOCAB_PADDING) * VOCAB_PADDING:,} (embedding and LM head)",
        "bytes are parameters only; vLLM's 'Model loading took' also counts buffers it allocates while "
        "building the model (e.g. the top-k index buffers) and the plugin's kernel workspaces",
    ]
    if VARIANT_FP8_ATTENTION[variant]:
        notes.append("KDA and MLA projections in block FP8, as the plugin builds them for the weightless rank "
                     "model (every unit FP8 by the quantization config); the planner's --kda fp8 keeps KDA's "
                     "f_b/g_b BF16 as `glmctl quantize fp8` stores them, which the rank model holds FP8 "
                     f"({_fb_gb_difference(model, tp) / 2**20:.1f} MiB less on each GPU)")
    if variant == "exl3":
        notes.append(f"EXL3 experts at a nominal {exl3_bits} bits (trellis + fp16 channel scales, "
                     "the codebook marker not counted)")
    return RankWeights(variant=variant, tp=tp, mtp_layers=mtp_layers, groups=rows,
                       node_gpu_bytes=sum(r.node_gpu_bytes for r in rows),
                       rank_model_bytes=sum(r.rank_model_bytes for r in rows), notes=notes)


def all_rank_weights(tp: int = 8, mtp: bool = False, exl3_bits: int = 4) -> list[RankWeights]:
    return [rank_weights(v, tp, mtp, exl3_bits) for v in VARIANT_CHECKPOINT]


def _fb_gb_difference(model: ModelSpec, tp: int) -> int:
    """Bytes KDA's f_b/g_b projections (head_dim -> heads x head_dim / tp) save in FP8 over BF16."""
    d, local = model.linear_head_dim, model.linear_num_heads * model.linear_head_dim // tp
    one = matrix_bytes(BF16, d, local) - matrix_bytes(WeightFormat(kind="fp8"), d, local)
    return 2 * one * len(model.kda_layers)
