"""The serving-profile schema: strict glmctl fields, plus one block passed to vLLM untouched.

glmctl reads the typed fields (to plan capacity, gate licences, check the node and set the
plugin's switches) and renders them to vLLM flags itself; `vllm_args` holds every other
`vllm serve` option under its long flag name, exactly as `vllm serve --config FILE` reads it, and
is checked by vLLM's own parser (`glmctl.serving.vllm_args`). A flag that a typed field owns may
not also appear in `vllm_args`: one source of truth for every value glmctl reasons about.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from glmctl.kernels.layouts import KvCacheDtype

Weights = Literal["bf16", "fp8", "exl3"]

# vLLM flags rendered from typed fields -> the field to set instead.
OWNED_FLAGS = {
    "model": "model.path (or --model)",
    "served-model-name": "model.served_name",
    "tensor-parallel-size": "tensor_parallel_size",
    "max-num-seqs": "max_num_seqs",
    "max-model-len": "max_model_len",
    "max-num-batched-tokens": "max_num_batched_tokens",
    "gpu-memory-utilization": "gpu_memory_utilization",
    "kv-cache-dtype": "kv_cache_dtype",
    "speculative-config": "speculative",
    "host": "--host",
    "port": "--port",
    "config": "(nothing: glmctl writes the config file)",
}
# Keys inside vLLM's compilation-config that `cuda_graph_max_tokens` owns.
OWNED_COMPILATION_KEYS = ("max_cudagraph_capture_size", "cudagraph_capture_sizes")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def flag_key(name: str) -> str:
    """A vLLM long-flag name as the config file spells it: no leading dashes, '-' not '_'.

    vLLM's parser accepts `max_model_len` as well, but looks up the `--no-` form of a false
    boolean under the spelling given, so `enable_prefix_caching: false` would be silently dropped.
    """
    return name.strip().lstrip("-").replace("_", "-")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ProfileModel(_Strict):
    path: Path | None = None
    """Local checkpoint directory; `glmctl serve --model` overrides it."""
    served_name: str | None = None
    """The model name clients send; default: the checkpoint directory's name."""
    weights: Weights = "bf16"
    """How the checkpoint stores its weights (routed experts for exl3): a planner input."""
    licenses: list[str] = []
    """Catalogue ids (glmctl.hub.licenses) of the checkpoint's licences."""


class DrafterSpec(_Strict):
    path: Path | None = None
    licenses: list[str] = []


class Speculative(_Strict):
    method: Literal["none", "mtp", "dflash2"] = "none"
    tokens: int | None = Field(None, ge=1, le=16)
    """Speculative tokens per step."""
    drafter: DrafterSpec | None = None
    """The separate draft model (dflash2 only; MTP drafts with the checkpoint's own MTP layer)."""

    @model_validator(mode="after")
    def _consistent(self) -> Speculative:
        if self.method == "none":
            if self.tokens is not None or self.drafter is not None:
                raise ValueError("method 'none' takes no tokens and no drafter")
        elif self.tokens is None:
            raise ValueError(f"method '{self.method}' needs `tokens` (speculative tokens per step)")
        if self.method == "mtp" and self.drafter is not None:
            raise ValueError("MTP drafts with the checkpoint's own MTP layer: remove `drafter`")
        if self.method == "dflash2" and self.drafter is None:
            raise ValueError("method 'dflash2' needs `drafter` (its path may be given at serve time)")
        return self


class Collectives(_Strict):
    mode: Literal["vllm", "host-staged"] = "vllm"
    """vllm: leave vLLM's communicator alone; host-staged: the plugin's pinned-host collectives."""
    int8_prefill_all_reduce: bool = False
    """INT8 payloads for prefill-size all-reduce (host-staged only)."""

    @model_validator(mode="after")
    def _int8_needs_host_staged(self) -> Collectives:
        if self.int8_prefill_all_reduce and self.mode != "host-staged":
            raise ValueError("int8_prefill_all_reduce needs mode 'host-staged'")
        return self


class Hardware(_Strict):
    gpus: int | None = Field(None, ge=1)
    """GPUs the profile needs on the node."""
    min_compute_capability: str | None = Field(None, pattern=r"^\d+\.\d$")
    """e.g. "8.0": Ampere and newer."""
    min_gpu_memory_gib: float | None = Field(None, gt=0)
    """Total memory per GPU, as the driver reports it."""


