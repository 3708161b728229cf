"""GLM-5.3-Flash's KV cache exactly as vLLM 0.30 lays it out: block size, page sizes, blocks, tokens.

Written from vLLM 0.30's source (no code copied); each rule names where vLLM implements it:

Per-layer pages (one page holds `block_size` tokens of one layer):
- MLA latent, `MLAAttention.get_kv_cache_spec` (model_executor/layers/attention/mla_attention.py):
  block_size x (kv_lora_rank + qk_rope_head_dim) x dtype bytes; bf16 2, `fp8` 1 byte per value
  (the standard layout, no scales); `fp8_ds_mla` is a fixed 656-byte record (512 fp8 + 4 fp32
  scales + 64 bf16 RoPE), which vLLM picks for `--kv-cache-dtype fp8` only when the backend is
  named FLASHMLA_SPARSE (`_canonicalize_sparse_mla_kv_cache_dtype`).
- indexer K cache, `Glm5NextIndexerCache` (models/glm5next/nvidia/attention.py): one state per
  `index_kpool` tokens of index_head_dim fp8 values + one fp32 scale per 128 values:
  (block_size / index_kpool) x (index_head_dim + index_head_dim / 128 x 4) bytes.
- indexer tail cache, `Glm5NextTailCache`: one block of index_kpool tokens per request holding raw
  bf16 K and gate score: 2 x index_kpool x index_head_dim x 2 bytes, padded to the indexer page.
- KDA state, `Glm5NextLinearAttention.get_state_shape` (nvidia/kda.py) with
  `MambaStateShapeCalculator.kda_state_shape` (model_executor/layers/mamba/mamba_utils.py): conv
  state (3 x heads x head_dim / tp, conv_kernel - 1 + num_speculative_tokens) in the model dtype and
  recurrent state (heads / tp, head_dim, head_dim) in fp32; padded to the MLA page.

Block size (`resolve_block_size`), in the order vLLM sets it:
1. the start. CUDA: `--block-size`, else the backend's preferred size
   (`Platform.update_block_size_for_backend` phase 1, platforms/interface.py). vLLM CPU:
   `CpuPlatform.check_and_update_config` (platforms/cpu.py) pins 16 for MLA models, over
   `--block-size` too, unless the CPU has AMX tiles (then `--block-size`, else 128); glmctl's
   plugin then raises it to `layouts.kpool_block_size` (`config_hooks._fix_cpu_cache_config`).
2. the hybrid alignment, `Platform._align_hybrid_block_size` (interface.py, "none"/"align" mamba
   modes), on both platforms after the model is built: with a = max(smallest kernel block, the
   block so far, 128), the block becomes a x cdiv(KDA state page, a x per-token MLA bytes in the
   cache dtype), rounded up to a multiple of `_get_indexer_block_alignment`, and is never lowered.
   That multiple is CUDA's 32 x index_kpool (platforms/cuda.py; the CPU platform has none), and
   with glmctl's plugin `layouts.kpool_indexer_alignment`, which the plugin installs in its place
   (`adapters._install_kpool_block_alignment`): also large enough that one indexer page holds the
   tail ring (1,024 at kpool 16 with no drafts, 1,536 with MTP-3).

Grouping and capacity, `_get_kv_cache_groups_glm5_next`, `get_kv_cache_config_from_groups`,
`get_max_concurrency_for_kv_cache_config` (v1/core/kv_cache_utils.py): all MLA + indexer layers
form one group; KDA layers form ceil(kda / mla) groups whose pages alias the MLA pages; tail caches
alias the indexer pages. One block costs (mla layers x MLA page + indexer layers x indexer page) and
every group draws whole blocks from the same pool. num_blocks = available // bytes per block. A
request of max_model_len holds ceil(max_model_len / block) attention blocks, one tail block and,
per KDA group, 1 + spec blocks ("none" mode) or 2 + spec ("align" mode, with prefix caching, the
default on CUDA; `MambaSpec.max_memory_usage_bytes`). vLLM logs
KV tokens = int(num_blocks / blocks per request x max_model_len).
"""

