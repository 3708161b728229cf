"""Subprocess body of test_tiny_checkpoint_vllm: vLLM 0.30 parses the tiny checkpoint and loads it.

    python tests/vllm/tiny_vllm_load.py CHECKPOINT PORT   -> one JSON line on stdout

Builds vLLM's own Glm5NextForCausalLM and Glm5NextMTP on the CPU and feeds every checkpoint tensor
to their `load_weights`. Stock vLLM-CPU refuses to *construct* sparse MLA ("Sparse Attention is not
supported on CPU"), so the attention backend lookup returns the dense CPU MLA backend for sparse
layers: nothing runs attention here, only parameter creation and weight loading.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def dense_mla_stands_in_for_sparse() -> None:
    """Stock vLLM-CPU refuses to *construct* sparse MLA; where nothing runs attention (parameter
    creation and weight loading), vLLM's dense CPU MLA backend stands in for it."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    dense_lookup = CpuPlatform.get_attn_backend_cls.__func__

    def lookup(cls, selected_backend, attn_selector_config, num_heads=None):
        if attn_selector_config.use_sparse:
            return AttentionBackendEnum.CPU_MLA.get_path()
        return dense_lookup(cls, selected_backend, attn_selector_config=attn_selector_config, num_heads=num_heads)

    CpuPlatform.get_attn_backend_cls = classmethod(lookup)


def mtp_vllm_config(path: str):
    """vLLM's config for the checkpoint at `path` on CPU with one MTP token, as these load tests
    build it (block 512, prefix caching off, no kernel warm-up)."""
    from vllm.config import (
        CacheConfig,
        KernelConfig,
        LoadConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
    )

    model_config = ModelConfig(model=path, dtype="bfloat16", max_model_len=4096)
    parallel = ParallelConfig()
    return VllmConfig(
        model_config=model_config,
        # vLLM-CPU turns prefix caching off for MLA models, which a hybrid model must know up front.
        cache_config=CacheConfig(block_size=512, enable_prefix_caching=False),
        kernel_config=KernelConfig(enable_jit_warmup=False),  # no tilelang on CPU
        load_config=LoadConfig(),
        parallel_config=parallel,
        speculative_config=SpeculativeConfig(
            method="mtp", num_speculative_tokens=1, target_model_config=model_config,
            target_parallel_config=parallel,
        ),
    )


def draft_vllm_config(vllm_config):
    """The same config with the MTP draft model's model config (what Glm5NextMTP is built with)."""
    import copy

    draft = copy.copy(vllm_config)
    draft.model_config = vllm_config.speculative_config.draft_model_config
    return draft


def init_single_process(vllm_config, port: int) -> None:
    """vLLM's distributed state for one CPU process (gloo on `port`)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
        initialize_model_parallel(1, 1)


def checkpoint_tensors(path: str) -> dict:
    """Every tensor of the checkpoint, shard by shard in the index's shard order."""
    from safetensors.torch import load_file

    index = json.loads((Path(path) / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(Path(path) / shard)))
    return tensors


def main(path: str, port: int) -> dict:

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.config.speculative import SpeculativeConfig as _Spec

    dense_mla_stands_in_for_sparse()

    vllm_config = mtp_vllm_config(path)
    model_config = vllm_config.model_config
    hf = model_config.hf_config
    report = {
        "config_class": type(hf).__name__,
        "architectures": model_config.architectures,
        "attrs": {k: getattr(hf, k) for k in (
            "index_topk", "index_kpool", "index_head_dim", "index_n_heads", "kv_lora_rank", "qk_rope_head_dim",
            "mla_nope", "swiglu_limit", "topk_method", "num_experts_per_token", "moe_renormalize",
            "mhc", "mhc_num_residual_streams", "mhc_sinkhorn_iterations", "linear_num_heads",
            "linear_head_dim", "num_nextn_predict_layers", "mlp_layer_types", "layers_block_type",
        )},
    }
    from vllm.tokenizers.registry import get_tokenizer

    tokenizer = get_tokenizer(path)
    report["tokenizer"] = {
        "eos_token_id": tokenizer.eos_token_id,
        "size": len(tokenizer),
        "chat": tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                              add_generation_prompt=True),
    }
    draft = vllm_config.speculative_config.draft_model_config
    report["draft"] = {"model_type": draft.hf_config.model_type, "architectures": draft.architectures,
                       "n_predict": draft.hf_config.n_predict}
    report["mtp_rewrite_of_text_type"] = _Spec.hf_config_override(
        type(hf)(**{**hf.to_dict(), "model_type": "glm5_next_text"})
    ).model_type

    tensors = checkpoint_tensors(path)
    weights = list(tensors.items())

    init_single_process(vllm_config, port)
    from vllm.models.glm5next import Glm5NextForCausalLM, Glm5NextMTP

    with set_current_vllm_config(vllm_config), torch.device("cpu"):
        main_model = Glm5NextForCausalLM(vllm_config=vllm_config)
        loaded = main_model.load_weights(weights)
    params = dict(main_model.named_parameters())
    report["main"] = {"params": len(params), "not_loaded": sorted(set(params) - loaded),
                      "unknown": sorted(loaded - set(params))}
    # Spot-check values through the fused/reshaped paths (stacked shards, 1-D -> 4-D A_log).
    fused = params["model.layers.1.self_attn.indexer.wk_weights_proj.weight"].data
    want = torch.cat([tensors["model.layers.1.self_attn.indexer.wk.weight"],
                      tensors["model.layers.1.self_attn.indexer.weights_proj.weight"]])
    a_log = params["model.layers.0.self_attn.A_log"].data.flatten()
    report["values_match"] = bool(torch.equal(fused, want.to(fused.dtype))) and bool(
        torch.equal(a_log, tensors["model.layers.0.self_attn.A_log"].to(a_log.dtype)))

    draft_config = draft_vllm_config(vllm_config)
    with set_current_vllm_config(draft_config), torch.device("cpu"):
        mtp = Glm5NextMTP(vllm_config=draft_config)
        loaded = mtp.load_weights(weights)
    params = dict(mtp.named_parameters())
    report["mtp"] = {"params": len(params), "not_loaded": sorted(set(params) - loaded),
                     "unknown": sorted(loaded - set(params))}
    return report


if __name__ == "__main__":
    print("@@" + json.dumps(main(sys.argv[1], int(sys.argv[2]))), flush=True)
