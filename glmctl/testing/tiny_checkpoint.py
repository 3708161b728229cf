"""A tiny random-weight GLM-5.3-Flash checkpoint: the embedded default and the test model.

Same architecture, weight names, shapes and config schema as the real model (vLLM 0.30
`vllm/models/glm5next/`, transformers 5.24 `glm5_next`), small enough to build in about a second and
to serve on two CPU cores. Default config (`TinySpec()`), and why each size was chosen:

| field | tiny | real | why |
|---|---|---|---|
| layers (`layer_types`) | 4: KDA, MLA, MLA, KDA | 45, 3 KDA : 1 MLA | both layer kinds; two adjacent MLA layers so the second can be a "shared" indexer layer |
| `indexer_types` | full, full, shared, full | all full | transformers reuses the previous layer's top-k only when that layer is MLA; vLLM 0.30 ignores the field |
| `mlp_layer_types` | dense, sparse, sparse, sparse | 3 dense first | one dense layer (`first_k_dense_replace` 1) and MoE after it |
| hidden_size | 256 | 4096 | smallest that keeps every projection a multiple of 128 |
| MLA heads x (qk_nope, v) | 8 x (256, 256) | 64 x (256, 256) | 8 = the per-GPU head count at TP 8: attention kernels see real per-rank shapes |
| kv_lora_rank / qk_rope_head_dim | 512 / 0 | 512 / 0 | the 512 NoPE latent is what vLLM's sparse-MLA paths are built for; not shrinkable |
| q_lora_rank | 128 | 1536 | only feeds q_b_proj and the indexer's wq_b |
| indexer heads x dim | 8 x 128 | 32 x 128 | dim 128 is asserted by vLLM (FWHT-128 quant); 8 heads < 32 exercises vLLM's head padding |
| index_kpool / index_topk | 16 / 128 | 16 / 2048 | real pool size (so KV block size must be a multiple of 32 x 16 = 512, as on GPUs); top-128 = 8 pools, so selection drops pools from ~150 tokens on |
| max_position_embeddings | 8192 | 1048576 | 64x index_topk: long-context sparse behaviour is testable, the CPU KV cache stays small |
| KDA heads x dim, conv | 4 x 128, 4 | 64 x 128, 4 | real head dim (kernels tile by it), fewer heads |
| MoE | 16 experts, top 4, 1 shared, intermediate 128 | 288, top 8, 1 shared | grouped sigmoid routing with a correction bias, several experts per token |
| dense intermediate | 512 | 12288 | |
| mHC | 4 streams, 20 Sinkhorn iterations | same | the real residual-stream machinery, unchanged |
| MTP | 1 layer (`num_nextn_predict_layers`) | 1 | what `--speculative-config '{"method": "mtp"}'` loads |
| vocab | 2048 (byte-level BPE) | 154880 | trained offline on the standard library (`glmctl.testing.tiny_tokenizer`) |

`model_type` is the flat `glm5_next` (architecture `Glm5NextForCausalLM`): vLLM's
`SpeculativeConfig.hf_config_override` rewrites exactly that value to `glm5_next_mtp` for MTP
(`glm5_next_text` is rejected), and transformers reads a flat `glm5_next` config as
`Glm5NextConfig` with the text fields forwarded to its `text_config`.

Deterministic: the same seed (and the same Python, torch and tokenizers) gives byte-identical files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from glmctl.errors import UsageError
from glmctl.testing.tiny_spec import TinySpec

SAFETENSORS_INDEX = "model.safetensors.index.json"
RECIPE_FILE = "glmctl-tiny-checkpoint.json"
def hf_config(spec: TinySpec, tokenizer_ids: dict) -> dict:
    """config.json: the flat `glm5_next` schema both vLLM 0.30 and transformers 5.24 read."""
    return {
        "architectures": ["Glm5NextForCausalLM"],
        "model_type": "glm5_next",
        "dtype": "bfloat16",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.layers,
        "layer_types": spec.layer_types(),
        "indexer_types": spec.indexer_types(),
        "mlp_layer_types": spec.mlp_layer_types(),
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        # MLA, NoPE
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_attention_heads,
        "q_lora_rank": spec.q_lora_rank,
        "kv_lora_rank": spec.kv_lora_rank,
        "qk_nope_head_dim": spec.qk_nope_head_dim,
        "qk_rope_head_dim": 0,
        "v_head_dim": spec.v_head_dim,
        "mla_use_nope": True,
        "attention_bias": False,
        # DSA lightning indexer with pooled keys (vLLM requires the three booleans to be true)
        "index_topk": spec.index_topk,
        "index_n_heads": spec.index_n_heads,
        "index_head_dim": spec.index_head_dim,
        "index_kpool": spec.index_kpool,
        "index_kpool_compress": True,
        "index_kpool_always_select_tail": True,
        "index_dsa_use_layernorm": True,
        # KDA linear attention
        "linear_num_heads": spec.linear_num_heads,
        "linear_head_dim": spec.linear_head_dim,
        "linear_conv_kernel_dim": spec.linear_conv_kernel_dim,
        "linear_lower_bound": -5.0,
        # MoE (vLLM only allocates e_score_correction_bias for noaux_tc; its swiglu_limit default is
        # None while transformers' is 10.0, so both are spelled out)
        "n_routed_experts": spec.n_routed_experts,
        "num_experts_per_tok": spec.num_experts_per_tok,
        "n_shared_experts": spec.n_shared_experts,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "swiglu_limit": 10.0,
        "moe_router_dtype": "float32",
        # mHC residual streams
        "mhc": True,
        "hc_mult": spec.hc_mult,
        "hc_eps": 1e-6,
        "hc_sinkhorn_iters": 20,
        "mhc_post_mult_value": 2.0,
        "hres_vwnstyle": True,
        # MTP
        "num_nextn_predict_layers": spec.mtp_layers,
        # tokens
        "bos_token_id": None,
        "eos_token_id": tokenizer_ids["stop_token_ids"],
        "pad_token_id": tokenizer_ids["pad_token_id"],
        "use_cache": True,
    }


@dataclass
class TinyCheckpointInfo:
    """What `build` wrote: for the CLI summary and for tests."""

    path: Path
    seed: int
    spec: TinySpec
    num_params: int
    num_tensors: int
    files: dict[str, int]  # file name -> bytes
    total_bytes: int
    tokenizer_vocab: int
    special_token_ids: dict[str, int]
    corpus_sha256: str
    build_seconds: float
    config: dict = field(repr=False, default_factory=dict)

    @property
    def kv_block_size_multiple(self) -> int:
        """vLLM's kpool indexer cache needs a KV block size that is a multiple of this."""
        return 32 * self.spec.index_kpool

    def summary(self) -> dict:
        c = self.config
        return {
            "path": str(self.path),
            "seed": self.seed,
            "params": self.num_params,
            "tensors": self.num_tensors,
            "bytes": self.total_bytes,
            "files": self.files,
            "architecture": c["architectures"][0],
            "model_type": c["model_type"],
            "layer_types": c["layer_types"],
            "indexer_types": c["indexer_types"],
            "mlp_layer_types": c["mlp_layer_types"],
            "mtp_layers": c["num_nextn_predict_layers"],
            "hidden_size": c["hidden_size"],
            "vocab_size": c["vocab_size"],
            "tokenizer_vocab": self.tokenizer_vocab,
            "index_topk": c["index_topk"],
            "index_kpool": c["index_kpool"],
            "kv_block_size_multiple": self.kv_block_size_multiple,
            "max_position_embeddings": c["max_position_embeddings"],
            "kv_lora_rank": c["kv_lora_rank"],
            "experts": f"{c['n_routed_experts']} routed (top {c['num_experts_per_tok']}) + {c['n_shared_experts']} shared",
            "special_token_ids": self.special_token_ids,
            "corpus_sha256": self.corpus_sha256,
            "build_seconds": round(self.build_seconds, 2),
        }


