"""Check a rendered vLLM config with vLLM's own `vllm serve` argument parser.

The check runs in a short-lived child process (`python -m glmctl.serving.vllm_args CONFIG`): it
imports vLLM and torch, loads vLLM's general plugins (glmctl's included) and asks which platform
vLLM detects, none of which should stay in the glmctl process that supervises the server. The
child builds the `serve` parser exactly as vLLM's CLI does, reads the file through `--config`
(the same path `vllm serve --config` takes) and reports, as JSON on its last stdout line:
vLLM's version, whether glmctl's plugin is registered and importable, the platform, and every
problem found: keys that are not `vllm serve` options, values the parser rejects, `false` for a
flag that has no `--no-` form (vLLM drops those silently), unknown speculative-config keys.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "glmctl"
_MARK = "@@glmctl-vllm-check "
FLAGS_DATA = "vllm_serve_flags.json"
"""vLLM 0.30's `vllm serve` options as data (scripts/gen_vllm_flags.py writes it from vLLM's own
parser; the vllm lane checks it still matches), so a profile is checked where vLLM is not installed."""


@dataclass(frozen=True)
class FlagTable:
    vllm_version: str
    options: frozenset[str]
    """Every long option of `vllm serve`, without the leading dashes (`--no-` forms included)."""
    speculative_config_fields: frozenset[str]

    def problems(self, config: dict[str, Any]) -> list[str]:
        """What vLLM's parser would refuse, or silently drop, in a `vllm serve --config` mapping."""
        out = []
        for key, value in config.items():
            if key not in self.options:
                out.append(f"'{key}' is not a `vllm serve` option")
            elif value is False and f"no-{key}" not in self.options:
                out.append(f"'{key}: false' would be ignored by vLLM (the flag has no --no- form): remove it")
        spec = config.get("speculative-config")
        if isinstance(spec, dict):
            out += [f"speculative-config.{k} is not a SpeculativeConfig field" for k in spec
                    if k not in self.speculative_config_fields]
        return out

    def as_json(self) -> dict[str, Any]:
        return {"vllm_version": self.vllm_version, "generated_by": "scripts/gen_vllm_flags.py",
                "options": sorted(self.options), "speculative_config_fields": sorted(self.speculative_config_fields)}


def shipped_flags() -> FlagTable:
    """The flag table shipped with glmctl (no vLLM import)."""
    from importlib import resources

    raw = json.loads(resources.files("glmctl.serving").joinpath(FLAGS_DATA).read_text())
    return FlagTable(raw["vllm_version"], frozenset(raw["options"]), frozenset(raw["speculative_config_fields"]))


def flags_from_vllm() -> FlagTable:
    """The same table read from the installed vLLM's parser (imports vLLM: the child or a script)."""
    import dataclasses

    from vllm.config import SpeculativeConfig

    from glmctl.serving.vllm_entry import _answer_vllm_version_lookup, vllm_distribution_version

    _answer_vllm_version_lookup()
    _, serve_parser, _ = _serve_parser()
    options = {o[2:] for o in serve_parser._option_string_actions if o.startswith("--")}
    version = (vllm_distribution_version() or "?").split("+")[0]
    return FlagTable(version, frozenset(options), frozenset(f.name for f in dataclasses.fields(SpeculativeConfig)))


@dataclass
class VllmCheck:
    vllm_version: str | None = None
    platform: str | None = None
    """vLLM's detected platform: "cuda", "cpu", ..."""
    plugin_registered: bool = False
    """glmctl's entry point is in the vllm.general_plugins group (and not filtered by VLLM_PLUGINS)."""
    plugin_error: str | None = None
    problems: list[str] = field(default_factory=list)
    error: str | None = None
    """vLLM could not be imported, or the check itself failed."""

    @property
    def ok(self) -> bool:
        return self.error is None and not self.problems


def check(config_yaml: str, env: dict[str, str] | None = None, timeout: float = 300) -> VllmCheck:
    """Run the check on the text of a `vllm serve --config` file, in a child process."""
    return check_many([config_yaml], env, timeout)[0]