from __future__ import annotations

from pydantic import BaseModel

from glmctl.kernels.layouts import KV_FP8_DS_MLA, kv_format
from glmctl.plan.model import ModelSpec

MLA_MIN_BLOCK_ALIGNMENT = 128  # hybrid MLA/mamba: manager block a multiple of 128 (interface.py)
PAGED_MQA_MIN_PAGE = 32  # min(PAGED_MQA_PAGE_SIZES) (utils/deep_gemm.py)
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KvCacheLayout(BaseModel):
    """The per-GPU block layout vLLM 0.30 builds for one model, TP size, cache dtype and drafter."""

    kv_cache_dtype: str
    block_size: int
    mla_bytes_per_token: int  # per MLA layer
    mla_page_bytes: int
    indexer_page_bytes: int
    tail_page_bytes: int  # unpadded (raw K + gate of the tail ring: one pool, more under MTP with glmctl)
    kda_conv_state_bytes: int
    kda_recurrent_state_bytes: int
    num_mla_layers: int  # including the MTP layers when MTP drafts
    num_indexer_layers: int
    num_kda_layers: int
    num_kda_groups: int
    mamba_cache_mode: str  # "align" (prefix caching) or "none"
    kda_blocks_per_group: int  # per request
    tail_blocks: int  # per request
    bytes_per_block: int
    error: str | None = None  # a layout vLLM 0.30 refuses at start-up, in vLLM's words

    @property
    def kda_state_bytes(self) -> int:
        """Real bytes of one KDA layer's state for one request (conv + recurrent)."""
        return self.kda_conv_state_bytes + self.kda_recurrent_state_bytes

    def attention_blocks(self, max_model_len: int) -> int:
        return cdiv(max_model_len, self.block_size)

    def blocks_per_request(self, max_model_len: int) -> int:
        return (
            self.attention_blocks(max_model_len)
            + self.tail_blocks
            + self.num_kda_groups * self.kda_blocks_per_group
        )

    def bytes_per_request(self, max_model_len: int) -> int:
        return self.blocks_per_request(max_model_len) * self.bytes_per_block


def mla_bytes_per_token(model: ModelSpec, kv_cache_dtype: str) -> int:
    """Bytes one MLA layer stores per token (MLAAttentionSpec page / block_size)."""
    layout = kv_format(kv_cache_dtype)
    if layout.name == KV_FP8_DS_MLA:
        return layout.row_bytes  # vLLM's fixed record (mla_attention.py), whatever the model's rank
    return model.mla_head_size * _cache_dtype_bytes(model, kv_cache_dtype)


def _cache_dtype_bytes(model: ModelSpec, kv_cache_dtype: str) -> int:
    if kv_cache_dtype == "auto":
        return _DTYPE_BYTES.get(model.dtype, 2)
    return kv_format(kv_cache_dtype).value_bytes


def indexer_state_bytes(model: ModelSpec) -> int:
    """One pooled indexer key: fp8 values plus one fp32 scale per 128 of them."""
    return model.index_head_dim + model.index_head_dim // 128 * 4


def kda_state_bytes(model: ModelSpec, tp: int, num_spec: int) -> tuple[int, int]:
    """(conv state, recurrent state) bytes of one KDA layer for one request on one GPU."""
    heads, dim = model.linear_num_heads, model.linear_head_dim
    conv = 3 * heads * dim // tp * (model.linear_conv_kernel_dim - 1 + num_spec) * _DTYPE_BYTES.get(model.dtype, 2)
    recurrent = heads // tp * dim * dim * 4
    return conv, recurrent


