"""Serve GLM-5.3-Flash checkpoints whose attention projections are block FP8 (`glmctl quantize fp8`).

vLLM 0.30 builds KDA and MLA projections without a quant config and refuses FP8 KDA q/k/v,
`kv_b_proj` and `indexer.wq_b`. `install_fp8_attention()` (called by `register()` on every
platform) makes vLLM build them as `fp8_selection` describes, in three places:

1. `Glm5NextLinearAttention.__init__`: after vLLM's own constructor, the KDA projections that are
   FP8 in the checkpoint are rebuilt with `AttentionFp8Config` (`in_proj_qkvbfg_a` becomes
   `KdaInputProjections`: an FP8 [q,k,v] GEMM plus a BF16 [b,f_a,g_a] GEMM).
2. `Glm5NextMLAAttention.__init__`: vLLM's constructor gets an `AttentionFp8Config` naming the
   FP8 units (fused q_a/kv_a, q_b, o_proj, indexer wq_b) instead of `quant_config=None`.
3. `Glm5NextModel.load_weights` / `Glm5NextMTP.load_weights`: the weights stream passes through
   `AttentionWeightRouter` first; it loads the split KDA projections itself and dequantises
   (exactly, `glmctl.quantize.fp8.dequantize_block_fp8`) FP8 tensors of units held in BF16 that
   vLLM's loader cannot take (KDA b/f_a/g_a, kv_b_proj, indexer weights_proj, anything unaligned).
   Everything else goes to vLLM's loader unchanged; its own BF16-at-load paths stay in use.

When it acts: the model hooks are installed in a process once it has seen a GLM-5.3-Flash config
whose quant config is block FP8 (the platform's `check_and_update_config`, like `activation`), and
`GLMCTL_FP8_ATTENTION_ACTIVE` carries that to the engine and worker processes. Each layer then
decides from its own `vllm_config`; a BF16 checkpoint builds exactly what vLLM builds.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from glmctl import switches
from glmctl.plugin.patching import wrap_once
from glmctl.plugin.quantization.fp8_selection import (
    KDA_QKV,
    MLA_QKV_A,
    AttentionFp8Selection,
    block_fp8_of,
    checkpoint_tensor_names,
    fits_block,
    method_kind,
    select,
    site,
    switched_off,
)

logger = logging.getLogger("vllm.glmctl")
_MARK = "_glmctl_fp8_attention"


def install_fp8_attention(env: Mapping[str, str] | None = None) -> None:
    """Called by `register()` in every vLLM process with the switches it read (default: this
    process's environment); idempotent; nothing when switched off."""
    if switched_off(env):
        return
    if switches.read("GLMCTL_FP8_ATTENTION_ACTIVE", env):
        install_model_hooks()
        return
    from vllm.platforms import current_platform

    platform_cls = type(current_platform)
    inner = platform_cls.check_and_update_config
    if getattr(inner, _MARK, False):
        return

    def check_and_update_config(cls, vllm_config) -> None:
        inner(vllm_config)
        from glmctl.plugin.policy import model_is_glm5_next

        if model_is_glm5_next(vllm_config) and _block_fp8(vllm_config.quant_config) is not None:
            switches.hand_over("GLMCTL_FP8_ATTENTION_ACTIVE", "1")
            install_model_hooks()

    setattr(check_and_update_config, _MARK, True)
    platform_cls.check_and_update_config = classmethod(check_and_update_config)


def install_model_hooks() -> None:
    # vLLM's GLM-5.3-Flash package before its submodules (the order vLLM itself imports them in)
    import vllm.models.glm5next  # noqa: F401
    from vllm.models.glm5next.nvidia import attention, kda, model, mtp

    from glmctl.plugin.quantization.fp8_glmctl import install_fp8_linear_kernel
    from glmctl.plugin.quantization.fp8_loading import wrap_load_weights

    for cls, name, make in ((kda.Glm5NextLinearAttention, "__init__", _kda_init),
                            (attention.Glm5NextMLAAttention, "__init__", _mla_init),
                            (model.Glm5NextModel, "load_weights", wrap_load_weights),
                            (mtp.Glm5NextMTP, "load_weights", wrap_load_weights)):
        wrap_once(cls, name, make, "fp8_attention")
    install_fp8_linear_kernel()


# -- which units are FP8 -----------------------------------------------------------------------------


class Fp8AttentionPlan:
    """One model config's FP8 attention setup: vLLM's Fp8Config, the method kind, the selection."""

    def __init__(self, inner, kind: str, selection: AttentionFp8Selection) -> None:
        self.inner, self.kind, self.selection = inner, kind, selection
        self.block = selection.block

    def quant_config(self, fp8_prefixes: set[str] | None = None):
        from glmctl.plugin.quantization.fp8_linear import AttentionFp8Config

        return AttentionFp8Config(self.inner, self.kind, fp8_prefixes)


def _block_fp8(quant_config):
    from glmctl.plugin.quantization.fp8_linear import inner_fp8_config

    inner = inner_fp8_config(quant_config) if quant_config is not None else None
    if inner is None:
        return None
    return block_fp8_of(inner.weight_block_size, inner.is_checkpoint_fp8_serialized,
                        inner.activation_scheme, inner.ignored_layers)


def plan_for(vllm_config) -> Fp8AttentionPlan | None:
    """The plan for this config's checkpoint (computed once per quant config object), or None."""
    quant_config = getattr(vllm_config, "quant_config", None)
    if quant_config is None:
        return None
    if _MARK in quant_config.__dict__:
        return quant_config.__dict__[_MARK]
    plan = None
    cfg = _block_fp8(quant_config)
    if cfg is not None:
        from vllm.platforms import current_platform

        from glmctl.plugin.quantization.fp8_linear import inner_fp8_config

        model_config = vllm_config.model_config
        names = checkpoint_tensor_names(str(model_config.model), getattr(model_config, "revision", None))
        plan = Fp8AttentionPlan(inner_fp8_config(quant_config), method_kind(current_platform.is_cpu()),
                                select(cfg, names))
        logger.info("glmctl fp8 attention: block-FP8 %dx%d checkpoint, FP8 attention units from the %s, "
                    "built with %s", cfg.block, cfg.block, plan.selection.source,
                    "vLLM's Fp8LinearMethod" if plan.kind == "vllm" else "exact dequantisation at load")
    quant_config.__dict__[_MARK] = plan
    return plan


def _layer(prefix: str) -> int:
    found = site(prefix + ".x")
    if found is None:
        raise ValueError(f"not a GLM-5.3-Flash attention prefix: {prefix!r}")
    return found[0]


# -- the constructors ---------------------------------------------------------------------------------


def _kda_init(stock):
    def __init__(self, config, vllm_config, prefix: str = "") -> None:
        stock(self, config, vllm_config, prefix)
        plan = plan_for(vllm_config)
        if plan is not None:
            _build_kda_fp8(self, plan, prefix)

    return __init__


def _build_kda_fp8(layer_module, plan: Fp8AttentionPlan, prefix: str) -> None:
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

    from glmctl.plugin.quantization.fp8_linear import KdaInputProjections

    m, sel, block = layer_module, plan.selection, plan.block
    layer, tp = _layer(prefix), m.tp_size
    projection = m.head_dim * m.num_heads
    local = projection // tp
    m._glmctl_fp8_block = block  # read by the weight router
    units = []
    if sel.all_fp8(layer, KDA_QKV) and fits_block([local] * 3, m.hidden_size, block, tp > 1):
        m.in_proj_qkvbfg_a = KdaInputProjections(m.hidden_size, projection, m.num_heads, m.head_dim, tp,
                                                 plan.quant_config(), f"{prefix}.in_proj_qkvbfg_a")
        units.append("qkv")
    for name in ("f_b_proj", "g_b_proj"):
        if sel.all_fp8(layer, (name,)) and fits_block([local], m.head_dim, block, tp > 1):
            setattr(m, name, ColumnParallelLinear(m.head_dim, projection, bias=False,
                                                  quant_config=plan.quant_config(), prefix=f"{prefix}.{name}"))
            units.append(name)
    if sel.all_fp8(layer, ("o_proj",)) and fits_block([m.hidden_size], local, block, False):
        m.o_proj = RowParallelLinear(projection, m.hidden_size, bias=False, quant_config=plan.quant_config(),
                                     prefix=f"{prefix}.o_proj")
        units.append("o_proj")
    m._glmctl_fp8_units = tuple(units)


def _mla_init(stock):
    def __init__(self, vllm_config, config, *args, **kwargs) -> None:
        plan = plan_for(vllm_config)
        units: list[str] = []
        if plan is not None and not args and kwargs.get("quant_config") is None:
            prefix = kwargs.get("prefix", "")
            units = mla_fp8_units(config, plan, prefix, kwargs.get("input_size") or kwargs.get("hidden_size"))
            if units:
                kwargs["quant_config"] = plan.quant_config({f"{prefix}.{u}" for u in units})
        stock(self, vllm_config, config, *args, **kwargs)
        if plan is not None:
            self._glmctl_fp8_block = plan.block  # read by the weight router
            self._glmctl_fp8_units = tuple(units)

    return __init__


def mla_fp8_units(config, plan: Fp8AttentionPlan, prefix: str, input_size: int | None) -> list[str]:
    """The MLA units of the layer at `prefix` that are FP8 in the checkpoint and fit the blocks."""
    from vllm.distributed import get_tensor_model_parallel_world_size

    sel, block, layer = plan.selection, plan.block, _layer(prefix)
    tp = get_tensor_model_parallel_world_size()
    hidden = input_size or config.hidden_size
    heads = config.num_attention_heads // tp
    rope, q_lora = config.qk_rope_head_dim, config.q_lora_rank
    units = []
    if q_lora is None:
        return units  # no fused q_a/kv_a: vLLM's loader cannot place either in FP8
    kv_a_padded = bool(getattr(config, "mla_nope", False)) and rope > 0  # vLLM pads BF16 rows in
    if not kv_a_padded and sel.all_fp8(layer, MLA_QKV_A) and fits_block(
            [q_lora, config.kv_lora_rank + rope], hidden, block, False):
        units.append("fused_qkv_a_proj")
    if sel.all_fp8(layer, ("q_b_proj",)) and fits_block(
            [heads * (config.qk_nope_head_dim + rope)], q_lora, block, tp > 1):
        units.append("q_b_proj")
    if sel.all_fp8(layer, ("o_proj",)) and fits_block([config.hidden_size], heads * config.v_head_dim, block, False):
        units.append("o_proj")
    if config.index_topk is not None and sel.all_fp8(layer, ("indexer.wq_b",)) and fits_block(
            [config.index_n_heads * config.index_head_dim], q_lora, block, False):
        units.append("indexer.wq_b")
    return units