def check_many(
    config_yamls: list[str], env: dict[str, str] | None = None, timeout: float = 300
) -> list[VllmCheck]:
    """`check` for several configs, paying for one vLLM import."""
    with tempfile.TemporaryDirectory(prefix="glmctl-vllm-check-") as tmp:
        config_paths = []
        for i, text in enumerate(config_yamls):
            path = Path(tmp) / f"vllm-{i}.yaml"
            path.write_text(text)
            config_paths.append(str(path))
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "glmctl.serving.vllm_args", *config_paths],
                capture_output=True, text=True, timeout=timeout,
                env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            failed = VllmCheck(error=f"vLLM's argument check did not finish within {timeout:.0f} s")
            return [failed for _ in config_yamls]
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_MARK):
            return [VllmCheck(**r) for r in json.loads(line[len(_MARK):])]
    tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
    failed = VllmCheck(error=f"vLLM's argument check failed (exit {proc.returncode}): {tail}")
    return [failed for _ in config_yamls]


# ---- the child process ------------------------------------------------------------------------


def _serve_parser():
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    top = FlexibleArgumentParser(prog="vllm")
    subparsers = top.add_subparsers(required=False, dest="subparser")
    serve = ServeSubcommand()
    serve_parser = serve.subparser_init(subparsers)
    return top, serve_parser, serve


def _plugin_state() -> tuple[bool, str | None]:
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group=PLUGIN_GROUP) if ep.name == PLUGIN_NAME]
    if not eps:
        return False, f"no '{PLUGIN_NAME}' entry point in {PLUGIN_GROUP} (is glmctl installed?)"
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN_NAME not in [p.strip() for p in allowed.split(",")]:
        return False, f"VLLM_PLUGINS={allowed!r} leaves out '{PLUGIN_NAME}'"
    try:
        eps[0].load()
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return True, f"{type(exc).__name__}: {exc}"
    return True, None


def _static_problems(config: dict[str, Any], serve_parser) -> list[str]:
    """What the parser would not say (or would say one at a time), from the live parser."""
    import dataclasses

    from vllm.config import SpeculativeConfig

    options = {o[2:] for o in serve_parser._option_string_actions if o.startswith("--")}
    table = FlagTable("live", frozenset(options), frozenset(f.name for f in dataclasses.fields(SpeculativeConfig)))
    return table.problems(config)


def _run_check(config_path: str) -> dict[str, Any]:
    import contextlib
    import io

    import yaml

    from glmctl.serving.vllm_entry import _answer_vllm_version_lookup, vllm_distribution_version

    _answer_vllm_version_lookup()
    result: dict[str, Any] = {"vllm_version": vllm_distribution_version()}
    try:
        top, serve_parser, serve = _serve_parser()
    except Exception as exc:  # noqa: BLE001
        result["error"] = f"vLLM is not importable: {type(exc).__name__}: {exc}"
        return result
    result["plugin_registered"], result["plugin_error"] = _plugin_state()
    try:
        from vllm.platforms import current_platform

        result["platform"] = current_platform.device_type or None
    except Exception:  # noqa: BLE001 - the platform is informative only
        result["platform"] = None

    config = yaml.safe_load(Path(config_path).read_text()) or {}
    problems = _static_problems(config, serve_parser)
    if not problems:
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                args = top.parse_args(["serve", "--config", config_path])
            serve.validate(args)
        except SystemExit:
            errors = [ln.split("error:", 1)[1].strip() for ln in stderr.getvalue().splitlines() if "error:" in ln]
            problems.append(errors[-1] if errors else stderr.getvalue().strip()[-500:])
        except (ValueError, TypeError) as exc:
            problems.append(str(exc))
    result["problems"] = problems
    return result


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    results = [_run_check(path) for path in argv]
    sys.stdout.write("\n" + _MARK + json.dumps(results) + "\n")


if __name__ == "__main__":
    main()