class Profile(_Strict):
    name: str = ""
    """Set from the file name by the loader."""
    description: str = ""
    extends: str | None = None
    usage: Literal["commercial", "noncommercial"]
    """commercial: every artifact's licence must allow commercial use, whatever else is set."""
    platform: Literal["cuda", "cpu"] = "cuda"
    model: ProfileModel = ProfileModel()
    speculative: Speculative = Speculative()
    kv_cache_dtype: KvCacheDtype = "auto"
    tensor_parallel_size: int = Field(1, ge=1)
    max_num_seqs: int = Field(ge=1)
    max_model_len: int = Field(ge=16)
    max_num_batched_tokens: int | None = Field(None, ge=16)
    """The chunked-prefill budget: tokens per scheduler step."""
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    cuda_graph_max_tokens: int | None = Field(None, ge=1)
    """Largest batch (in tokens) captured as a CUDA graph; None: vLLM's default."""
    collectives: Collectives = Collectives()
    hardware: Hardware = Hardware()
    env: dict[str, str] = {}
    """Environment of every vLLM process (NCCL, VLLM_* ...)."""
    vllm_args: dict[str, Any] = {}
    """Any other `vllm serve` option, by long flag name, as `vllm serve --config` reads it."""

    @field_validator("env", mode="before")
    @classmethod
    def _env_as_strings(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        out = {}
        for key, val in value.items():
            if not _ENV_NAME.match(str(key)):
                raise ValueError(f"'{key}' is not an environment variable name")
            if isinstance(val, bool) or val is None or isinstance(val, dict | list):
                raise ValueError(f"env {key}: give a string such as \"1\" (got {val!r})")
            out[str(key)] = str(val)
        return out

    @field_validator("vllm_args", mode="before")
    @classmethod
    def _flag_names(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        out: dict[str, Any] = {}
        for key, val in value.items():
            norm = flag_key(str(key))
            if norm in out:
                raise ValueError(f"'{key}' is given twice (as '{norm}')")
            if norm in OWNED_FLAGS:
                raise ValueError(f"'{norm}' is rendered by glmctl: set {OWNED_FLAGS[norm]} instead")
            if val is not None:  # null removes a key inherited through `extends`
                out[norm] = val
        return out

    @model_validator(mode="after")
    def _consistent(self) -> Profile:
        compilation = self.vllm_args.get("compilation-config")
        if self.cuda_graph_max_tokens is not None and isinstance(compilation, dict):
            clash = [k for k in OWNED_COMPILATION_KEYS if k in compilation]
            if clash:
                raise ValueError(
                    f"vllm_args.compilation-config.{clash[0]} clashes with cuda_graph_max_tokens"
                )
        if self.platform == "cpu":
            gpu_only = {
                "hardware": self.hardware != Hardware(),
                "collectives": self.collectives != Collectives(),
                "cuda_graph_max_tokens": self.cuda_graph_max_tokens is not None,
                "tensor_parallel_size": self.tensor_parallel_size != 1,
            }
            bad = [name for name, set_ in gpu_only.items() if set_]
            if bad:
                raise ValueError(f"platform 'cpu' has no GPUs: remove {', '.join(bad)}")
        for key in self.env:
            if key.startswith("GLMCTL_COLLECTIVES"):
                raise ValueError(f"env {key} is rendered from `collectives`: set that instead")
        return self

    def advisories(self) -> list[str]:
        """Settings that are valid but probably not what the author meant."""
        notes = []
        spec_tokens = self.speculative.tokens or 0
        decode_tokens = self.max_num_seqs * (1 + spec_tokens)
        if self.cuda_graph_max_tokens is not None and self.cuda_graph_max_tokens < decode_tokens:
            notes.append(
                f"a full decode step is {decode_tokens} tokens ({self.max_num_seqs} sequences x "
                f"{1 + spec_tokens}) but CUDA graphs stop at {self.cuda_graph_max_tokens}: "
                "larger decode batches run without graphs"
            )
        budget = self.max_num_batched_tokens
        if budget is not None and budget < decode_tokens:
            notes.append(
                f"max_num_batched_tokens {budget} is below one full decode step "
                f"({decode_tokens} tokens)"
            )
        return notes
