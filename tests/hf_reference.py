"""Load a (tiny) GLM-5.3-Flash text checkpoint into transformers 5.24: the parity oracle.

transformers has no text-only causal-LM class for `glm5_next`; its language-model head lives in
`Glm5NextForConditionalGeneration`, which also builds a vision tower and expects the text weights
under `model.language_model.*`. This loader gives it a one-block vision tower (random, unused for
text) and maps the checkpoint's `model.*` names there; transformers' own conversion mapping does the
rest (per-expert weights -> fused `gate_up_proj`, `q/k/v_conv1d` -> `conv1d`, `hc_*` -> `attn_hc`...).

Keys transformers does not use are expected and returned: the MTP layer (`model.layers.{N}.*`, which
transformers does not implement) and the indexer weights of "shared" indexer layers (transformers
reuses the previous layer's top-k there; vLLM 0.30 runs its own indexer in every MLA layer).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from glmctl.errors import GlmctlError

_TEXT_KEY_MAPPING = {r"^model\.(?!language_model\.|visual\.)": "model.language_model."}


@dataclass
class TransformersLoad:
    model: Any  # Glm5NextForConditionalGeneration, eval mode
    unused_checkpoint_keys: list[str]  # as transformers names them (after its key mapping)


def load_transformers_model(path: str | os.PathLike, dtype: str = "float32") -> TransformersLoad:
    """Glm5NextForConditionalGeneration with every text weight taken from the checkpoint at `path`.

    Raises GlmctlError when any language-model or lm_head weight would be left at random init.
    """
    import torch
    from transformers import AutoConfig
    from transformers.models.glm5_next import Glm5NextForConditionalGeneration, Glm5NextVisionConfig
    from transformers.utils import logging as hf_logging

    config = AutoConfig.from_pretrained(path)
    text = config.text_config
    config.vision_config = Glm5NextVisionConfig(
        depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=text.hidden_size,
        projection_intermediate_size=32,
    )
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the load report lists the vision tower as missing: by design
    try:
        model, info = Glm5NextForConditionalGeneration.from_pretrained(
            path, config=config, dtype=getattr(torch, dtype), key_mapping=_TEXT_KEY_MAPPING,
            output_loading_info=True,
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    missing_text = sorted(k for k in info["missing_keys"] if not k.startswith("model.visual."))
    if missing_text or info["mismatched_keys"] or info["error_msgs"]:
        raise GlmctlError(
            f"transformers left text weights of {path} uninitialised or mismatched: "
            f"missing {missing_text[:5]}, mismatched {sorted(info['mismatched_keys'])[:5]}",
            hint="the checkpoint does not match transformers' glm5_next; rebuild it with this glmctl",
        )
    return TransformersLoad(model=model.eval(), unused_checkpoint_keys=sorted(info["unexpected_keys"]))




def forward_with_routing_gaps(model):
    """`run(ids) -> (log-probs per position, routing gap per position)` for a transformers model:
    hooks on every MoE router record each layer's gaps, the smallest over layers is returned
    (tests.vllm.noise_floor.ROUTING_TIE says which gaps a bf16 run may flip)."""
    import torch

    gaps: list[torch.Tensor] = []
    for module in model.modules():
        if hasattr(module, "e_score_correction_bias") and hasattr(module, "top_k"):
            module.register_forward_hook(lambda mod, _inp, res: gaps.append(routing_gap(mod, res[0])))

    device = next(model.parameters()).device

    def run(ids):
        """`ids`: a list of token ids, or a [1, n] tensor on the model's device."""
        gaps.clear()
        input_ids = ids if isinstance(ids, torch.Tensor) else torch.tensor([ids], device=device)
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=input_ids).logits[0].float(), -1)
        return lp, torch.stack(gaps).min(dim=0).values

    return run


def routing_gap(router, logits):
    """Per token: score of the k-th chosen expert minus the best expert left out (fp32)."""
    import torch

    scores = logits.float().sigmoid() + router.e_score_correction_bias.float()
    groups = getattr(router, "num_group", 1) or 1
    if groups > 1:
        per_group = scores.view(scores.shape[0], groups, -1)
        kept = per_group.topk(2, dim=-1).values.sum(-1).topk(router.topk_group, dim=-1).indices
        mask = torch.zeros(scores.shape[0], groups, dtype=torch.bool, device=scores.device).scatter_(1, kept, True)
        scores = scores.masked_fill(~mask.repeat_interleave(per_group.shape[-1], dim=1), float("-inf"))
    top = scores.topk(router.top_k + 1, dim=-1).values
    return top[:, router.top_k - 1] - top[:, router.top_k]