def resolve_block_size(
    model: ModelSpec, kv_cache_dtype: str, kda_page: int, kernel_block_size: int, user_block_size: int | None,
    *, platform: str = "cuda", glmctl_plugin: bool = False, num_spec: int = 0, cpu_amx: bool = False,
) -> int:
    """vLLM's block size for a hybrid MLA/KDA model with the kpool indexer (prefix-caching modes
    "none" and "align"; "all" is not served for this model). See the module docstring."""
    kpool_cache = model.has_indexer and model.index_kpool > 1
    if platform == "cpu":
        block = (user_block_size or 128) if cpu_amx else 16
        if glmctl_plugin and kpool_cache:
            from glmctl.kernels.layouts import kpool_block_size

            block = kpool_block_size(block, model.index_kpool, model.index_head_dim, num_spec)
    else:
        block = user_block_size or kernel_block_size
    if not kda_page:
        return block
    # the alignment uses the cache dtype's element size even for fp8_ds_mla (interface.py builds an
    # MLAAttentionSpec without the 656-byte record there)
    per_token = model.mla_head_size * _cache_dtype_bytes(model, kv_cache_dtype)
    align = max(kernel_block_size, block, MLA_MIN_BLOCK_ALIGNMENT)
    needed = align * cdiv(kda_page, align * per_token)
    indexer_align = _indexer_block_alignment(model, platform, glmctl_plugin, num_spec) if kpool_cache else None
    if indexer_align:
        needed = indexer_align * cdiv(needed, indexer_align)
    return max(block, needed)


def _indexer_block_alignment(model: ModelSpec, platform: str, glmctl_plugin: bool, num_spec: int) -> int | None:
    """What `_get_indexer_block_alignment` answers: CUDA's 32 x kpool (the smallest paged-MQA pool
    page), nothing on CPU; with glmctl's plugin its own multiple, combined with the platform's."""
    stock = model.index_kpool * PAGED_MQA_MIN_PAGE if platform == "cuda" else None
    if not glmctl_plugin:
        return stock
    from glmctl.kernels.layouts import kpool_indexer_alignment

    return kpool_indexer_alignment(model.index_kpool, model.index_head_dim, num_spec, stock)


