"""Memory vLLM holds back on each GPU besides weights and KV cache, and the CUDA-graph sizes.

Three kinds, labelled in every plan:
- vLLM rules (exact for vLLM 0.30): stock vLLM's indexer reserves its prefill K-gather workspace
  and its logits during the profiling run (`sparse_attn_indexer_kpool`'s profiling branch in
  `model_executor/layers/sparse_attn_indexer_kpool.py`, `get_max_prefill_buffer_size` in
  `v1/attention/backends/mla/indexer.py`); glmctl's plugin replaces that op
  (`glmctl.plugin.attention.indexer.GlmctlKpoolIndexer`), whose profiling run returns at once, so with the
  plugin neither is reserved (its prefill logits, one chunk at a time, are allocated at run time).
  The top-k index buffers (`Glm5NextModel` / the MTP layer in `vllm/models/glm5next/nvidia/`) are
  built with the model either way;
- estimates from the model's shapes: the activation peak of a `max_num_batched_tokens` forward;
- node constants (`NodeConstants`): non-torch runtime memory and the CUDA-graph pool.
"""

from __future__ import annotations

from pydantic import BaseModel

from glmctl.plan.model import ModelSpec
from glmctl.plan.node import NodeConstants

MIB = 1 << 20
PREFILL_GATHER_TOKENS_PER_CONTEXT = 40  # vLLM: max_model_len * 40 indexer entries
INDEXER_MAX_LOGITS_MIB = 512  # VLLM_SPARSE_INDEXER_MAX_LOGITS_MB default
RADIX_TOPK_WORKSPACE = 1 << 20
SPARSE_TOPK_BLOCK_N = 128  # top-k buffer width is padded to this
DEFAULT_MAX_GRAPH_SIZE = 512  # non-Blackwell capture ceiling (config/vllm.py)


class ReserveItem(BaseModel):
    key: str
    label: str
    bytes: int
    basis: str  # "vLLM rule", "estimate" or "node constant"


def default_capture_sizes(max_num_seqs: int, decode_query_len: int, max_num_batched_tokens: int,
                          max_capture: int | None = None) -> list[int]:
    """vLLM 0.30's default CUDA-graph capture sizes (`VllmConfig._set_cudagraph_sizes`)."""
    uniform: list[int] = []
    if max_capture is None:
        max_capture = min(max_num_seqs * decode_query_len * 2, DEFAULT_MAX_GRAPH_SIZE)
        if decode_query_len > 1:
            reqs = min(max_num_seqs, DEFAULT_MAX_GRAPH_SIZE)
            counts = [n for n in (1, 2, 4) if n <= reqs] + list(range(8, min(reqs + 1, 256), 8))
            counts = sorted(set(counts + list(range(256, reqs + 1, 16)) + [reqs]))
            uniform = [n * decode_query_len for n in counts if n * decode_query_len <= max_capture]
    max_capture = min(max_num_batched_tokens, max_capture)
    sizes = [n for n in (1, 2, 4) if n <= max_capture]
    if max_capture >= 8:
        sizes += list(range(8, min(max_capture + 1, 256), 8))
    if max_capture >= 256:
        sizes += list(range(256, max_capture + 1, 16))
    if max_num_batched_tokens <= max_capture:
        sizes.append(max_num_batched_tokens)
    sizes += [s for s in uniform if s <= max_num_batched_tokens]
    return sorted(set(sizes))


def count_graphs(sizes: list[int], decode_query_len: int, max_num_seqs: int, drafter: bool) -> int:
    """FULL_AND_PIECEWISE: a piecewise graph per size plus a full decode graph per uniform size;
    a drafter captures its own piecewise graphs for the same sizes (`LLMBaseProposer`)."""
    full = [s for s in sizes if s % decode_query_len == 0 and s // decode_query_len <= max_num_seqs]
    return len(sizes) * (2 if drafter else 1) + len(full)


def reserves(
    model: ModelSpec,
    *,
    tp: int,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    num_spec: int,
    mtp_layers: int,
    capture_sizes: list[int],
    constants: NodeConstants,
    drafter: bool = False,
    glmctl_plugin: bool = True,
) -> list[ReserveItem]:
    """Per-GPU memory vLLM's start-up profile counts as neither weights nor KV cache
    (`glmctl_plugin`: glmctl's indexer op, which reserves nothing in the profiling run)."""
    items: list[ReserveItem] = []
    if model.has_indexer and not glmctl_plugin:
        gather = PREFILL_GATHER_TOKENS_PER_CONTEXT * max_model_len * (model.index_head_dim + 4)
        items.append(ReserveItem(key="indexer_workspace", label="indexer prefill K-gather workspace",
                                 bytes=gather + RADIX_TOPK_WORKSPACE, basis="vLLM rule"))
        decode_rows = min(max_num_seqs * (1 + num_spec), max_num_batched_tokens)
        logits = max(decode_rows * max_model_len * 4, INDEXER_MAX_LOGITS_MIB * MIB)
        items.append(ReserveItem(key="indexer_logits", label="indexer logits reservation",
                                 bytes=logits, basis="vLLM rule"))
    if model.has_indexer:
        width = model.index_topk + (model.index_kpool - 1 if model.index_kpool > 1 else 0)
        width = -(-width // SPARSE_TOPK_BLOCK_N) * SPARSE_TOPK_BLOCK_N
        items.append(ReserveItem(key="topk_buffers", label="top-k index buffers",
                                 bytes=(1 + mtp_layers) * max_num_batched_tokens * width * 4, basis="vLLM rule"))
    streams = max(model.hc_mult, 1)
    moe = model.num_experts_per_tok * (3 * model.moe_intermediate_size // tp + model.hidden_size) * 2
    per_token = moe + 3 * streams * model.hidden_size * 2
    # the profile run also samples: fp32 logits, probabilities and a sorted copy for every decode row
    sampler = 3 * max_num_seqs * (1 + num_spec) * model.vocab_size * 4
    items.append(ReserveItem(key="activations", label=f"activation peak ({max_num_batched_tokens} batched tokens)",
                             bytes=max_num_batched_tokens * per_token + sampler, basis="estimate"))
    if capture_sizes:
        graphs = count_graphs(capture_sizes, 1 + num_spec, max_num_seqs, drafter)
        modes = min(graphs, 2)
        graph_bytes = int((modes * constants.cudagraph_first_mib
                           + (graphs - modes) * constants.cudagraph_per_graph_mib) * MIB)
        items.append(ReserveItem(key="cudagraphs", label=f"CUDA graphs ({graphs} captured)",
                                 bytes=graph_bytes, basis="node constant"))
    items.append(ReserveItem(key="runtime", label="NCCL, cuBLAS and other non-torch memory",
                             bytes=int(constants.non_torch_runtime_gib * (1 << 30)), basis="node constant"))
    return items
