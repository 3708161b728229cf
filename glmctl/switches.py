"""Every `GLMCTL_*` environment variable, declared once: name, kind, default, meaning.

vLLM keeps its variables the same way (`vllm/envs.py`). Code reads a variable through `read(name)`
(or `read(name, env)` for a mapping it was handed), never from `os.environ` itself, so every
switch has one parser: a flag is off for `off`, `0`, `false` or `no` (any case) and on for anything
else; a choice with an `off` (or `on`) value takes the same words for it; an unknown choice or a
number out of range raises `SwitchError` naming the variable and what it takes. `docs/cli.md`
lists the table (`make docs`); a test fails when a `GLMCTL_*` name in the tree is missing here.

No import beyond the standard library and `glmctl.errors`: the CLI, the planner and the plugin
(inside every vLLM process) all read it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from glmctl.errors import ConfigError

OFF_WORDS = ("off", "0", "false", "no")
ON_WORDS = ("on", "1", "true", "yes")

# Who reads a variable: the sections of the docs table, with a line under each heading.
CONTROL_PLANE = "The CLI"
PLUGIN = "The vLLM plugin and the collectives"
HAND_OVER = "Set by glmctl itself"
TEST_LANES = "Test and bench lanes"
SECTIONS = {
    CONTROL_PLANE: "Read by `glmctl` and its libraries.",
    PLUGIN: "Read in every vLLM process (set them in a profile's `env`, or before `vllm serve`).",
    HAND_OVER: "glmctl sets these for the processes it starts; never set them yourself.",
    TEST_LANES: "Read by the tests and benchmarks only.",
}


class SwitchError(ConfigError, ValueError):
    """A variable holds a value its switch does not take."""


@dataclass(frozen=True)
class Switch:
    """One variable. `kind`: flag (bool), choice (str, one of `choices`), number (float; None when
    unset and `default` is None), path (Path or None), list (comma-separated, a tuple of str) or
    text (str or None). `default`: the value an unset (or empty) variable reads as, written as
    the variable would hold it; `shown_default` describes it when it is not a constant."""

    name: str
    kind: str
    section: str
    meaning: str
    default: str | None = None
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    shown_default: str | None = None

    def parse(self, raw: str | None):
        value = (raw or "").strip()
        if not value:
            if self.default is None:
                return () if self.kind == "list" else None
            return self.parse(self.default)
        if self.kind == "flag":
            return value.lower() not in OFF_WORDS
        if self.kind == "choice":
            word = value.lower()
            if "off" in self.choices and word in OFF_WORDS:
                word = "off"
            elif "on" in self.choices and word in ON_WORDS:
                word = "on"
            if word not in self.choices:
                raise SwitchError(f"{self.name}={raw!r} is not one of {', '.join(self.choices)}")
            return word
        if self.kind == "number":
            try:
                number = float(value)
            except ValueError:
                number = None
            if number is None or (self.minimum is not None and number < self.minimum):
                floor = f" >= {self.minimum:g}" if self.minimum is not None else ""
                raise SwitchError(f"{self.name}={value!r} must be a number{floor}")
            return number
        if self.kind == "path":
            return Path(raw)
        if self.kind == "list":
            return tuple(item.strip() for item in value.split(",") if item.strip())
        return raw

    @property
    def values(self) -> str:
        """What the variable takes, for the docs table."""
        if self.kind == "flag":
            return "on / off (off, 0, false, no)"
        if self.kind == "choice":
            return " \\| ".join(self.choices)
        if self.kind == "number":
            return "number" + (f" >= {self.minimum:g}" if self.minimum is not None else "")
        return {"path": "a path", "list": "comma-separated"}.get(self.kind, "text")


SWITCHES: tuple[Switch, ...] = (
    # --- glmctl itself
    Switch("GLMCTL_HOME", "path", CONTROL_PLANE, "user profiles and licence acceptance records",
       shown_default="$XDG_CONFIG_HOME/glmctl, else ~/.config/glmctl"),
    Switch("GLMCTL_CACHE", "path", CONTROL_PLANE, "cached measurements and `glmctl serve` run directories",
       shown_default="$XDG_CACHE_HOME/glmctl, else ~/.cache/glmctl"),
    Switch("GLMCTL_MODELS", "path", CONTROL_PLANE, "where `glmctl fetch` puts artifacts (one directory each)",
       shown_default="$XDG_DATA_HOME/glmctl/models, else ~/.local/share/glmctl/models"),
    Switch("GLMCTL_DEBUG", "flag", CONTROL_PLANE, "print the traceback of an error as well", default="off"),
    Switch("GLMCTL_ACCEPT_LICENSES", "list", CONTROL_PLANE,
       "licence ids accepted, as with --accept-license (recorded like a flag's)"),
    # --- the plugin, in every vLLM process
    Switch("GLMCTL_PLUGIN", "choice", PLUGIN,
       "auto: act where vLLM 0.30 cannot run GLM-5.3-Flash (CPU, CUDA below sm_90); on: on any CUDA "
       "or CPU platform; off: install nothing", default="auto", choices=("auto", "on", "off")),
    Switch("GLMCTL_EXL3", "flag", PLUGIN, "register the EXL3-experts quantization (off: vLLM as shipped)",
       default="on"),
    Switch("GLMCTL_EXL3_DECODE", "choice", PLUGIN, "which kernel runs a decode batch of EXL3 experts",
       default="auto", choices=("auto", "coop", "coop_lean", "triton", "fused")),
    Switch("GLMCTL_EXL3_PREFILL", "choice", PLUGIN,
       "EXL3 prefill: exllamav3's exl3_moe with heavy experts reconstructed to fp16 (recon) or in slices "
       "(chunk), or glmctl's Triton kernels with 64-slot runs (triton; 4-bit experts, else recon)",
       default="recon", choices=("recon", "chunk", "triton")),
    Switch("GLMCTL_EXL3_TRITON_CONFIG", "text", PLUGIN,
       "a kernels.exl3_moe_decode.DECODE_CONFIGS name used at every size (benchmarks)",
       shown_default="per size"),
    Switch("GLMCTL_FP8_ATTENTION", "flag", PLUGIN,
       "build the attention projections of a block-FP8 checkpoint in FP8 (off: vLLM as shipped)", default="on"),
    Switch("GLMCTL_FP8_ATTENTION_METHOD", "choice", PLUGIN,
       "the FP8 units' linear method: vLLM's Fp8LinearMethod, or exact dequantisation at load",
       default="auto", choices=("auto", "vllm", "dequant"), shown_default="auto (dequant on CPU, vllm on GPUs)"),
    Switch("GLMCTL_FP8_LINEAR", "choice", PLUGIN,
       "the kernel of block-FP8 linears held in FP8 on CUDA: glmctl's Triton W8A16, or vLLM's choice "
       "(Marlin W8A16 on sm_8x)",
       default="auto", choices=("auto", "glmctl", "vllm"), shown_default="auto (vllm's choice)"),
    Switch("GLMCTL_ROUTER_GEMM", "choice", PLUGIN,
       "the MoE router's logits on CUDA: glmctl's weight-streaming GEMV for decode batches, or vLLM's "
       "cuBLAS call", default="auto", choices=("auto", "glmctl", "vllm"), shown_default="auto (vllm's)"),
    Switch("GLMCTL_KDA_DECODE", "choice", PLUGIN,
       "KDA decode and MTP-verify steps on CUDA: glmctl's one-launch kernel (short conv, delta rule, "
       "gated norm), or vLLM's conv, recurrent and norm kernels", default="auto",
       choices=("auto", "glmctl", "vllm"), shown_default="auto (vllm's)"),
    Switch("GLMCTL_INDEXER_TOPK", "choice", PLUGIN,
       "the indexer's top-k on CUDA: packed (one launch per decode layer, no torch glue; sparse MLA's rows "
       "by Triton) or the threshold / radix kernels with the torch glue",
       default="auto", choices=("auto", "packed", "threshold", "radix"), shown_default="auto (threshold)"),
    Switch("GLMCTL_MHC", "choice", PLUGIN, "which implementation runs the mHC ops",
       default="auto", choices=("auto", "tilelang", "triton", "torch"),
       shown_default="auto (tilelang on sm_90+ where importable, else triton; torch on CPU)"),
    Switch("GLMCTL_MHC_DECODE", "choice", PLUGIN,
       "glmctl's Triton mHC at decode sizes: one launch per block (fused) or the partials + finalize pair (split)",
       default="auto", choices=("auto", "fused", "split"), shown_default="auto (split)"),
    Switch("GLMCTL_DFLASH2_KV", "choice", PLUGIN,
       "where the DFlash2 drafter's K/V pages go in the KV pool (auto: more KV tokens, alias on a tie)",
       default="auto", choices=("auto", "alias", "append")),
    Switch("GLMCTL_COLLECTIVES", "choice", PLUGIN,
       "tensor-parallel collectives: vLLM's own, host-staged, or host-staged where a GPU pair has no "
       "peer access (auto)", default="vllm", choices=("vllm", "host-staged", "auto")),
    Switch("GLMCTL_COLLECTIVES_INT8", "choice", PLUGIN,
       "INT8 payloads for prefill all-reduces of at least GLMCTL_COLLECTIVES_INT8_MIN_MIB (prefill), "
       "or for every all-reduce, decode sizes within the direct path's reach as INT8 two shots (all; "
       "measured slow on the one-GPU rig)",
       default="off", choices=("off", "prefill", "all")),
    Switch("GLMCTL_COLLECTIVES_INT8_MIN_MIB", "number", PLUGIN,
       "smallest all-reduce sent as INT8 with GLMCTL_COLLECTIVES_INT8=prefill, MiB (always above the "
       "largest CUDA-graph batch)",
       default="4", minimum=0.0),
    Switch("GLMCTL_COLLECTIVES_MAX_MIB", "number", PLUGIN,
       "largest message per host-staged call, MiB (each rank holds (world + 1) x this)",
       minimum=1.0, shown_default="the config's largest all-reduce, 1..32"),
    Switch("GLMCTL_COLLECTIVES_TIMEOUT_S", "number", PLUGIN,
       "seconds a host-staged wait may make no progress before the peer counts as stalled",
       minimum=0.1, shown_default="vLLM's distributed timeout, else 600 (in vLLM); 5 (standalone)"),
    Switch("GLMCTL_SHM_DIR", "path", PLUGIN, "the tmpfs directory of the host-staged shared segments",
       default="/dev/shm"),
    # --- hand-over between glmctl's own processes
    Switch("GLMCTL_PLUGIN_ACTIVE", "text", HAND_OVER,
       "set by the process that saw a GLM-5.3-Flash config; vLLM's engine and workers inherit it"),
    Switch("GLMCTL_FP8_ATTENTION_ACTIVE", "text", HAND_OVER,
       "set by the process that saw a block-FP8 GLM-5.3-Flash config; engine and workers inherit it"),
    Switch("GLMCTL_SUPERVISOR_PID", "text", HAND_OVER,
       "`glmctl serve`'s pid: the vLLM server stops when it dies"),
    # --- test and bench lanes
    Switch("GLMCTL_HARNESS_TRACEBACK_S", "number", TEST_LANES,
       "collectives test harness: dump each rank's traceback after this many seconds (0: never)",
       default="0", minimum=0.0),
    Switch("GLMCTL_COLLECTIVES_SPREAD", "flag", TEST_LANES,
       "collectives GPU tests: one process per GPU (rank % device count)", default="off"),
    Switch("GLMCTL_TEST_TINY_MODEL", "choice", TEST_LANES,
       "vllm lane: the tiny checkpoint served (default: glm where the plugin serves it, else llama)",
       choices=("glm", "llama")),
    Switch("GLMCTL_UPDATE_FIXTURES", "flag", TEST_LANES, "vllm lane: rewrite the recorded CPU-lane fixture",
       default="off"),
    Switch("GLMCTL_GPU_LANE_RECORD", "path", TEST_LANES, "gpu lane: the JSON record its cases are added to"),
    Switch("GLMCTL_GPU_LANE_WORK", "path", TEST_LANES, "gpu lane: where every process's log and request are kept"),
    Switch("GLMCTL_GPU_LANE_CACHE", "path", TEST_LANES,
       "gpu lane: one Triton / vLLM / Inductor cache root shared by every engine it starts"),
    Switch("GLMCTL_GPU_LANE_DEADLINE", "number", TEST_LANES,
       "gpu lane: the Unix time by which its stages must be done"),
    Switch("GLMCTL_LANE_PGID_DIR", "path", TEST_LANES,
       "gpu lane: where helpers that start their own sessions record their process groups"),
    Switch("GLMCTL_EXL3_RECORD", "path", TEST_LANES, "gpu lane: the JSON file the EXL3 tests' figures go to"),
    Switch("GLMCTL_DOCTOR_RECORD", "path", TEST_LANES, "gpu lane: where the doctor test writes its report"),
    Switch("GLMCTL_DOCTOR_WHERE", "text", TEST_LANES, "gpu lane: the machine the doctor report describes",
       default="gpu lane"),
)

_BY_NAME = {s.name: s for s in SWITCHES}


def switch(name: str) -> Switch:
    """The declaration of `name` (KeyError for a name not declared here)."""
    return _BY_NAME[name]


def names(section: str) -> tuple[str, ...]:
    """The variables of one section."""
    return tuple(s.name for s in SWITCHES if s.section == section)


def parse(name: str, raw: str | None):
    """`raw` (a variable's value, or None when unset) as switch `name` reads it."""
    return _BY_NAME[name].parse(raw)


def read(name: str, env: Mapping[str, str] | None = None):
    """Switch `name` from `env` (default: this process's environment)."""
    return _BY_NAME[name].parse((os.environ if env is None else env).get(name))


def plugin_off(env: Mapping[str, str] | None = None) -> bool:
    """GLMCTL_PLUGIN=off. A bad value counts as not off here: the plugin's own line reports it."""
    try:
        return read("GLMCTL_PLUGIN", env) == "off"
    except ValueError:
        return False


def snapshot() -> dict[str, str]:
    """The GLMCTL_* variables as they are now, for `read(name, env)` later."""
    return {k: v for k, v in os.environ.items() if k.startswith("GLMCTL_")}


def hand_over(name: str, value: str) -> None:
    """Set a hand-over variable for the processes this one starts later."""
    if _BY_NAME[name].section != HAND_OVER:
        raise ValueError(f"{name} is not set by glmctl itself")
    os.environ[name] = value


def markdown_table() -> str:
    """The table `make docs` writes into docs/cli.md."""
    lines = ["## Environment variables", "",
             "Generated from `glmctl/switches.py`, where each is declared once. A flag is off for "
             "`off`, `0`, `false` or `no`.", ""]
    for section, intro in SECTIONS.items():
        lines += [f"### {section}", "", intro, "", "| variable | values | default | meaning |", "|---|---|---|---|"]
        for s in SWITCHES:
            if s.section == section:
                default = s.shown_default or s.default or "unset"
                lines.append(f"| `{s.name}` | {s.values} | {default} | {s.meaning} |")
        lines.append("")
    return "\n".join(lines)
