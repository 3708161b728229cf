"""The knobs of the tiny GLM-5.3-Flash checkpoint (`glmctl.testing.tiny_checkpoint` says why each
default was chosen); the weight plan (`tiny_weights`) and the builder both read it."""

from __future__ import annotations

from dataclasses import dataclass

from glmctl.errors import UsageError

_LAYER_PATTERN = (  # (layer_type, indexer_type), repeated for --layers N
    ("linear_attention", "full"),
    ("indexed_attention", "full"),
    ("indexed_attention", "shared"),
    ("linear_attention", "full"),
)


@dataclass(frozen=True)
class TinySpec:
    """The knobs of the tiny checkpoint. `build(dir, **overrides)` accepts any of these fields."""

    layers: int = 4
    hidden_size: int = 256
    vocab_size: int = 2048
    intermediate_size: int = 512
    num_attention_heads: int = 8
    q_lora_rank: int = 128
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 256
    v_head_dim: int = 256
    index_n_heads: int = 8
    index_head_dim: int = 128
    index_topk: int = 128
    index_kpool: int = 16
    linear_num_heads: int = 4
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    n_routed_experts: int = 16
    num_experts_per_tok: int = 4
    n_shared_experts: int = 1
    moe_intermediate_size: int = 128
    hc_mult: int = 4
    mtp_layers: int = 1
    max_position_embeddings: int = 8192
    shared_indexer_weights: bool = True  # see tiny_weights.tensor_plan

    def layer_types(self) -> list[str]:
        return [_LAYER_PATTERN[i % len(_LAYER_PATTERN)][0] for i in range(self.layers)]

    def indexer_types(self) -> list[str]:
        return [_LAYER_PATTERN[i % len(_LAYER_PATTERN)][1] for i in range(self.layers)]

    def mlp_layer_types(self) -> list[str]:
        return ["dense"] + ["sparse"] * (self.layers - 1)

    def validate(self) -> None:
        rules = [
            (self.layers >= 2, f"--layers must be at least 2 (one KDA and one MLA layer), got {self.layers}"),
            (self.kv_lora_rank == 512, "kv_lora_rank must be 512: the MLA latent of GLM-5.3-Flash"),
            (self.index_head_dim == 128, "index_head_dim must be 128: vLLM's indexer asserts it"),
            (self.index_kpool > 1, "index_kpool must be > 1: vLLM's kpool indexer cache asserts it"),
            (self.index_topk % self.index_kpool == 0,
             f"index_topk ({self.index_topk}) must be a multiple of index_kpool ({self.index_kpool})"),
            (self.max_position_embeddings > self.index_topk + self.index_kpool,
             "max_position_embeddings must exceed index_topk + index_kpool, or sparse attention never selects"),
            (self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok exceeds n_routed_experts"),
            (self.mtp_layers >= 0, "mtp_layers must be >= 0"),
        ]
        for ok, message in rules:
            if not ok:
                raise UsageError(message, hint="see `glmctl testing tiny-checkpoint --help` for the defaults")
