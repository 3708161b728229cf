"""vLLM 0.30's own KV-cache numbers for a GLM-5.3-Flash config, computed on CPU (the oracle).

Run as a script in a subprocess (it installs import hooks):

    python tests/vllm/kv_oracle.py '<json request>'   ->  prints one JSON result line

Everything that produces a number is vLLM's code, called the way a CUDA worker calls it:
- block size: `Platform._align_hybrid_block_size` on vLLM's `CudaPlatform` (sm_89), after setting
  the backend's preferred block size (phase 1 of `update_block_size_for_backend`);
- the MLA cache dtype a backend gets for `--kv-cache-dtype`: vLLM's
  `_canonicalize_sparse_mla_kv_cache_dtype` with the backend class (request `"backend":
  "glmctl"`: glmctl's sparse-MLA backend, as `MLAAttention.__init__` calls it), reported with
  what a backend named FLASHMLA_SPARSE would get;
- per-layer specs: `MLAAttention.get_kv_cache_spec`, the real `Glm5NextIndexerCache` /
  `Glm5NextTailCache` modules' `get_kv_cache_spec`, and `MambaBase.get_kv_cache_spec` with
  `Glm5NextLinearAttention.get_state_shape/get_state_dtype` (`vllm/models/glm5next/nvidia/`);
- grouping, block count and capacity: `get_kv_cache_configs`, `generate_scheduler_kv_cache_config`
  and `get_kv_cache_capacity` (`vllm/v1/core/kv_cache_utils.py`).

What is a stand-in, and why:
- `ModelConfig` and `SpeculativeConfig`: building the real ones makes vLLM inspect the architecture
  by importing `vllm.models.glm5next`, whose package `__init__` imports the multimodal model ->
  transformers' glm4v image processor -> torchvision, which the CPU environment does not have (its
  CUDA wheel breaks `import vllm`). The stand-ins carry exactly the attributes vLLM reads here.
  For the same reason `vllm.models.glm5next` is registered as a bare package so that importing
  `nvidia/attention.py` and `nvidia/kda.py` does not run that `__init__`.
- The layer objects whose `get_kv_cache_spec` needs a constructed attention backend (MLA, KDA) are
  called unbound on plain objects holding the attributes their constructors would set; building
  them needs a CUDA attention backend that the CPU platform refuses for sparse MLA.
- The attention backend handed to the block-size alignment is a class with FlashMLA-sparse's
  kernel block sizes (vLLM's FlashMLA-sparse module imports CUDA kernels).

Request `"plugin": true` installs glmctl's plugin block rule the way the plugin does
(`glmctl.plugin.adapters._install_kpool_block_alignment` on the platform class). `"platform":
"cpu"` runs vLLM's `CpuPlatform` alignment instead, from the block vLLM CPU starts with for MLA
models (16, `CpuPlatform.check_and_update_config`, stated here: that method needs a real model
config) raised by the plugin's own CPU hook (`config_hooks._fix_cpu_cache_config`, called).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import vllm

_GLM5NEXT = Path(vllm.__file__).parent / "models" / "glm5next"


def _bare_glm5next_package() -> None:
    # vllm/platforms/cuda.py registers CUDA custom ops on import; on CPU there are none to register.
    sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
    pkg = types.ModuleType("vllm.models.glm5next")
    pkg.__path__ = [str(_GLM5NEXT)]
    sys.modules["vllm.models.glm5next"] = pkg


def _model_config(cfg: dict, max_model_len: int):
    import torch
    from transformers import PretrainedConfig

    hf = PretrainedConfig(**cfg)
    return SimpleNamespace(
        dtype=torch.bfloat16,
        max_model_len=max_model_len,
        original_max_model_len=max_model_len,
        use_mla=True,
        is_hybrid=True,
        architecture=cfg["architectures"][0],
        hf_config=hf,
        hf_text_config=hf,
        get_head_size=lambda: cfg["kv_lora_rank"] + (cfg.get("qk_rope_head_dim") or 0),
        get_num_kv_heads=lambda parallel_config: 1,
        get_total_num_hidden_layers=lambda: cfg["num_hidden_layers"],
    )


def compute(request: dict) -> dict:
    _bare_glm5next_package()
    import torch
    from vllm.config import (
        CacheConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.model_executor.models import ModelRegistry
    from vllm.models.glm5next.nvidia.attention import Glm5NextIndexerCache, Glm5NextTailCache
    from vllm.models.glm5next.nvidia.kda import Glm5NextLinearAttention
    from vllm.platforms.cuda import CudaPlatform
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_kv_cache_capacity,
        get_kv_cache_configs,
    )

    cfg = json.loads(Path(request["config"]).read_text())
    tp, num_spec = request["tp"], request["num_spec"]
    max_model_len = request["max_model_len"]
    cache_dtype = request["kv_cache_dtype"]

    cache_config = CacheConfig(
        block_size=None, cache_dtype=cache_dtype, enable_prefix_caching=request["prefix_caching"]
    )
    vllm_config = VllmConfig(
        cache_config=cache_config,
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        scheduler_config=SchedulerConfig(max_model_len=max_model_len, is_encoder_decoder=False),
    )
    model_config = _model_config(cfg, max_model_len)
    object.__setattr__(vllm_config, "model_config", model_config)
    if num_spec:
        object.__setattr__(vllm_config, "speculative_config", SimpleNamespace(
            num_speculative_tokens=num_spec, use_multi_module_mtp=lambda: False,
            uses_dynamic_speculative_decoding=lambda: False, method="mtp", parallel_drafting=False,
        ))
    # MambaModelConfig.verify_and_update_config: prefix caching -> "align" mode, block = attention's
    cache_config.mamba_cache_mode = "align" if request["prefix_caching"] else "none"
    cache_config.mamba_block_size = None if request["prefix_caching"] else max_model_len

    class Sm89Cuda(CudaPlatform):
        @classmethod
        def get_device_capability(cls, device_id: int = 0):
            return DeviceCapability(major=8, minor=9)

    class SparseMlaBackend:  # FlashMLA-sparse's kernel block sizes (v1/attention/backends/mla)
        @staticmethod
        def get_supported_kernel_block_sizes():
            return [request["kernel_block_size"]]

    kda_layer = SimpleNamespace(
        tp_size=tp, num_heads=cfg["linear_num_heads"], head_dim=cfg["linear_head_dim"],
        conv_size=cfg["linear_conv_kernel_dim"], num_spec=num_spec,
        model_config=model_config, cache_config=cache_config,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN, is_kv_cache_tp_replicated=False,
    )
    kda_layer.get_state_shape = lambda: Glm5NextLinearAttention.get_state_shape(kda_layer)
    kda_layer.get_state_dtype = lambda: Glm5NextLinearAttention.get_state_dtype(kda_layer)

    class Glm5NextStandIn:  # what _align_hybrid_block_size asks the model class for
        @classmethod
        def get_mamba_state_shape_from_config(cls, _):
            return kda_layer.get_state_shape()

        @classmethod
        def get_mamba_state_dtype_from_config(cls, _):
            return kda_layer.get_state_dtype()

    ModelRegistry.resolve_model_cls = lambda *a, **k: (Glm5NextStandIn, cfg["architectures"][0])
    platform_cls = Sm89Cuda
    if request.get("platform") == "cpu":
        from vllm.platforms.cpu import CpuPlatform

        platform_cls = CpuPlatform
        cache_config.block_size = 16  # CpuPlatform.check_and_update_config: CPU MLA pins 16
        if request.get("plugin"):
            from glmctl.plugin.config_hooks import _fix_cpu_cache_config

            _fix_cpu_cache_config(vllm_config)
    else:
        cache_config.block_size = request["kernel_block_size"]  # phase 1: backend's preferred size
        if request.get("user_block_size"):
            cache_config.block_size = request["user_block_size"]
    if request.get("plugin"):
        _install_plugin_block_rule(platform_cls)
    platform_cls._align_hybrid_block_size(vllm_config, SparseMlaBackend)
    if cache_config.mamba_cache_mode == "align":
        cache_config.mamba_block_size = cache_config.block_size

    layer_types = [
        "indexed_attention" if t in ("indexed_attention", "full_attention") else t for t in cfg["layer_types"]
    ]
    mtp_layers = list(range(cfg["num_hidden_layers"], cfg["num_hidden_layers"] + cfg["num_nextn_predict_layers"]))
    mla_ids = [i for i, t in enumerate(layer_types) if t == "indexed_attention"] + (mtp_layers if num_spec else [])
    kda_ids = [i for i, t in enumerate(layer_types) if t == "linear_attention"]

    mla_dtype, flashmla_dtype = _mla_cache_dtypes(request.get("backend"), cache_dtype)
    specs: dict = {}
    with set_current_vllm_config(vllm_config):
        for i in mla_ids:
            prefix = f"model.layers.{i}.self_attn"
            mla = SimpleNamespace(kv_cache_dtype=mla_dtype, head_size=model_config.get_head_size(),
                                  sliding_window=None, indexer=object(), non_causal_multi_token_decode=False)
            specs[f"{prefix}.attn"] = MLAAttention.get_kv_cache_spec(mla, vllm_config)
            kw = dict(head_dim=cfg["index_head_dim"], cache_config=cache_config, index_kpool=cfg["index_kpool"])
            specs[f"{prefix}.indexer.k_cache"] = Glm5NextIndexerCache(
                dtype=torch.uint8, prefix=f"{prefix}.indexer.k_cache",
                **{**kw, "head_dim": cfg["index_head_dim"] + cfg["index_head_dim"] // 128 * 4},
            ).get_kv_cache_spec(vllm_config)
            specs[f"{prefix}.indexer.tail_cache"] = Glm5NextTailCache(
                dtype=torch.bfloat16, prefix=f"{prefix}.indexer.tail_cache", **kw
            ).get_kv_cache_spec(vllm_config)
        for i in kda_ids:
            specs[f"model.layers.{i}.self_attn"] = MambaBase.get_kv_cache_spec(kda_layer, vllm_config)

    def kind(name: str) -> str:
        return name.rsplit(".", 1)[-1] if "indexer" in name else ("mla" if name.endswith(".attn") else "kda")

    pages: dict[str, set] = {}
    for name, spec in specs.items():
        pages.setdefault(kind(name), set()).add((spec.page_size_bytes, spec.real_page_size_bytes))
    result: dict = {
        "mla_kv_cache_dtype": mla_dtype,
        "flashmla_sparse_kv_cache_dtype": flashmla_dtype,
        "block_size": cache_config.block_size,
        # one (page, real page) pair per layer kind; a kind with two sizes would show two pairs
        "pages": {k: sorted(v) for k, v in pages.items()},
        "layers": {k: sum(1 for n in specs if kind(n) == k) for k in pages},
    }
    try:
        configs = get_kv_cache_configs(vllm_config, [specs], [request["available_bytes"]])
    except (ValueError, AssertionError, NotImplementedError) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        return result
    scheduler = generate_scheduler_kv_cache_config(configs)
    tokens, concurrency = get_kv_cache_capacity(vllm_config, scheduler)
    result.update(
        num_blocks=configs[0].num_blocks,
        kv_tokens=tokens,
        max_concurrency=concurrency,
        groups=[[type(g.kv_cache_spec).__name__, len(g.layer_names)] for g in configs[0].kv_cache_groups],
        tensor_bytes=max(t.size for t in configs[0].kv_cache_tensors),
    )
    return result


def _install_plugin_block_rule(platform_cls) -> None:
    """The plugin's own installers of its block rule (on the current platform's class, here
    `platform_cls`) and of its tail ring (`Glm5NextTailCache.get_kv_cache_spec`)."""
    import vllm.platforms as platforms

    from glmctl.plugin.adapters import _install_kpool_block_alignment
    from glmctl.plugin.spec_decode.mtp import _install_tail_ring

    saved = platforms._current_platform
    platforms._current_platform = platform_cls()
    try:
        _install_kpool_block_alignment()
    finally:
        platforms._current_platform = saved
    _install_tail_ring()


def compute_isolated(request: dict) -> dict:
    """`compute`, with the plugin's class patches undone afterwards (so the stock cases of the same
    process stay stock; CpuPlatform keeps its patch, only plugin cases run on it)."""
    from vllm.models.glm5next.nvidia.attention import Glm5NextTailCache

    tail_spec = Glm5NextTailCache.get_kv_cache_spec
    try:
        return compute(request)
    finally:
        Glm5NextTailCache.get_kv_cache_spec = tail_spec


def _mla_cache_dtypes(backend: str | None, cache_dtype: str) -> tuple[str, str]:
    """(the MLA layer's cache dtype with the requested backend, with one named
    FLASHMLA_SPARSE), from vLLM's own mapping."""
    from vllm.model_executor.layers.attention.mla_attention import (
        _canonicalize_sparse_mla_kv_cache_dtype as canonical,
    )

    class FlashMlaSparseName:
        @staticmethod
        def get_name():
            return "FLASHMLA_SPARSE"

    ours = cache_dtype
    if backend == "glmctl":
        from glmctl.plugin.attention.sparse_mla import GlmctlSparseMLABackend

        ours = canonical(GlmctlSparseMLABackend, cache_dtype)
    return ours, canonical(FlashMlaSparseName, cache_dtype)


if __name__ == "__main__":
    requests = json.loads(sys.argv[1])
    _bare_glm5next_package()
    print("@@" + json.dumps([compute_isolated(r) for r in requests]))