def _shard_of(name: str, spec: TinySpec) -> int:
    """Shard 1: embedding + first half of the layers; 2: the rest + head; 3: the MTP layers."""
    if name.startswith("model.layers."):
        idx = int(name.split(".")[2])
        if idx >= spec.layers:
            return 3
        return 1 if idx < (spec.layers + 1) // 2 else 2
    return 1 if name.startswith("model.embed_tokens.") else 2


def _check_target(path: Path, force: bool) -> None:
    if path.exists() and not path.is_dir():
        raise UsageError(f"{path} exists and is not a directory", hint="choose another path")
    if path.is_dir() and any(path.iterdir()) and not force:
        raise UsageError(
            f"{path} is not empty",
            hint="pass --force to replace it (force=True from Python), or choose an empty directory",
        )


def build(
    path: str | os.PathLike,
    seed: int = 0,
    force: bool = False,
    on_progress: Callable[[int, int], None] | None = None,
    **overrides,
) -> TinyCheckpointInfo:
    """Write the tiny checkpoint to `path` atomically (a temp dir beside it, renamed at the end).

    `overrides` are TinySpec fields (`layers=6`, `index_topk=256`, ...). `on_progress(done, total)`
    is called with parameter counts while tensors are drawn.
    """
    started = time.perf_counter()
    unknown = set(overrides) - {f.name for f in dataclasses.fields(TinySpec)}
    if unknown:
        raise UsageError(f"unknown tiny-checkpoint setting(s): {', '.join(sorted(unknown))}",
                         hint=f"known: {', '.join(f.name for f in dataclasses.fields(TinySpec))}")
    spec = TinySpec(**overrides)
    spec.validate()
    target = Path(path).absolute()
    _check_target(target, force)

    from safetensors.torch import save_file

    from glmctl import __version__
    from glmctl.testing.tiny_tokenizer import train_tokenizer
    from glmctl.testing.tiny_weights import materialize, tensor_plan

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it 0700; the checkpoint is an ordinary directory
    try:
        tok = train_tokenizer(tmp, spec.vocab_size, spec.max_position_embeddings)
        ids = {"stop_token_ids": tok.stop_token_ids, "pad_token_id": tok.pad_token_id}
        config = hf_config(spec, ids)
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", {
            "eos_token_id": tok.stop_token_ids, "pad_token_id": tok.pad_token_id, "bos_token_id": None,
        })

        plan = tensor_plan(spec)
        total = sum(t.numel for t in plan)
        done = 0

        def advance(n: int) -> None:
            nonlocal done
            done += n
            if on_progress is not None:
                on_progress(done, total)

        tensors = materialize(plan, seed, on_tensor=advance)
        shard_ids = sorted({_shard_of(t.name, spec) for t in plan})
        names = {s: f"model-{i:05d}-of-{len(shard_ids):05d}.safetensors" for i, s in enumerate(shard_ids, 1)}
        weight_map = {t.name: names[_shard_of(t.name, spec)] for t in plan}
        for fname in names.values():
            save_file({n: tensors[n] for n in weight_map if weight_map[n] == fname}, str(tmp / fname),
                      metadata={"format": "pt"})
            (tmp / fname).chmod(0o666 & ~umask)  # safetensors creates 0600: an ordinary file, as the rest
        total_size = sum(v.numel() * v.element_size() for v in tensors.values())
        _write_json(tmp / SAFETENSORS_INDEX, {
            "metadata": {"total_size": total_size},
            "weight_map": dict(sorted(weight_map.items())),
        })
        _write_json(tmp / RECIPE_FILE, {
            "generator": f"glmctl {__version__} (glmctl testing tiny-checkpoint)",
            "seed": seed,
            "spec": dataclasses.asdict(spec),
            "tokenizer_corpus_sha256": tok.corpus_sha256,
        })
        if target.exists():
            # Replace only after the new checkpoint is complete; the old one is kept until then.
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    files = {p.name: p.stat().st_size for p in sorted(target.iterdir())}
    return TinyCheckpointInfo(
        path=target, seed=seed, spec=spec, num_params=total, num_tensors=len(plan), files=files,
        total_bytes=sum(files.values()), tokenizer_vocab=tok.vocab_size, special_token_ids=tok.special_ids,
        corpus_sha256=tok.corpus_sha256, build_seconds=time.perf_counter() - started, config=config,
    )


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
