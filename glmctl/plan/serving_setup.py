"""How the model is served (`ServingSetup`): parallelism, weight formats, KV dtype, drafter, limits.

Every field maps onto a vLLM 0.30 flag (or a glmctl plugin choice for the weight formats), and the
defaults are vLLM's own where vLLM has one, so a plan describes what `vllm serve` would do with the
same flags.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from glmctl.errors import ConfigError, UsageError
from glmctl.kernels.layouts import KvCacheDtype, normalise_kv_cache_dtype

WeightKind = Literal["bf16", "fp8", "exl3"]
WEIGHT_GROUPS = ("experts", "dense", "kda", "mla", "embeddings")


class WeightFormat(BaseModel):
    """How one module group is stored: bf16, block-FP8 (128x128, fp32 scales) or EXL3 at `bits`."""

    model_config = ConfigDict(frozen=True)

    kind: WeightKind
    bits: float | None = None  # EXL3 trellis bits per weight (average, may be fractional)

    def __str__(self) -> str:
        return f"exl3:{self.bits:g}" if self.kind == "exl3" else self.kind


def parse_weight_format(text: str, group: str = "experts") -> WeightFormat:
    value = text.strip().lower()
    if value in ("bf16", "bfloat16"):
        return WeightFormat(kind="bf16")
    if value == "fp8":
        return WeightFormat(kind="fp8")
    match = re.fullmatch(r"exl3:(\d+(?:\.\d+)?)", value)
    if match:
        bits = float(match.group(1))
        if group != "experts":
            raise UsageError(
                f"--{group} {text}: EXL3 is only served for the routed experts (glmctl's EXL3 MoE path)",
                hint=f"use bf16 or fp8 for --{group}",
            )
        if not 1.0 <= bits <= 8.0:
            raise UsageError(f"--{group} {text}: EXL3 bits must be between 1 and 8")
        return WeightFormat(kind="exl3", bits=bits)
    raise UsageError(f"--{group} '{text}' is not a weight format", hint="use bf16, fp8 or exl3:BITS (e.g. exl3:4)")


class WeightFormats(BaseModel):
    """One format per module group (see `weights.py` for which tensors each group holds)."""

    model_config = ConfigDict(frozen=True)

    experts: WeightFormat
    dense: WeightFormat  # shared experts and dense MLP layers
    kda: WeightFormat  # linear-attention (KDA) projections
    mla: WeightFormat  # MLA and indexer projections
    embeddings: WeightFormat  # embedding and LM head

    @classmethod
    def for_checkpoint(cls, checkpoint_quant: str, fp8_attention: Iterable[str] = (),
                       **overrides: str | None) -> WeightFormats:
        """Formats vLLM 0.30 loads a checkpoint in, then the explicit per-group overrides.

        An FP8 checkpoint loads experts, shared experts and dense MLPs as FP8; stock vLLM keeps
        MLA, KDA and the embeddings BF16 (glm5next passes no quant config to MLA and KDA), while
        glmctl's plugin keeps the attention families in `fp8_attention` (`ModelSpec.fp8_attention`,
        read from the checkpoint) FP8.
        """
        bf16, fp8 = WeightFormat(kind="bf16"), WeightFormat(kind="fp8")
        base = {g: bf16 for g in WEIGHT_GROUPS}
        if checkpoint_quant == "fp8":
            base.update(experts=fp8, dense=fp8)
        elif checkpoint_quant.startswith("exl3:"):
            base.update(experts=parse_weight_format(checkpoint_quant), dense=fp8)
        base.update({family: fp8 for family in fp8_attention})
        for group, text in overrides.items():
            if text is not None:
                base[group] = parse_weight_format(text, group)
        return cls(**base)


class DrafterSpec(BaseModel):
    """A separate dense drafter model (DFlash2), read from its config.json."""

    model_config = ConfigDict(frozen=True)

    source: str
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    target_hidden_size: int | None = None


def load_drafter(path: str | Path) -> DrafterSpec:
    config_path = Path(path).expanduser()
    config_path = config_path / "config.json" if config_path.is_dir() else config_path
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read the drafter config {config_path}: {exc}") from exc
    try:
        heads = raw["num_attention_heads"]
        return DrafterSpec(
            source=str(config_path),
            num_hidden_layers=raw["num_hidden_layers"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        )
    except KeyError as exc:
        raise ConfigError(f"drafter config {config_path} lacks {exc}") from exc


class Speculative(BaseModel):
    model_config = ConfigDict(frozen=True)

    method: Literal["none", "mtp", "dflash2"] = "none"
    num_tokens: int = 0
    drafter: DrafterSpec | None = None  # dflash2 only

    def __str__(self) -> str:
        return "none" if self.method == "none" else f"{self.method}:{self.num_tokens}"


def parse_speculative(text: str, drafter: str | None = None) -> Speculative:
    value = text.strip().lower()
    if value in ("none", "off", ""):
        return Speculative()
    match = re.fullmatch(r"(mtp|dflash2):(\d+)", value)
    if not match or int(match.group(2)) < 1:
        raise UsageError(f"--speculative '{text}' is not none, mtp:N or dflash2:N", hint="e.g. --speculative mtp:3")
    method, n = match.group(1), int(match.group(2))
    if method == "dflash2":
        if drafter is None:
            raise UsageError(
                "--speculative dflash2:N needs the drafter's architecture",
                hint="pass --drafter PATH (the DFlash2 drafter's checkpoint directory or config.json)",
            )
        return Speculative(method="dflash2", num_tokens=n, drafter=load_drafter(drafter))
    return Speculative(method="mtp", num_tokens=n)


class ServingSetup(BaseModel):
    """The serving choices a plan is made for. `None` means "vLLM's default for this node"."""

    model_config = ConfigDict(frozen=True)

    tensor_parallel_size: int = Field(1, ge=1)
    weights: WeightFormats
    kv_cache_dtype: KvCacheDtype = "auto"
    speculative: Speculative = Speculative()
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = Field(0.92, gt=0, le=1)  # vLLM 0.30's default
    enforce_eager: bool = False
    cudagraph_capture_sizes: list[int] | None = None
    max_cudagraph_capture_size: int | None = None
    enable_prefix_caching: bool | None = None  # None: vLLM's default (on for CUDA, off on CPU)
    block_size: int | None = None  # --block-size; vLLM may still raise it (hybrid alignment)
    kernel_block_size: int = 64  # smallest sparse-MLA kernel block (glmctl 16, FlashMLA-sparse 64; <128: no effect)
    glmctl_plugin: bool = True  # plan vLLM with glmctl's plugin (its MTP tail ring and block rule)
    session_tokens: int = 262_144  # the report's "session": 256k tokens

    @field_validator("kv_cache_dtype", mode="before")
    @classmethod
    def _vllm_spelling(cls, value):
        """bf16 and fp8_e4m3 as vLLM spells them; a UsageError (not wrapped by pydantic) otherwise."""
        if not isinstance(value, str):
            return value
        try:
            return normalise_kv_cache_dtype(value)
        except ValueError as exc:
            raise UsageError(str(exc), hint="e.g. --kv-cache-dtype fp8") from None

    @field_validator("cudagraph_capture_sizes")
    @classmethod
    def _positive_sizes(cls, sizes: list[int] | None) -> list[int] | None:
        if sizes is not None and (not sizes or min(sizes) < 1):
            raise ValueError("CUDA-graph capture sizes must be positive integers")
        return sizes


def parse_capture_sizes(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        sizes = sorted({int(part) for part in text.replace(" ", "").split(",") if part})
    except ValueError as exc:
        raise UsageError(f"--cudagraph-capture-sizes '{text}' is not a comma-separated list of integers") from exc
    if not sizes or sizes[0] < 1:
        raise UsageError("--cudagraph-capture-sizes needs positive integers", hint="e.g. 1,2,4,8,16,32")
    return sizes
