"""The kpool lightning indexer for GLM-5.3-Flash, without DeepGEMM.

Replaces vLLM's `SparseAttnIndexerKpool` custom op (registered out-of-tree under that class
name, so `Glm5NextIndexer` builds ours). It consumes exactly what vLLM 0.30 allocates and
builds: the pooled FP8 key cache (`Glm5NextIndexerCache`, one entry per `index_kpool` tokens),
the raw tail cache of the incomplete pool (`Glm5NextTailCache`), and vLLM's
`DeepseekV32IndexerMetadata` for both. Per step it

1. writes the cache: prefill tokens are pooled and written at their pool slot, the trailing
   incomplete pool of each prefill is seeded into the tail cache; decode tokens (including
   MTP verify tokens, in position order) update the tail and complete pools as they fill;
2. selects, for every query token, the top `index_topk // index_kpool` visible pools by the
   indexer logits, expands them to tokens and appends the query's own incomplete pool
   ("always select tail"), writing request-local token indices (-1 padded) into the shared
   top-k buffer that the sparse-MLA backend reads.

The maths lives in the kernels (torch references on CPU, Triton on CUDA); this class only maps
vLLM's metadata onto them.
"""

from __future__ import annotations

import torch
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.sparse_attn_indexer_kpool import SparseAttnIndexerKpool
from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerMetadata

from glmctl.plugin.attention.kernel_table import indexer_kernels

# Decode top-k rows served by the two-stage (sliced) top-k on CUDA: up to 48 query tokens (12
# requests x MTP-3 verify); larger decode batches have rows enough to fill the GPU in one pass.
TOPK_WORKSPACE_ROWS = 48