def kv_cache_layout(
    model: ModelSpec,
    *,
    tp: int,
    kv_cache_dtype: str,
    num_spec: int,
    mtp_layers: int,
    prefix_caching: bool,
    kernel_block_size: int = 64,
    user_block_size: int | None = None,
    glmctl_plugin: bool = True,
    platform: str = "cuda",
    cpu_amx: bool = False,
) -> KvCacheLayout:
    """The layout vLLM builds on each GPU. `mtp_layers`: MTP layers whose KV joins the pool.

    `glmctl_plugin`: plan vLLM with glmctl's plugin active (the product: sm_8x and vLLM CPU), whose
    kpool tail ring holds `kpool + drafts - 1` tokens under MTP (vLLM's one-pool ring loses
    accepted tokens when a draft is rejected) and whose block-size rule grows the block until the
    indexer page can hold that tail (`glmctl.kernels.layouts`, the one place both rules live).
    False plans stock vLLM 0.30. `platform`: "cuda" or "cpu" (vLLM CPU starts from another block
    size; `cpu_amx`: the CPU has AMX tiles). `kernel_block_size`: the sparse-MLA backend's smallest
    kernel block (glmctl's: 16; FlashMLA-sparse: 64); below 128 it never changes the result for
    this model.
    """
    conv, recurrent = kda_state_bytes(model, tp, num_spec)
    num_kda = len(model.kda_layers)
    block = resolve_block_size(model, kv_cache_dtype, conv + recurrent if num_kda else 0,
                               kernel_block_size, user_block_size, platform=platform,
                               glmctl_plugin=glmctl_plugin, num_spec=num_spec, cpu_amx=cpu_amx)
    ring = model.index_kpool
    if glmctl_plugin and model.has_indexer and model.index_kpool > 1:
        from glmctl.kernels.layouts import kpool_tail_ring

        ring = kpool_tail_ring(model.index_kpool, num_spec)
    num_mla = len(model.mla_layers) + mtp_layers
    mla_tok = mla_bytes_per_token(model, kv_cache_dtype)
    kpool = model.index_kpool
    idx_page = (block // kpool) * indexer_state_bytes(model) if model.has_indexer else 0
    num_idx = num_mla if model.has_indexer else 0
    tail_page = 2 * ring * model.index_head_dim * 2 if model.has_indexer and kpool > 1 else 0
    mla_page = block * mla_tok
    groups = cdiv(num_kda, num_mla) if num_kda and num_mla else 0
    error = _layout_error(model, block, mla_page, idx_page, tail_page, conv + recurrent, num_mla)
    return KvCacheLayout(
        kv_cache_dtype=kv_cache_dtype,
        block_size=block,
        mla_bytes_per_token=mla_tok,
        mla_page_bytes=mla_page,
        indexer_page_bytes=idx_page,
        tail_page_bytes=tail_page,
        kda_conv_state_bytes=conv if num_kda else 0,
        kda_recurrent_state_bytes=recurrent if num_kda else 0,
        num_mla_layers=num_mla,
        num_indexer_layers=num_idx,
        num_kda_layers=num_kda,
        num_kda_groups=groups,
        mamba_cache_mode="align" if prefix_caching else "none",
        kda_blocks_per_group=(2 if prefix_caching else 1) + num_spec if num_kda else 0,
        tail_blocks=1 if tail_page else 0,
        bytes_per_block=num_mla * mla_page + num_idx * idx_page,
        error=error,
    )


def _layout_error(model: ModelSpec, block: int, mla_page: int, idx_page: int, tail_page: int,
                  kda_page: int, num_mla: int) -> str | None:
    """The start-up failures vLLM 0.30 raises for a layout, in the words of its assertion."""
    if num_mla == 0:
        return "no MLA layer: GLM-5.3-Flash's cache layout needs MLA layers for the KDA state to share"
    if model.has_indexer and model.index_kpool > 1 and (block // model.index_kpool) % PAGED_MQA_MIN_PAGE:
        return (f"kpool indexer requires block_size to be a multiple of index_kpool * 32 "
                f"({model.index_kpool * PAGED_MQA_MIN_PAGE}), got {block}")
    if kda_page > mla_page:
        return (f"the mamba state page ({kda_page} bytes) does not fit the MLA page ({mla_page} bytes); "
                "increase tensor parallelism or use a wider KV cache dtype")
    if tail_page > idx_page:
        align = model.index_kpool * PAGED_MQA_MIN_PAGE
        fix = align * cdiv(cdiv(tail_page, indexer_state_bytes(model)) * model.index_kpool, align)
        return (f"the indexer tail page ({tail_page} bytes) is larger than the indexer page ({idx_page} "
                f"bytes) at block size {block}, which vLLM 0.30 cannot pad (kv_cache_utils.py): "
                f"use --block-size {fix} or an fp8 KV cache")
    return None


class KvCapacity(BaseModel):
    num_blocks: int
    blocks_per_request: int
    max_concurrency: float  # requests of max_model_len the pool holds (vLLM's figure)
    kv_tokens: int  # what vLLM logs as "GPU KV cache size: N tokens"
    needed_bytes: int  # KV memory vLLM requires before it starts: one request + the null block


def kv_capacity(layout: KvCacheLayout, available_bytes: int, max_model_len: int) -> KvCapacity:
    blocks_per_request = layout.blocks_per_request(max_model_len)
    num_blocks = max(available_bytes, 0) // layout.bytes_per_block
    concurrency = num_blocks / blocks_per_request
    return KvCapacity(
        num_blocks=num_blocks,
        blocks_per_request=blocks_per_request,
        max_concurrency=concurrency,
        kv_tokens=int(concurrency * max_model_len),
        needed_bytes=(blocks_per_request + 1) * layout.bytes_per_block,
    )
