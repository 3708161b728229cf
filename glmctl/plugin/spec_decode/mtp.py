"""MTP drafting for GLM-5.3-Flash: the draft layer's caches span two KV-cache groups.

GLM-5.3-Flash's MTP layer is a full indexed-attention layer: MLA latent + pooled indexer keys
(both in vLLM's attention group) and the kpool tail ring (its own `KpoolTailSpec` group, one
block per request). vLLM 0.30's drafter assumes all draft layers share one group (it asserts),
builds every draft layer's metadata from that group's block table, and never gives the tail
builder token positions, so the tail ring would be addressed with the wrong blocks.

We extend vLLM's proposer, not replace it: the attention-group layers go through vLLM's own
initialisation unchanged; the tail layers get their own attention group on their own KV-cache
group, and their metadata is built from their group's block table and the draft positions.
Nothing changes for models without a kpool tail in the draft.

The tail ring itself (every indexer layer's, target and draft) gets `kpool + drafts - 1` slots
(`layouts.kpool_tail_ring`): with vLLM's one-pool ring a rejected draft past a pool boundary
overwrites an accepted token of the pool still being filled.
"""

from __future__ import annotations


def install() -> str:
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    _install_tail_ring()

    if getattr(SpecDecodeBaseProposer, "_glmctl_wrapped", False):
        return "MTP drafter"
    stock_init = SpecDecodeBaseProposer.__init__
    stock_initialize = SpecDecodeBaseProposer.initialize_attn_backend
    stock_build = SpecDecodeBaseProposer.build_per_group_and_layer_attn_metadata

    def __init__(self, *args, **kwargs):
        stock_init(self, *args, **kwargs)
        self._glmctl_runner = kwargs.get("runner", args[3] if len(args) > 3 else None)
        self._glmctl_tail_gid = None

    def initialize_attn_backend(self, kv_cache_config, kernel_block_sizes=None):
        tail_gid, tail_names = _tail_group(self._draft_attn_layer_names, kv_cache_config)
        if tail_gid is None:
            return stock_initialize(self, kv_cache_config, kernel_block_sizes)
        all_names = self._draft_attn_layer_names
        self._draft_attn_layer_names = all_names - tail_names
        try:
            stock_initialize(self, kv_cache_config, kernel_block_sizes)
        finally:
            self._draft_attn_layer_names = all_names
        self.draft_attn_groups.append(
            _tail_attention_group(self, kv_cache_config, tail_gid, tail_names, kernel_block_sizes)
        )
        self._glmctl_tail_gid = tail_gid

    def build_per_group_and_layer_attn_metadata(self, common_attn_metadata, draft_index=0):
        tail_gid = getattr(self, "_glmctl_tail_gid", None)
        if tail_gid is None:
            return stock_build(self, common_attn_metadata, draft_index)
        per_group, per_layer = [], {}
        for group in self.draft_attn_groups:
            cm = common_attn_metadata
            if group.kv_cache_group_id == tail_gid:
                cm = _tail_metadata(self, cm, tail_gid)
            metadata = group.get_metadata_builder().build_for_drafting(
                common_attn_metadata=cm, draft_index=draft_index
            )
            per_group.append(metadata)
            for name in group.layer_names:
                per_layer[name] = metadata
        return per_group, per_layer

    SpecDecodeBaseProposer.__init__ = __init__
    SpecDecodeBaseProposer.initialize_attn_backend = initialize_attn_backend
    SpecDecodeBaseProposer.build_per_group_and_layer_attn_metadata = (
        build_per_group_and_layer_attn_metadata
    )
    SpecDecodeBaseProposer._glmctl_wrapped = True
    return "MTP drafter"


def _tail_group(draft_names: set[str], kv_cache_config):
    """(group id, layer names) of the draft layers in a kpool-tail group, or (None, set())."""
    from vllm.v1.kv_cache_interface import KpoolTailSpec, UniformTypeKVCacheSpecs

    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        names = draft_names & set(group.layer_names)
        if not names:
            continue
        spec = group.kv_cache_spec
        specs = spec.kv_cache_specs.values() if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
        if all(isinstance(s, KpoolTailSpec) for s in specs):
            return gid, names
    return None, set()


def _tail_attention_group(proposer, kv_cache_config, gid, names, kernel_block_sizes):
    from vllm.config.vllm import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs
    from vllm.v1.worker.utils import AttentionGroup

    layers = get_layers_from_vllm_config(proposer.vllm_config, AttentionLayerBase)
    spec = kv_cache_config.kv_cache_groups[gid].kv_cache_spec
    ordered = sorted(names)
    if isinstance(spec, UniformTypeKVCacheSpecs):
        spec = spec.kv_cache_specs[ordered[0]]
    group = AttentionGroup(
        backend=layers[ordered[0]].get_attn_backend(),
        layer_names=ordered,
        kv_cache_spec=spec,
        kv_cache_group_id=gid,
    )
    kernel_block_size = (
        kernel_block_sizes[gid] if kernel_block_sizes is not None and gid < len(kernel_block_sizes)
        else None
    )
    group.create_metadata_builders(proposer.vllm_config, proposer.device,
                                   kernel_block_size=kernel_block_size)
    return group


def _tail_metadata(proposer, cm, gid):
    """The draft step's common metadata, addressed through the tail group's blocks."""
    runner = proposer._glmctl_runner
    block_table = runner.input_batch.block_table[gid].get_device_tensor(cm.num_reqs)
    return cm.replace(block_table_tensor=block_table,
                      positions=proposer._get_positions(cm.num_actual_tokens))


def _install_tail_ring() -> None:
    """Size every kpool tail ring for the configured draft count (see `layouts.kpool_tail_ring`).

    vLLM derives the tail slots (`block * block_size + position % block_size`) and the tensor
    (`[blocks, 2, block_size, head_dim]`) from the spec's block size, and glmctl's kpool writes
    take the ring size from that tensor, so the spec is the one place to change.
    """
    from dataclasses import replace

    from vllm.models.glm5next.nvidia.attention import Glm5NextTailCache

    from glmctl.kernels.layouts import kpool_tail_ring
    from glmctl.plugin.policy import num_speculative_tokens

    if getattr(Glm5NextTailCache.get_kv_cache_spec, "_glmctl", False):
        return
    stock = Glm5NextTailCache.get_kv_cache_spec

    def get_kv_cache_spec(self, vllm_config):
        spec = stock(self, vllm_config)
        ring = kpool_tail_ring(self._index_kpool, num_speculative_tokens(vllm_config))
        if ring == spec.block_size:
            return spec
        return replace(spec, block_size=ring, sliding_window=ring)

    get_kv_cache_spec._glmctl = True
    Glm5NextTailCache.get_kv_cache_spec = get_kv_cache_spec
