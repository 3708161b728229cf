"""GLM-5.3-Flash semantics that vLLM 0.30's model code leaves out (all platforms).

Shared indexer layers: a checkpoint's `indexer_types[i] == "shared"` means MLA layer `i` reuses
the top-k selection of the previous indexed layer instead of running its own indexer (the
transformers reference does exactly that; GLM-5.2/5.3 checkpoints can ship such layers). vLLM
0.30 ignores the field and runs every layer's indexer, which selects different tokens. vLLM's
MLA wrapper already has the switch (`skip_topk`: keep the shared top-k buffer the previous
layer wrote); we set it from the config.
"""

from __future__ import annotations

import re

_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


def shared_indexer_layer(config, prefix: str) -> bool:
    """True when the MLA layer at `prefix` reuses the previous layer's top-k."""
    types = getattr(config, "indexer_types", None)
    match = _LAYER_INDEX.search(prefix + ".")
    if not types or match is None:
        return False
    index = int(match.group(1))
    return index < len(types) and index < config.num_hidden_layers and types[index] == "shared"


def install() -> str:
    from vllm.models.glm5next.nvidia.attention import Glm5NextMLAAttention

    from glmctl.plugin.patching import after_init

    def reuse_shared_topk(layer, vllm_config, config, *args, **kwargs):
        if layer.indexer is not None and shared_indexer_layer(config, kwargs.get("prefix", "")):
            layer.mla_attn.skip_topk = True

    after_init(Glm5NextMLAAttention, "shared_indexer", reuse_shared_topk)
    return "shared indexer layers"
