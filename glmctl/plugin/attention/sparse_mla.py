"""Sparse-MLA attention backend for GLM-5.3-Flash's indexed-attention layers.

vLLM 0.30's sparse-MLA backends need sm_90+ (FlashMLA / FlashInfer) and vLLM CPU has none.
This backend runs every query token (prefill, decode, MTP verify) through one absorbed-MQA
path over the tokens the indexer selected: vLLM's `MLAAttention` projects queries into the
512-d latent space (W_UK absorbed), we attend over the selected latent rows (V = latent) and
vLLM applies W_UV. It reads the request-local top-k token indices from the indexer's shared
buffer, maps them to cache rows through the block table, and hands rows to the kernels (torch
on CPU, Triton on CUDA; on CUDA decode batches take the split-K decode kernel, see
`sparse_mla_compute`).

KV cache (`--kv-cache-dtype`, layouts in `glmctl.kernels.layouts`):
  - `auto` / `bfloat16`: 512 bf16 per token (1024 B);
  - `fp8` / `fp8_e4m3`: vLLM's standard FP8 MLA cache, 512 e4m3 per token (512 B) with one
    per-tensor scale (the layer's `_k_scale`, read on the device). vLLM maps `fp8` to its
    656-byte `fp8_ds_mla` record only for a backend named FLASHMLA_SPARSE; we keep the 512-byte
    row, because GLM-5.3-Flash has no RoPE dims (the record's 128 RoPE bytes would be dead) -
    22 % fewer bytes per token than fp8_ds_mla, so that many more KV tokens and that much less
    decode traffic. It is the layout `glmctl plan` and the serve preflight predict.
  - `fp8_ds_mla` (asked for explicitly): vLLM's 656-byte record, per-128 fp32 scales.

Everything here is CUDA-graph friendly: persistent buffers, plans and workspace made at
construction, no host reads in `forward_mqa`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.model_executor.layers.attention.sparse_mla_attention import SharedTopkIndicesBuffer
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MLAAttentionImpl,
    MultipleOf,
)

from glmctl.kernels.layouts import KV_CACHE_DTYPES, KV_FP8, kv_format
from glmctl.plugin.attention.kernel_table import sparse_mla_kernels
from glmctl.plugin.attention.sparse_mla_compute import (
    decode_batch_sizes,
    make_decode_setup,
    request_ids_per_token,
    sparse_mla_forward,
)

BACKEND_NAME = "GLMCTL_SPARSE_MLA"


class GlmctlSparseMLABackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16]
    # vLLM's spellings of the layouts in glmctl.kernels.layouts (bf16 is glmctl's, not a vLLM value)
    supported_kv_cache_dtypes: ClassVar[list] = [*KV_CACHE_DTYPES, "fp8_e4m3"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @staticmethod
    def get_builder_cls() -> type[GlmctlSparseMLAMetadataBuilder]:
        return GlmctlSparseMLAMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[GlmctlSparseMLAImpl]:
        return GlmctlSparseMLAImpl

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [512, 576]  # GLM-5.3-Flash NoPE latent; 576 when a checkpoint keeps 64 rope dims

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return capability.major >= 8


@dataclass
class GlmctlSparseMLAMetadata(AttentionMetadata):
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    num_actual_tokens: int
    query_start_loc: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    req_id_per_token: torch.Tensor
    block_size: int
    topk_tokens: int
    # vLLM's MLA layer splits tokens into dense-MHA prefill and MQA "decode" by these counts.
    # This backend has no dense prefill: every token is an MQA token.
    num_decodes: int = 0
    num_prefills: int = 0
    num_decode_tokens: int = 0
    prefill: None = None
    decode: None = None


class GlmctlSparseMLAMetadataBuilder(AttentionMetadataBuilder[GlmctlSparseMLAMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.topk_tokens = vllm_config.model_config.hf_text_config.index_topk
        max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self.req_id_per_token = torch.zeros(max_tokens, dtype=torch.int32, device=device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> GlmctlSparseMLAMetadata:
        cm = common_attn_metadata
        # Padded (graph) tokens keep request 0; their top-k rows are -1 and never read.
        req_ids = request_ids_per_token(cm.query_start_loc_cpu, self.req_id_per_token)
        return GlmctlSparseMLAMetadata(
            num_reqs=cm.num_reqs,
            max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len,
            num_actual_tokens=cm.num_actual_tokens,
            query_start_loc=cm.query_start_loc,
            slot_mapping=cm.slot_mapping,
            block_table=cm.block_table_tensor,
            req_id_per_token=req_ids,
            block_size=self.kv_cache_spec.block_size,
            topk_tokens=self.topk_tokens,
            num_decodes=cm.num_reqs,
            num_prefills=0,
            num_decode_tokens=cm.num_actual_tokens,
        )


class GlmctlSparseMLAImpl(MLAAttentionImpl[GlmctlSparseMLAMetadata], SharedTopkIndicesBuffer):
    is_sparse = True
    supports_dense_mha_prefill = False
    can_return_lse_for_decode = True

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                 kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name,
                 topk_indices_buffer=None, indexer=None, **mla_args) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_format = kv_format(kv_cache_dtype).name  # refuses e.g. fp8_e5m2
        self.kv_lora_rank: int = mla_args["kv_lora_rank"]
        self.init_topk_indices_buffer(indexer, topk_indices_buffer)
        self.kernels = sparse_mla_kernels()
        self.decode = self._decode_setup()

    def _decode_setup(self):
        """Split-K decode plans for the batch sizes vLLM captures (and an eager ladder), and
        their workspace, made now: before CUDA-graph capture. None on the CPU target."""
        if self.kernels.plan_decode is None:
            return None
        from vllm.config import get_current_vllm_config

        config = get_current_vllm_config()
        spec = config.speculative_config
        max_query_len = 1 + (getattr(spec, "num_speculative_tokens", 0) or 0)
        sizes = decode_batch_sizes(config.compilation_config.cudagraph_capture_sizes,
                                   config.scheduler_config.max_num_seqs * max_query_len)
        return make_decode_setup(
            self.kernels, num_heads=self.num_heads, topk_width=self._topk_width(config),
            kv_format=self.kv_format, batch_sizes=sizes, max_query_len=max_query_len,
            device=torch.device("cuda", torch.cuda.current_device()))

    def _topk_width(self, config) -> int:
        buffer = self.topk_indices_buffer
        if buffer is not None:
            return buffer.shape[1]
        text = config.model_config.hf_text_config  # vLLM's buffer: topk + kpool - 1, to 128
        return -(-(text.index_topk + max(1, getattr(text, "index_kpool", 1) or 1) - 1) // 128) * 128

    def record_logical_topk_ready(self) -> None:
        """vLLM's MLA wrapper calls this after the indexer; nothing to publish here."""

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype,
                           k_scale) -> None:
        if kv_cache.numel() == 0:
            return
        # GLM-5.3-Flash has no RoPE dims: the row is the 512-d latent (k_pe is empty). The fp8
        # layout quantises with the layer's k_scale exactly as vLLM's concat_and_cache_mla does.
        self.kernels.cache_write(kv_c_normed, slot_mapping.flatten().to(torch.int64), kv_cache,
                                 k_scale if self.kv_format == KV_FP8 else None)

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata: GlmctlSparseMLAMetadata, layer):
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1) if q[1].shape[-1] else q[0]
        return sparse_mla_forward(
            q, kv_c_and_k_pe_cache, self.topk_indices_buffer, attn_metadata.req_id_per_token,
            attn_metadata.block_table, attn_metadata.block_size, self.scale, self.kernels,
            kv_scale=layer._k_scale if self.kv_format == KV_FP8 else None,
            decode=self.decode, max_query_len=attn_metadata.max_query_len,
        )
