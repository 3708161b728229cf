"""A tiny random-weight DFlash2 drafter for the tiny GLM-5.3-Flash checkpoint.

The architecture is vLLM 0.30's `DFlash2DraftModel` (`model_executor/models/qwen3_dflash2.py`, a
`qwen3` config with a `dflash_config`): Qwen3 decoder layers whose attention and MLP are wrapped
in grouped block convolutions, an `fc` that folds the target's hidden states at
`dflash_config.target_layer_ids` into the drafter's width, and a low-rank candidate selector that
re-scores the head's top-k tokens pairwise along the draft block. Sized to its target: the same
hidden size (the drafter reads the target's hidden states, and vLLM shares the target's input
embedding and LM head with it, which is why this checkpoint ships neither) and vocabulary; the
mask token is the target tokenizer's `[MASK]`.

Defaults, and why:

| field | tiny | why |
|---|---|---|
| layers | 2 | more than one, so the fused per-layer context K/V precompute is exercised |
| heads x head_dim, KV heads | 4 x 64, 2 | grouped-query attention; 64 is a head size vLLM CPU attention supports |
| intermediate | 512 | the target's dense MLP width |
| conv taps / group | 3 / 64 | taps shift across the 1 + drafts query block; groups divide the hidden size |
| selector rank / top-k | 32 / 8 | the selector's pairwise walk has real choices |
| target_layer_ids | 0 and n/2 of n target layers | one KDA and one MLA layer of the 4-layer target |

Deterministic: each tensor comes from its own generator seeded by sha256(seed, name), as in the
target (`glmctl.testing.tiny_weights`). The tokenizer files are the target's, copied.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from glmctl.errors import UsageError

RECIPE_FILE = "glmctl-tiny-drafter.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")
MASK_TOKEN = "[MASK]"


@dataclass(frozen=True)
class DrafterSpec:
    """The knobs of the tiny drafter; the target fixes hidden size, vocabulary and positions."""

    layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    conv_kernel_size: int = 3
    conv_group_size: int = 64
    selector_rank: int = 32
    selector_top_k: int = 8
    target_layer_ids: tuple[int, ...] | None = None  # None: 0 and n // 2 of the target's n layers


@dataclass(frozen=True)
class TargetFacts:
    """What the drafter takes from its target checkpoint."""

    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    max_position_embeddings: int
    mask_token_id: int

    @classmethod
    def read(cls, target: Path) -> TargetFacts:
        try:
            config = json.loads((target / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise UsageError(f"cannot read the target's config {target / 'config.json'}: {exc}",
                             hint="pass --target DIR of a checkpoint (glmctl testing tiny-checkpoint DIR)") from exc
        text = config.get("text_config") or config
        try:
            facts = cls(hidden_size=int(text["hidden_size"]), vocab_size=int(text["vocab_size"]),
                        num_hidden_layers=int(text["num_hidden_layers"]),
                        max_position_embeddings=int(text.get("max_position_embeddings") or 8192),
                        mask_token_id=_mask_token_id(target, int(text["vocab_size"])))
        except KeyError as exc:
            raise UsageError(f"the target's config lacks {exc}", hint="is --target a GLM-5.3-Flash checkpoint?") from exc
        return facts


def _mask_token_id(target: Path, vocab_size: int) -> int:
    """The target tokenizer's `[MASK]` id (the drafter's mask slots), else the last vocabulary id."""
    try:
        tokenizer = json.loads((target / "tokenizer.json").read_text())
    except (OSError, json.JSONDecodeError):
        return vocab_size - 1
    for token in tokenizer.get("added_tokens", []):
        if token.get("content") == MASK_TOKEN:
            return int(token["id"])
    return vocab_size - 1


def target_layer_ids(spec: DrafterSpec, target: TargetFacts) -> list[int]:
    if spec.target_layer_ids is not None:
        return list(spec.target_layer_ids)
    return sorted({0, target.num_hidden_layers // 2})


def _validate(spec: DrafterSpec, target: TargetFacts) -> None:
    ids = target_layer_ids(spec, target)
    rules = [
        (spec.layers >= 1, f"--layers must be at least 1, got {spec.layers}"),
        (spec.num_attention_heads % spec.num_key_value_heads == 0,
         "num_attention_heads must be a multiple of num_key_value_heads"),
        (target.hidden_size % spec.conv_group_size == 0,
         f"conv_group_size {spec.conv_group_size} must divide the target's hidden size {target.hidden_size}"),
        (spec.selector_top_k <= target.vocab_size, "selector_top_k exceeds the vocabulary"),
        (bool(ids) and all(0 <= i < target.num_hidden_layers for i in ids),
         f"target layer ids {ids} must lie in 0..{target.num_hidden_layers - 1} (the target's layers)"),
    ]
    for ok, message in rules:
        if not ok:
            raise UsageError(message, hint="see `glmctl testing tiny-drafter --help` for the defaults")


def hf_config(spec: DrafterSpec, target: TargetFacts) -> dict:
    """config.json as vLLM 0.30 reads a DFlash2 drafter (`qwen3` + `dflash_config`)."""
    return {
        "architectures": ["DFlash2DraftModel"],
        "model_type": "qwen3",
        "dtype": "bfloat16",
        "hidden_size": target.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": target.max_position_embeddings,
        "rope_theta": 1_000_000.0,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": target.vocab_size,
        "dflash_config": {
            "mask_token_id": target.mask_token_id,
            "target_layer_ids": target_layer_ids(spec, target),
            "conv_kernel_size": spec.conv_kernel_size,
            "conv_group_size": spec.conv_group_size,
            "selector_rank": spec.selector_rank,
            "selector_top_k": spec.selector_top_k,
        },
    }


def tensor_plan(spec: DrafterSpec, target: TargetFacts):
    """Every tensor of the drafter, by its checkpoint name (vLLM prefixes `model.` when loading)."""
    from glmctl.testing.tiny_weights import TensorPlan, _linear, _norm

    h, hd = target.hidden_size, spec.head_dim
    q, kv = spec.num_attention_heads * hd, spec.num_key_value_heads * hd
    taps, groups = spec.conv_kernel_size, target.hidden_size // spec.conv_group_size
    plan = []
    for i in range(spec.layers):
        p = f"layers.{i}."
        plan += [
            _norm(f"{p}input_layernorm.weight", h),
            _norm(f"{p}post_attention_layernorm.weight", h),
            _linear(f"{p}self_attn.q_proj.weight", q, h),
            _linear(f"{p}self_attn.k_proj.weight", kv, h),
            _linear(f"{p}self_attn.v_proj.weight", kv, h),
            _linear(f"{p}self_attn.o_proj.weight", h, q),
            _norm(f"{p}self_attn.q_norm.weight", hd),
            _norm(f"{p}self_attn.k_norm.weight", hd),
            _linear(f"{p}mlp.gate_proj.weight", spec.intermediate_size, h),
            _linear(f"{p}mlp.up_proj.weight", spec.intermediate_size, h),
            _linear(f"{p}mlp.down_proj.weight", h, spec.intermediate_size),
        ]
        for conv in ("attention_conv", "mlp_conv"):
            # Coefficients = base + a per-token delta; a base near 1/taps keeps the block mix O(1).
            plan += [
                TensorPlan(f"{p}{conv}.base_kernel", (2, taps, h), "bf16", ("normal", 1.0 / taps, 0.1)),
                _linear(f"{p}{conv}.kernel_projection.weight", 2 * taps * groups, h, gain=0.1),
            ]
    n_aux = len(target_layer_ids(spec, target))
    r = spec.selector_rank
    plan += [
        _linear("fc.weight", h, n_aux * h),
        _norm("hidden_norm.weight", h),
        _norm("norm.weight", h),
        TensorPlan("candidate_selector.predecessor_codebook", (target.vocab_size, r), "bf16",
                   ("normal", 0.0, r ** -0.5)),
        TensorPlan("candidate_selector.successor_codebook", (target.vocab_size, r), "bf16",
                   ("normal", 0.0, r ** -0.5)),
        _linear("candidate_selector.hidden_projection.weight", r, h),
    ]
    return plan


@dataclass
class TinyDrafterInfo:
    path: Path
    target: Path
    seed: int
    spec: DrafterSpec
    config: dict
    num_params: int
    num_tensors: int
    kv_bytes_per_token: int  # bf16 K and V of every draft layer
    files: dict[str, int]
    build_seconds: float

    def summary(self) -> dict:
        c = self.config
        return {
            "path": str(self.path),
            "target": str(self.target),
            "seed": self.seed,
            "architecture": c["architectures"][0],
            "model_type": c["model_type"],
            "params": self.num_params,
            "tensors": self.num_tensors,
            "layers": c["num_hidden_layers"],
            "hidden_size": c["hidden_size"],
            "vocab_size": c["vocab_size"],
            "attention": f"{c['num_attention_heads']} heads x {c['head_dim']}, {c['num_key_value_heads']} KV heads",
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "dflash_config": c["dflash_config"],
            "files": self.files,
            "build_seconds": round(self.build_seconds, 2),
        }


def build(path: str | os.PathLike, target: str | os.PathLike, seed: int = 0, force: bool = False,
          on_progress: Callable[[int, int], None] | None = None, **overrides) -> TinyDrafterInfo:
    """Write the drafter for the checkpoint at `target` to `path` (a temp dir beside it, renamed)."""
    from glmctl.testing.tiny_checkpoint import _check_target, _write_json

    started = time.perf_counter()
    unknown = set(overrides) - {f.name for f in dataclasses.fields(DrafterSpec)}
    if unknown:
        raise UsageError(f"unknown tiny-drafter setting(s): {', '.join(sorted(unknown))}")
    if overrides.get("target_layer_ids") is not None:
        overrides["target_layer_ids"] = tuple(overrides["target_layer_ids"])
    spec = DrafterSpec(**overrides)
    target_dir = Path(target).absolute()
    facts = TargetFacts.read(target_dir)
    _validate(spec, facts)
    out = Path(path).absolute()
    if out == target_dir:
        raise UsageError("the drafter directory is the target's", hint="choose another DIR")
    _check_target(out, force)

    from safetensors.torch import save_file

    from glmctl import __version__
    from glmctl.testing.tiny_weights import materialize

    config = hf_config(spec, facts)
    plan = tensor_plan(spec, facts)
    total = sum(t.numel for t in plan)
    done = 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        if on_progress is not None:
            on_progress(done, total)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    try:
        _write_json(tmp / "config.json", config)
        for name in TOKENIZER_FILES:
            if (target_dir / name).is_file():
                shutil.copyfile(target_dir / name, tmp / name)
        tensors = materialize(plan, seed, on_tensor=advance)
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        _write_json(tmp / RECIPE_FILE, {
            "generator": f"glmctl {__version__} (glmctl testing tiny-drafter)",
            "seed": seed,
            "target": str(target_dir),
            "spec": dataclasses.asdict(spec),
        })
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = {p.name: p.stat().st_size for p in sorted(out.iterdir())}
    kv = spec.layers * 2 * spec.num_key_value_heads * spec.head_dim * 2
    return TinyDrafterInfo(path=out, target=target_dir, seed=seed, spec=spec, config=config,
                           num_params=total, num_tensors=len(plan), kv_bytes_per_token=kv, files=files,
                           build_seconds=time.perf_counter() - started)
