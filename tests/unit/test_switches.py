"""glmctl.switches: every GLMCTL_* variable in the tree is declared there (and each declared one is
read somewhere), one parser per kind, and the enums the plugin switches on agree with it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from glmctl import switches
from glmctl.switches import SwitchError

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("glmctl", "kernels", "quantize", "profiles", "tests", "bench", "scripts", ".ci")
SUFFIXES = {".py", ".sh", ".md", ".yaml", ".yml", ".toml", ""}
NAME = re.compile(r"(?<![A-Za-z0-9_])GLMCTL_[A-Z0-9_]+")
# Spelled like a variable, but not one.
NOT_SWITCHES = {
    "GLMCTL_SPARSE_MLA": "the plugin's attention backend, by the name vLLM's registry knows it",
    "GLMCTL_TEST_SECRET": "a value a test plants to see that the HumanEval sandbox drops it",
}


def _files():
    for top in SCANNED:
        for path in (ROOT / top).rglob("*"):
            if (path.is_file() and path.suffix in SUFFIXES and "__pycache__" not in path.parts
                    and not path.is_relative_to(ROOT / "bench" / "results")):
                yield path
    for name in ("README.md", "Makefile", "pyproject.toml"):
        yield ROOT / name


def _names_in_tree() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in _files():
        if path in (ROOT / "glmctl" / "switches.py", Path(__file__).resolve()):
            continue
        for name in NAME.findall(path.read_text(encoding="utf-8", errors="replace")):
            found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_variable_in_the_tree_is_declared_and_every_declared_one_is_used():
    found = _names_in_tree()
    declared = {s.name for s in switches.SWITCHES}
    undeclared = {n: sorted(where)[:3] for n, where in found.items() if n not in declared | set(NOT_SWITCHES)}
    assert not undeclared, f"declare these in glmctl/switches.py: {undeclared}"
    unused = [n for n in declared if not (found.get(n, set()) - {"docs/cli.md"})]
    assert not unused, f"declared in glmctl/switches.py but read nowhere: {unused}"
    assert len(declared) == len(switches.SWITCHES)


@pytest.mark.parametrize("word", ["off", "OFF", " no ", "0", "false", "False"])
def test_one_off_parser_for_every_flag_and_off_choice(word):
    for s in switches.SWITCHES:
        if s.kind == "flag":
            assert s.parse(word) is False, s.name
        elif s.kind == "choice" and "off" in s.choices:
            assert s.parse(word) == "off", s.name
    assert switches.parse("GLMCTL_EXL3", word) is False


def test_flags_defaults_and_values():
    assert switches.parse("GLMCTL_EXL3", None) is True and switches.parse("GLMCTL_EXL3", "") is True
    assert switches.parse("GLMCTL_EXL3", "yes") is True
    assert switches.parse("GLMCTL_DEBUG", None) is False and switches.parse("GLMCTL_DEBUG", "1") is True
    assert switches.parse("GLMCTL_PLUGIN", "TRUE") == "on" and switches.parse("GLMCTL_PLUGIN", "no") == "off"
    assert switches.parse("GLMCTL_COLLECTIVES", " Host-Staged ") == "host-staged"
    assert switches.parse("GLMCTL_COLLECTIVES_INT8_MIN_MIB", None) == 4.0
    assert switches.parse("GLMCTL_COLLECTIVES_MAX_MIB", None) is None
    assert switches.parse("GLMCTL_ACCEPT_LICENSES", " a, ,b ") == ("a", "b")
    assert switches.parse("GLMCTL_ACCEPT_LICENSES", None) == ()
    assert switches.parse("GLMCTL_SHM_DIR", None) == Path("/dev/shm")
    assert switches.read("GLMCTL_HOME", {"GLMCTL_HOME": "/x/y"}) == Path("/x/y")
    assert switches.read("GLMCTL_HOME", {}) is None


def test_bad_values_name_the_variable_and_what_it_takes():
    with pytest.raises(SwitchError, match="GLMCTL_DFLASH2_KV='mirror' is not one of auto, alias, append"):
        switches.parse("GLMCTL_DFLASH2_KV", "mirror")
    with pytest.raises(SwitchError, match="GLMCTL_COLLECTIVES_TIMEOUT_S='soon' must be a number >= 0.1"):
        switches.parse("GLMCTL_COLLECTIVES_TIMEOUT_S", "soon")
    with pytest.raises(ValueError):  # a SwitchError is a ConfigError and a ValueError
        switches.parse("GLMCTL_EXL3_PREFILL", "fast")
    with pytest.raises(KeyError):
        switches.read("GLMCTL_NO_SUCH_SWITCH")


def test_hand_over_variables_only(monkeypatch):
    monkeypatch.delenv("GLMCTL_PLUGIN_ACTIVE", raising=False)
    switches.hand_over("GLMCTL_PLUGIN_ACTIVE", "glm5_next")
    assert switches.read("GLMCTL_PLUGIN_ACTIVE") == "glm5_next"
    assert "GLMCTL_PLUGIN_ACTIVE" in switches.names(switches.HAND_OVER)
    with pytest.raises(ValueError):
        switches.hand_over("GLMCTL_PLUGIN", "on")


def test_the_plugins_enums_are_the_declared_choices():
    from glmctl.plugin.policy import MhcPath, PluginMode

    assert set(PluginMode) == set(switches.switch("GLMCTL_PLUGIN").choices)
    assert {"auto", *MhcPath} == set(switches.switch("GLMCTL_MHC").choices)


def test_the_docs_table_lists_every_variable():
    table = switches.markdown_table()
    for s in switches.SWITCHES:
        assert f"| `{s.name}` |" in table
    assert (ROOT / "docs" / "cli.md").read_text().rstrip().endswith(table.rstrip())


def test_plugin_off_reads_only_off_and_leaves_a_bad_value_to_the_plugins_own_report():
    assert switches.plugin_off({"GLMCTL_PLUGIN": "off"}) is True
    assert switches.plugin_off({"GLMCTL_PLUGIN": "auto"}) is False
    assert switches.plugin_off({}) is False
    assert switches.plugin_off({"GLMCTL_PLUGIN": "sideways"}) is False
