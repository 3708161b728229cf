"""Installing glmctl changes nothing in vLLM for a model it does not handle.

In a fresh process, as `vllm serve` would: vLLM loads its general plugins (ours included, in
"auto"), then builds its engine config for a tiny Llama on the CPU platform. The plugin must
activate nothing (no backend, no custom op, no platform hook beyond its pass-through gate, no
environment marker), log that it is inactive, and leave the config exactly as with the plugin off.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.vllm

PROBE = textwrap.dedent(
    """
    import json, os, sys
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    from vllm.engine.arg_utils import EngineArgs
    cfg = EngineArgs(model=sys.argv[1], max_model_len=1024, enforce_eager=True,
                     dtype="bfloat16").create_engine_config()
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from glmctl.plugin import activation
    print("@@" + json.dumps({
        "active": activation.is_active(),
        "adapters": list(activation.installed_adapters()),
        "oot_ops": sorted(op_registry_oot),
        "custom_backend": AttentionBackendEnum.CUSTOM.is_overridden(),
        "backend_lookup": CpuPlatform.get_attn_backend_cls.__func__.__module__,
        "env_marker": os.environ.get("GLMCTL_PLUGIN_ACTIVE"),
        "config": {
            "block_size": cfg.cache_config.block_size,
            "prefix_caching": cfg.cache_config.enable_prefix_caching,
            "jit_warmup": cfg.kernel_config.enable_jit_warmup,
            "mamba_block_size": cfg.cache_config.mamba_block_size,
            "chunked_prefill": cfg.scheduler_config.enable_chunked_prefill,
            "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
        },
    }))
    """
)


@pytest.fixture(scope="module")
def tiny_llama(tiny_checkpoint, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 2048,
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
        "torch_dtype": "bfloat16", "eos_token_id": 1, "rms_norm_eps": 1e-5,
    }))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_checkpoint.path / name, path / name)
    return path


def _probe(model, mode: str) -> tuple[dict, str]:
    env = {**os.environ, "GLMCTL_PLUGIN": mode, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("GLMCTL_PLUGIN_ACTIVE", None)
    proc = subprocess.run([sys.executable, "-c", PROBE, str(model)], capture_output=True, text=True,
                          timeout=300, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][2:]), proc.stdout + proc.stderr


def test_auto_on_a_model_it_does_not_handle_registers_nothing(tiny_llama):
    auto, log = _probe(tiny_llama, "auto")
    off, _ = _probe(tiny_llama, "off")
    assert auto["active"] is False and auto["adapters"] == []
    assert auto["oot_ops"] == off["oot_ops"]
    assert not any("Glmctl" in name or name in ("SparseAttnIndexerKpool", "MHCPreOp") for name in
                   auto["oot_ops"])
    assert auto["custom_backend"] is False
    assert auto["backend_lookup"] == "vllm.platforms.cpu"  # vLLM's own attention selection
    assert auto["env_marker"] is None
    assert auto["config"] == off["config"]
    assert "glmctl plugin: inactive (model LlamaForCausalLM needs nothing from glmctl)" in log


def test_auto_on_glm5_next_activates(tiny_checkpoint):
    on, log = _probe(tiny_checkpoint.path, "auto")
    assert on["active"] is True and "sparse-MLA backend" in on["adapters"]
    assert "SparseAttnIndexerKpool" in on["oot_ops"]
    assert on["env_marker"] == "glm5_next"
    # GLM-5.3-Flash on vLLM CPU: kpool-compatible blocks, no prefix caching, no tilelang warmup.
    assert on["config"]["block_size"] % (32 * 16) == 0 and on["config"]["jit_warmup"] is False
    assert on["config"]["prefix_caching"] is False
    assert "glmctl plugin: active for GLM-5.3-Flash" in log