class GlmctlKpoolIndexer(SparseAttnIndexerKpool):
    """Drop-in for vLLM's kpool indexer op; same constructor, same call signature."""

    def __init__(self, k_cache, quant_block_size, scale_fmt, topk_tokens, head_dim,
                 max_model_len, max_total_seq_len, topk_indices_buffer,
                 skip_k_cache_insert=False, use_fp4_cache=False, tail_cache=None):
        # vLLM's __init__ refuses to build without DeepGEMM; that is the dependency we remove.
        torch.nn.Module.__init__(self)
        self._enforce_enable = True
        self._forward_method = self._forward_kpool
        self.k_cache = k_cache
        self.tail_cache = tail_cache
        self.quant_block_size = quant_block_size
        self.scale_fmt = scale_fmt
        self.topk_tokens = topk_tokens
        self.head_dim = head_dim
        self.max_model_len = max_model_len
        self.max_total_seq_len = max_total_seq_len
        self.topk_indices_buffer = topk_indices_buffer
        self.skip_k_cache_insert = skip_k_cache_insert
        if use_fp4_cache:
            raise NotImplementedError("glmctl's kpool indexer supports the FP8 indexer cache only")
        self.use_fp4_cache = False
        self.kernels = indexer_kernels()
        self.topk_workspace = self._decode_topk_workspace()

    def _decode_topk_workspace(self):
        """CUDA: one workspace for the decode top-k's sliced first stage, made now (before
        graph capture) and shared by every indexer layer of the process; None on CPU."""
        if self.kernels.topk_workspace is None:
            return None
        from vllm.config import get_current_vllm_config

        text = get_current_vllm_config().model_config.hf_text_config
        select = self.topk_tokens // max(1, getattr(text, "index_kpool", 1) or 1)
        device = torch.device("cuda", torch.cuda.current_device())
        key = (str(device), select)
        if key not in _TOPK_WORKSPACES:
            num_sms = torch.cuda.get_device_properties(device).multi_processor_count
            _TOPK_WORKSPACES[key] = self.kernels.topk_workspace(TOPK_WORKSPACE_ROWS, select,
                                                                num_sms, device)
        return _TOPK_WORKSPACES[key]

    def _topk_args(self, rows: int) -> dict:
        ws = self.topk_workspace
        return {"workspace": ws} if ws is not None and rows <= ws.values.shape[0] else {}

    @classmethod
    def enabled(cls) -> bool:
        return True

    def forward(self, *args, **kwargs):
        return self._forward_kpool(*args, **kwargs)

    def _forward_kpool(self, hidden_states, q_quant, k, weights, *, gate_score=None,
                       compress_ape=None, index_kpool=1, positions=None):
        # Like vLLM's own indexer op: under breakable CUDA-graph capture this runs eagerly (its
        # per-batch branches and prefill chunking are host-side); it writes in place.
        return _run_eagerly_under_capture(self, hidden_states, q_quant, k, weights, gate_score,
                                          compress_ape, index_kpool, positions)

    def _run(self, hidden_states, q_quant, k, weights, gate_score, compress_ape, index_kpool,
             positions):
        buffer = self.topk_indices_buffer
        metadata = get_forward_context().attn_metadata
        if not isinstance(metadata, dict):
            return buffer  # profiling / dummy run: no cache, nothing to select
        meta = metadata[self.k_cache.prefix]
        assert isinstance(meta, DeepseekV32IndexerMetadata)
        assert index_kpool > 1 and gate_score is not None and compress_ape is not None
        assert positions is not None
        tail_meta = metadata.get(self.tail_cache.prefix) if self.tail_cache is not None else None
        if isinstance(q_quant, tuple):
            q_quant = q_quant[0]

        num_tokens = meta.slot_mapping.shape[0]
        k = k[:num_tokens]
        gate_score = gate_score[:num_tokens]
        if not self.skip_k_cache_insert:
            self._write_prefill(meta, tail_meta, k, gate_score, compress_ape, index_kpool)
            self._write_decode(meta, tail_meta, k, gate_score, compress_ape, index_kpool, positions)

        # The decode select writes every row it owns: its tokens and, in a batch of decodes
        # only, the (CUDA-graph) padding rows after them; the other rows are filled here.
        rows = hidden_states.shape[0]
        decode_rows = 0
        if meta.num_decodes > 0:
            decode_rows = rows if meta.num_prefills == 0 else meta.num_decode_tokens
        if decode_rows < rows:
            buffer[decode_rows:rows] = -1
        if meta.num_prefills > 0:
            self._select_prefill(meta, q_quant, weights, index_kpool, positions)
        if meta.num_decodes > 0:
            self._select_decode(meta, q_quant, weights, index_kpool, positions, decode_rows)
        return buffer

    # -- cache writes ---------------------------------------------------------------------

    def _write_prefill(self, meta, tail_meta, k, gate, ape, kpool):
        start, end = meta.num_decode_tokens, meta.slot_mapping.shape[0]
        if end <= start:
            return
        k_pf, gate_pf = k[start:end], gate[start:end]
        # Every token whose pool slot is valid closes a pool made of itself and the kpool - 1
        # tokens before it (prefill chunks start pool-aligned).
        self.kernels.prefill_write(self.k_cache.kv_cache, k_pf, gate_pf, ape,
                                   meta.slot_mapping[start:end], kpool)
        if tail_meta is not None and self.tail_cache.kv_cache.numel() > 0:
            self.kernels.tail_seed(self.tail_cache.kv_cache, k_pf, gate_pf,
                                   tail_meta.slot_mapping[start:end], kpool)

    def _write_decode(self, meta, tail_meta, k, gate, ape, kpool, positions):
        n = meta.num_decode_tokens
        if n == 0 or tail_meta is None:
            return
        decode, batch = meta.decode, meta.num_decodes
        if decode.decode_is_uniform and n == batch * decode.write_max_decode_len:
            width = decode.write_max_decode_len  # uniform batch: views, no host sync

            def grouped(values, _pad):
                return values.reshape(batch, width, *values.shape[1:])
        else:
            grouped = _group_by_request(decode.per_req_decode_lens, batch, n,
                                        width=decode.write_max_decode_len)
        self.kernels.decode_update(
            self.k_cache.kv_cache,
            self.tail_cache.kv_cache,
            grouped(tail_meta.slot_mapping[:n], -1),
            grouped(k[:n], 0),
            grouped(gate[:n], 0),
            ape,
            grouped(meta.slot_mapping[:n], -1),
            grouped(positions[:n], -1),
            kpool,
        )

    # -- top-k selection ------------------------------------------------------------------

    def _select_prefill(self, meta, q_quant, weights, kpool, positions):
        buffer, topk = self.topk_indices_buffer, self.topk_tokens
        prefill = meta.prefill
        start, end = meta.num_decode_tokens, meta.slot_mapping.shape[0]
        if 0 <= prefill.max_prefill_seq_len <= topk:
            _fill_causal(buffer[start:end], positions[start:end])
            return
        for chunk in prefill.chunks:
            k_fp8, k_scale = self.kernels.gather_keys(
                self.k_cache.kv_cache, chunk.block_table, chunk.cu_seq_lens
            )
            rows = slice(chunk.token_start, chunk.token_end)
            logits = self.kernels.logits_ragged(
                q_quant[rows], weights[rows], k_fp8, k_scale, chunk.cu_seqlen_ks,
                chunk.cu_seqlen_ke,
            )
            self.kernels.topk(
                logits, positions[rows].to(torch.int32) + 1, buffer[rows], kpool=kpool,
                select_pools=topk // kpool, row_starts=chunk.cu_seqlen_ks,
            )

    def _select_decode(self, meta, q_quant, weights, kpool, positions, decode_rows):
        """Rows [0, decode_rows): the decode tokens' selections, then -1 (padding rows)."""
        buffer, select = self.topk_indices_buffer, self.topk_tokens // kpool
        decode = meta.decode
        n = meta.num_decode_tokens
        # Short contexts select every token; the full path gives the same set, so a captured
        # graph (whose host branches are frozen) always takes the full path.
        if meta.max_seq_len <= self.topk_tokens and not _capturing():
            _fill_causal(buffer[:n], positions[:n])
            buffer[n:decode_rows] = -1
            return
        if decode.requires_padding:
            self._select_decode_padded(meta, q_quant, weights, kpool, positions, decode_rows)
            return
        # vLLM's decode layout: [batch, next_n] query rows, a view of the token order
        # (flattened decode is next_n = 1); context lengths [batch, next_n] in pools.
        batch = decode.decode_lens.shape[0]
        next_n = n // batch
        q = q_quant[:n].reshape(batch, next_n, *q_quant.shape[1:])
        context = decode.seq_lens.reshape(batch, -1)
        if context.shape[1] != next_n:
            context = context[:, :1].expand(batch, next_n)
        context = context.contiguous()
        logits = self.kernels.logits_paged(q, weights[:n], self.k_cache.kv_cache,
                                           decode.block_table, context)
        # One launch: each row's length from its position, capped by its context (the logits
        # of pools at or past it are not written), and every row of buffer[:decode_rows].
        self.kernels.topk_decode(logits, positions[:n], context, buffer[:decode_rows],
                                 kpool=kpool, select_pools=select, valid_rows=n,
                                 **self._topk_args(n))

    def _select_decode_padded(self, meta, q_quant, weights, kpool, positions, decode_rows):
        """Decode requests of unequal token counts: grouped into [batch, next_n] by request
        (host-side lengths: eager batches only), selected, and scattered back."""
        buffer, topk = self.topk_indices_buffer, self.topk_tokens
        decode = meta.decode
        n = meta.num_decode_tokens
        lens = decode.decode_lens
        batch = lens.shape[0]
        next_n = int(lens.max())
        grouped = _group_by_request(lens, batch, n, width=next_n)
        q = grouped(q_quant[:n], 0)
        w = grouped(weights[:n], 0).reshape(batch * next_n, -1)
        context = decode.seq_lens.reshape(batch, -1)
        if context.shape[1] != next_n:
            context = context[:, :1].expand(batch, next_n)
        context = context.contiguous()
        logits = self.kernels.logits_paged(q, w, self.k_cache.kv_cache, decode.block_table,
                                           context)
        out = torch.empty((batch * next_n, buffer.shape[1]), dtype=buffer.dtype,
                          device=buffer.device)
        self.kernels.topk_decode(logits, grouped(positions[:n], -1), context, out, kpool=kpool,
                                 select_pools=topk // kpool, **self._topk_args(batch * next_n))
        buffer[:n] = out[_padded_row_index(lens, next_n)]
        buffer[n:decode_rows] = -1


_TOPK_WORKSPACES: dict = {}


@eager_break_during_capture
def _run_eagerly_under_capture(op, hidden_states, q_quant, k, weights, gate_score, compress_ape,
                               index_kpool, positions):
    return op._run(hidden_states, q_quant, k, weights, gate_score, compress_ape, index_kpool,
                   positions)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _fill_causal(rows: torch.Tensor, positions: torch.Tensor) -> None:
    """Every token up to and including the query: the exact causal set (short contexts)."""
    cols = torch.arange(rows.shape[1], device=rows.device, dtype=torch.int32)
    rows.copy_(torch.where(cols[None] <= positions.to(torch.int32)[:, None], cols[None], -1))


def _group_by_request(lens: torch.Tensor, num_requests: int, num_tokens: int,
                      width: int | None = None):
    """Scatter flat per-token tensors into [num_requests, width, ...] in token order."""
    lens = lens[:num_requests].to(torch.int64)
    width = int(lens.max()) if width is None else width
    req = torch.repeat_interleave(torch.arange(num_requests, device=lens.device), lens,
                                  output_size=num_tokens)
    starts = torch.cumsum(lens, 0) - lens
    intra = torch.arange(num_tokens, device=lens.device) - starts[req]

    def grouped(values: torch.Tensor, pad) -> torch.Tensor:
        out = values.new_full((num_requests, width, *values.shape[1:]), pad)
        out[req, intra] = values
        return out

    return grouped


def _padded_row_index(lens: torch.Tensor, width: int) -> torch.Tensor:
    lens = lens.to(torch.int64)
    req = torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), lens)
    starts = torch.cumsum(lens, 0) - lens
    intra = torch.arange(req.shape[0], device=lens.device) - starts[req]
    return req * width + intra
