"""The CLI frame: help is fast and light, errors map to exit codes, generated files are current."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

HEAVY = ("torch", "triton", "transformers", "vllm", "exllamav3")

PROBE = r"""
import json, sys
argv = sys.argv[1:]
from glmctl.app import app
try:
    app(argv, prog_name="glmctl")
except SystemExit:
    pass
print("@@" + json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in {heavy})))
"""


def _command_paths():
    from typer.main import get_command

    from glmctl.app import app
    from scripts.gen_cli_reference import _walk

    return [path for path, _ in _walk(get_command(app), [])]


def _imported_heavy(argv: list[str], env: dict | None = None) -> list[str]:
    code = PROBE.replace("{heavy}", repr(set(HEAVY)))
    proc = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=REPO, env=env, timeout=60
    )
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@")]
    assert line, proc.stdout + proc.stderr
    return json.loads(line[-1][2:])


def test_help_of_every_command_imports_nothing_heavy():
    for path in _command_paths():
        assert _imported_heavy([*path, "--help"]) == [], f"glmctl {' '.join(path)} --help"


def test_completion_request_imports_nothing_heavy():
    import os

    env = {**os.environ, "_GLMCTL_COMPLETE": "complete_bash", "COMP_WORDS": "glmctl pl", "COMP_CWORD": "1"}
    assert _imported_heavy([], env=env) == []


def test_version(run_cli):
    from glmctl import __version__

    proc = run_cli("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"glmctl {__version__}"


def test_no_args_prints_help_and_lists_commands(run_cli):
    proc = run_cli()
    assert "plan" in proc.stdout + proc.stderr
    assert "testing" in proc.stdout + proc.stderr


def test_unknown_option_is_a_usage_error(run_cli):
    proc = run_cli("plan", "--no-such-option")
    assert proc.returncode == 2


@pytest.mark.parametrize(
    ("exc", "code"),
    [("GlmctlError", 1), ("UsageError", 2), ("ConfigError", 2), ("LicenseError", 2), ("DependencyError", 1)],
)
def test_error_mapping(exc, code):
    from glmctl import errors
    from glmctl._cli.error_map import run_guarded

    def boom():
        raise getattr(errors, exc)("it broke", hint="do the other thing")

    assert run_guarded(boom) == code


def test_unexpected_error_exits_1_and_debug_shows_traceback(monkeypatch, capsys):
    from glmctl._cli.error_map import run_guarded

    def boom():
        raise ValueError("surprise")

    assert run_guarded(boom) == 1
    err = capsys.readouterr().err
    assert "ValueError: surprise" in err and "GLMCTL_DEBUG=1" in err and "Traceback" not in err
    monkeypatch.setenv("GLMCTL_DEBUG", "1")
    assert run_guarded(boom) == 1
    assert "Traceback" in capsys.readouterr().err


def test_error_message_and_hint_reach_stderr(capsys):
    from glmctl._cli.error_map import run_guarded
    from glmctl.errors import UsageError

    def boom():
        raise UsageError("profile 'x' does not exist", hint="glmctl profile ls")

    assert run_guarded(boom) == 2
    err = capsys.readouterr().err
    assert "profile 'x' does not exist" in err and "glmctl profile ls" in err


def test_json_output_is_pure_json(capsys):
    from glmctl._cli.output import Mode, Output

    out = Output(Mode.json)
    out.note("this goes to stderr")
    out.result({"a": 1.5, "nan": float("nan")}, render=lambda c: c.print("TABLE"))
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"a": 1.5, "nan": None}
    assert "TABLE" not in captured.out


def test_completion_scripts_are_current():
    proc = subprocess.run(
        [sys.executable, "scripts/gen_completions.py", "--check"], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def test_cli_reference_is_current():
    proc = subprocess.run(
        [sys.executable, "scripts/gen_cli_reference.py"], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def test_brackets_in_messages_survive(capsys):
    """Extras like glmctl[gpu] and globs like *.[ch] must not be eaten as Rich markup."""
    from glmctl._cli.error_map import run_guarded
    from glmctl._cli.output import Mode, Output
    from glmctl.errors import DependencyError

    def boom():
        raise DependencyError("needs [gpu] extra", hint="pip install 'glmctl[gpu]'")

    run_guarded(boom)
    err = capsys.readouterr().err
    assert "needs [gpu] extra" in err and "glmctl[gpu]" in err
    out = Output(Mode.human)
    out.note("[doctor] step")
    out.warn("file x[1].bin")
    err = capsys.readouterr().err
    assert "[doctor] step" in err and "x[1].bin" in err


@pytest.mark.parametrize(("words", "expected"), [
    ("glmctl serve --profile c", {"commercial"}),
    ("glmctl profile show tiny", {"tiny-cpu"}),
    ("glmctl bench --profile ", {"commercial", "noncommercial", "latency", "tiny-cpu"}),
    ("glmctl doctor --profile lat", {"latency"}),
    ("glmctl fetch glm-5.3", {"glm-5.3-flash", "glm-5.3-flash-exl3-4bit"}),
    ("glmctl plan --kv-cache-dtype fp8", {"fp8", "fp8_ds_mla"}),
])
def test_completion_offers_profile_names_fetch_targets_and_kv_dtypes(words, expected):
    import os

    cword = str(len(words.split()) - (0 if words.endswith(" ") else 1))
    env = {**os.environ, "_GLMCTL_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": cword}
    proc = subprocess.run([sys.executable, "-m", "glmctl"], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=60)
    assert expected <= set(proc.stdout.split()), proc.stdout + proc.stderr


def test_every_error_class_maps_to_a_documented_exit_code():
    """1 runtime, 2 usage or configuration, 130 interrupted: nothing else reaches the shell."""
    import importlib
    import pkgutil

    import glmctl
    from glmctl.errors import GlmctlError

    for mod in pkgutil.walk_packages(glmctl.__path__, "glmctl."):
        if mod.name.split(".")[1] in ("plugin", "collectives", "kernels"):
            continue  # data-plane modules import torch/vLLM; their errors never reach the CLI's map
        try:
            importlib.import_module(mod.name)
        except ImportError:
            continue
    seen, todo = set(), [GlmctlError]
    while todo:
        cls = todo.pop()
        seen.add(cls)
        todo += [c for c in cls.__subclasses__() if c not in seen]
    assert len(seen) > 15
    for cls in seen:
        assert cls.exit_code in (1, 2), cls  # FetchAbandoned sets 130 per instance, at Ctrl-C only
