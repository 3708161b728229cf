"""Route a GLM-5.3-Flash checkpoint's attention weights into the layers `fp8_attention` built.

`wrap_load_weights(stock)` wraps `Glm5NextModel.load_weights` / `Glm5NextMTP.load_weights`: the
weights stream passes through an `AttentionWeightRouter`, and what the router returns joins the
set of parameters vLLM's loader reports as loaded. Per checkpoint tensor `...layers.L.self_attn.X.
{weight,weight_scale_inv}` of a layer whose constructor the plugin saw (`_glmctl_fp8_block`):

- KDA q/k/v/b/f_a/g_a of a `KdaInputProjections`: loaded here, with vLLM's own parameter loaders
  (`weight_loader(param, tensor, shard)`: shard offsets, TP narrowing, replicated f_a/g_a);
- an FP8 tensor for a unit built in BF16 that vLLM's loader cannot dequantise itself (KDA
  q/k/v/b/f_a/g_a/f_b/g_b, kv_b_proj, indexer wq_b / weights_proj): weight and scale are paired,
  dequantised exactly (`dequantize_block_fp8`, fp32 product rounded once to the model dtype) and
  passed on as a BF16 weight under the checkpoint name, so vLLM places it as it places BF16;
- a BF16 tensor for a unit built in FP8: a clear error (vLLM's loaders would cast it to e4m3
  without a scale and serve garbage);
- everything else, untouched (vLLM's loader also keeps its own FP8->BF16 paths for q_a/kv_a,
  q_b, o_proj and indexer wk).
"""

from __future__ import annotations

import re

import torch

from glmctl.errors import ConfigError
from glmctl.plugin.quantization.fp8_selection import (
    ATTENTION_ROWS,
    KDA_BFG_A,
    KDA_INPUT,
    KDA_QKV,
    site,
)
from glmctl.quantize.fp8 import dequantize_block_fp8

# checkpoint leaf -> the fused module under self_attn that holds it in vLLM
_TARGET = {leaf: p.gemm.removeprefix("self_attn.") for _, leaf, p in ATTENTION_ROWS if p.fused}
# FP8 leaves vLLM 0.30's loader has no BF16-at-load path for (it has one for q_a/kv_a, q_b, o_proj, wk)
_DEQUANTIZED_HERE = frozenset(leaf for _, leaf, p in ATTENTION_ROWS if p.stock == "rejected")
_CONSUMED = object()
_ATTN_MODULE = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:mtp_block\.)?self_attn$")


def attention_modules(model) -> dict[int, object]:
    """layer index -> self_attn module of a built Glm5NextModel / Glm5NextMTP."""
    found = {}
    for name, module in model.named_modules():
        m = _ATTN_MODULE.search(name)
        if m:
            found[int(m[1])] = module
    return found


def wrap_load_weights(stock):
    def load_weights(self, weights):
        router = AttentionWeightRouter(self)
        loaded = stock(self, router.route(weights))
        return set(loaded) | router.finish()

    return load_weights


class AttentionWeightRouter:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.attention = {layer: attn for layer, attn in attention_modules(model).items()
                          if getattr(attn, "_glmctl_fp8_block", None)}
        self.pending: dict[tuple[int, str], dict] = {}
        self.loaded: set[str] = set()
        self._param_names: dict[int, str] | None = None

    def route(self, weights):
        for item in weights:
            out = self._take(item[0], item[1]) if self.attention else None
            if out is None:
                yield item
            elif out is not _CONSUMED:
                yield (*out, *item[2:])

    def finish(self) -> set[str]:
        if self.pending:
            (layer, leaf), parts = next(iter(self.pending.items()))
            has, missing = ("weight", "weight_scale_inv") if "weight" in parts else ("weight_scale_inv", "weight")
            raise ConfigError(f"layer {layer} self_attn.{leaf}: the checkpoint has an FP8 {has} but no "
                              f"{missing} ({len(self.pending)} such module(s))",
                              hint="the checkpoint is incomplete; re-run glmctl quantize fp8 / glmctl quantize verify")
        return self.loaded

    # -- one tensor -------------------------------------------------------------------------------

    def _take(self, name: str, tensor: torch.Tensor):
        kind = "weight" if name.endswith(".weight") else "scale" if name.endswith(".weight_scale_inv") else None
        found = site(name.rsplit(".", 1)[0]) if kind else None
        attn = self.attention.get(found[0]) if found else None
        if attn is None:
            return None
        layer, leaf = found
        fp8 = tensor.dtype == torch.float8_e4m3fn
        split = getattr(attn, "in_proj_qkvbfg_a", None)
        if leaf in KDA_INPUT and hasattr(split, "bfg_a"):
            self._load_kda_input(attn, split, layer, leaf, kind, tensor, name)
            return _CONSUMED
        target = _target(attn, leaf)
        if target is None:
            return None
        if hasattr(target, "weight_scale_inv"):
            if kind == "weight" and not fp8:
                raise _bf16_into_fp8(name, tensor)
            return None
        if leaf not in _DEQUANTIZED_HERE or (kind == "weight" and not fp8):
            return None
        done = self._pair(attn, layer, leaf, kind, tensor, name, target.weight.dtype)
        return _CONSUMED if done is None else done

    def _load_kda_input(self, attn, split, layer: int, leaf: str, kind: str, tensor, name: str) -> None:
        group, shard = (split.qkv, KDA_QKV.index(leaf)) if leaf in KDA_QKV else (split.bfg_a, KDA_BFG_A.index(leaf))
        if hasattr(group, "weight_scale_inv"):
            if kind == "weight" and tensor.dtype != torch.float8_e4m3fn:
                raise _bf16_into_fp8(name, tensor)
            self._load(group.weight if kind == "weight" else group.weight_scale_inv, tensor, shard)
        elif kind == "weight" and tensor.dtype != torch.float8_e4m3fn:
            self._load(group.weight, tensor, shard)
        else:
            done = self._pair(attn, layer, leaf, kind, tensor, name, group.weight.dtype)
            if done is not None:
                self._load(group.weight, done[1], shard)

    def _pair(self, attn, layer: int, leaf: str, kind: str, tensor, name: str, dtype):
        """Hold an FP8 weight until its scale arrives (or the reverse); then the BF16 weight."""
        parts = self.pending.setdefault((layer, leaf), {})
        parts[kind] = tensor
        if kind == "weight":
            parts["name"] = name
        if "weight" not in parts or "scale" not in parts:
            return None
        del self.pending[(layer, leaf)]
        return parts["name"], dequantize_block_fp8(parts["weight"], parts["scale"], attn._glmctl_fp8_block, dtype)

    def _load(self, param, tensor, shard: int) -> None:
        param.weight_loader(param, tensor, shard)
        if self._param_names is None:
            self._param_names = {id(p): n for n, p in self.model.named_parameters()}
        self.loaded.add(self._param_names[id(param)])


def _target(attn, leaf: str):
    try:
        return attn.get_submodule(_TARGET.get(leaf, leaf))
    except AttributeError:
        return None


def _bf16_into_fp8(name: str, tensor) -> ConfigError:
    return ConfigError(
        f"{name} is {str(tensor.dtype).removeprefix('torch.')} in the checkpoint, but glmctl built its "
        "layer in block FP8 from the quantization_config's modules_to_not_convert (the checkpoint's "
        "tensor names could not be read before loading)",
        hint="serve the checkpoint from a local directory (glmctl fetch), list the module in "
             "modules_to_not_convert, or set GLMCTL_FP8_ATTENTION=off")
