"""Torch versions of the three small Triton kernels inside vLLM's indexer metadata builder.

`DeepseekV32IndexerMetadataBuilder` (which builds the kpool indexer's metadata) is plain Python
around three Triton launches; vLLM CPU has no Triton backend. Swapping just these launchers
keeps vLLM's builder (chunking, decode flattening, padding rules) unchanged on CPU. Each
function computes exactly what the kernel it replaces writes; the call signatures match the
kernels' `__call__`.
"""

from __future__ import annotations

import torch


class CompressedSlotMapping:
    """`_COMPRESSED_SLOT_MAPPING_KERNEL`: pool-granular slot per token, -1 unless the token
    completes a pool. `slot_mapping` arrives pre-filled with -1."""

    def __call__(self, slot_mapping, query_start_loc, seq_lens, block_table, block_size,
                 compress_ratio):
        qsl = query_start_loc.tolist()
        for b in range(len(qsl) - 1):
            start, end = qsl[b], qsl[b + 1]
            if start == end:
                continue
            first_pos = int(seq_lens[b]) - (end - start)
            pos = torch.arange(first_pos, first_pos + end - start, device=slot_mapping.device)
            pooled = pos // compress_ratio
            blocks = block_table[b, (pooled // block_size).clamp_max(block_table.shape[1] - 1)]
            slots = blocks.to(torch.int64) * block_size + pooled % block_size
            valid = (pos + 1) % compress_ratio == 0
            slot_mapping[start:end] = torch.where(valid, slots, -1).to(slot_mapping.dtype)

    def register_warmup(self, *args, **kwargs) -> None:
        pass


class BuildPrefillChunkMetadata:
    """`_BUILD_PREFILL_CHUNK_METADATA_KERNEL`: per prefill token, the [ks, ke) range of visible
    compressed keys in the gathered chunk buffer, and the request owning each gathered key."""

    def __call__(self, query_start_loc, uncompressed_seq_lens, cu_compressed_seq_lens,
                 row_start_cu_compressed_seq_lens, token_to_seq, cu_compressed_seq_len_ks,
                 cu_compressed_seq_len_ke, query_slice_start, query_slice_stop, DCP_RANK,
                 DCP_WORLD, DCP_INTERLEAVE, *, num_reqs, COMPRESS_RATIO):
        if DCP_WORLD != 1:
            raise NotImplementedError("decode context parallelism on vLLM CPU")
        qsl = query_start_loc.tolist()
        cu = cu_compressed_seq_lens.tolist()
        row_start = row_start_cu_compressed_seq_lens.tolist()
        for b in range(num_reqs):
            q_start, q_len = qsl[b], qsl[b + 1] - qsl[b]
            start_pos = int(uncompressed_seq_lens[b]) - q_len
            offs = torch.arange(q_len)
            absolute = q_start + offs
            keep = (absolute >= query_slice_start) & (absolute < query_slice_stop)
            out_pos = (absolute - query_slice_start)[keep]
            visible = (start_pos + 1 + offs[keep]) // COMPRESS_RATIO
            cu_compressed_seq_len_ks[out_pos] = row_start[b]
            cu_compressed_seq_len_ke[out_pos] = (row_start[b] + visible).to(
                cu_compressed_seq_len_ke.dtype
            )
            token_to_seq[cu[b] : cu[b + 1]] = b

    def register_warmup(self, *args, **kwargs) -> None:
        pass


class PrepareUniformDecode:
    """`_PREPARE_UNIFORM_DECODE_KERNEL`: flatten a uniform multi-token decode batch into one
    row per token (own causal length, copy of its request's block-table row)."""

    def __call__(self, seq_lens, decode_seq_lens, block_table, expanded_block_table,
                 decode_lens, num_decode_tokens, max_decode_len):
        idx = torch.arange(num_decode_tokens, device=seq_lens.device)
        req, local = idx // max_decode_len, idx % max_decode_len
        lens = (seq_lens[req] - max_decode_len + local + 1).clamp_min(0)
        decode_seq_lens[:num_decode_tokens] = lens.to(decode_seq_lens.dtype)
        cols = min(block_table.shape[1], expanded_block_table.shape[1])
        expanded_block_table[:num_decode_tokens, :cols] = block_table[req, :cols]
        decode_lens[:num_decode_tokens] = 1

    def register_warmup(self, *args, **kwargs) -> None:
        pass


def install() -> None:
    from vllm.v1.attention.backends.mla import compressor_utils, indexer

    compressor_utils._COMPRESSED_SLOT_MAPPING_KERNEL = CompressedSlotMapping()
    indexer._BUILD_PREFILL_CHUNK_METADATA_KERNEL = BuildPrefillChunkMetadata()
    indexer._PREPARE_UNIFORM_DECODE_KERNEL = PrepareUniformDecode()
