"""docs/ARCHITECTURE.md is the map of the tree, checked against it so it cannot drift: its package
table names every package (a folder with `__init__.py` under `glmctl/`, and the mapped `kernels/`,
`quantize/`, `profiles/`) and nothing else, with its folder; every dotted `glmctl.` name anywhere in
it is a module, a package or a top-level name of one; the plugin keeps at most eight modules at its
top, each named there."""

from __future__ import annotations

import ast
import re

from tests.conftest import REPO

DOC = REPO / "docs" / "ARCHITECTURE.md"
FOLDERS = {"glmctl": REPO / "glmctl", "glmctl.kernels": REPO / "kernels",
           "glmctl.quantize": REPO / "quantize", "glmctl.profiles": REPO / "profiles"}
PLUGIN_TOP_MODULES_AT_MOST = 8


def _packages() -> dict[str, str]:
    """Dotted package -> its folder relative to the repository, for every package folder."""
    found = {}
    for prefix, root in FOLDERS.items():
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root).parts
            found[".".join([prefix, *rel])] = init.parent.relative_to(REPO).as_posix() + "/"
    return found


def _modules() -> dict[str, object]:
    """Dotted module or package name -> its source file."""
    found = {}
    for prefix, root in FOLDERS.items():
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((prefix, *parts))] = path
    return found


def _package_table(text: str) -> dict[str, str]:
    """The rows of the `## Packages` table: package -> folder."""
    section = text.split("\n## Packages\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`glmctl"):
            rows[cells[0].strip("`")] = cells[1].strip("`")
    return rows


def _top_level_names(path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _unresolved(text: str, modules: dict) -> list[str]:
    """Dotted `glmctl.` names in the text that name no module, package or top-level name."""
    bad = []
    for dotted in sorted(set(re.findall(r"(?<![\w./])glmctl(?:\.\w+)+", text))):
        parts = dotted.split(".")
        known = next((i for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in modules), 0)
        rest = parts[known:]
        if not known or len(rest) > 1 or (
                rest and rest[0] not in _top_level_names(modules[".".join(parts[:known])])):
            bad.append(dotted)
    return bad


def test_the_package_table_is_the_tree():
    table = _package_table(DOC.read_text(encoding="utf-8"))
    on_disk = _packages()
    assert sorted(set(on_disk) - set(table)) == [], "packages missing from docs/ARCHITECTURE.md"
    assert sorted(set(table) - set(on_disk)) == [], "docs/ARCHITECTURE.md names packages that do not exist"
    wrong = {name: (folder, on_disk[name]) for name, folder in table.items() if folder != on_disk[name]}
    assert wrong == {}, "folder column (doc, disk)"


def test_every_dotted_name_in_the_doc_exists():
    assert _unresolved(DOC.read_text(encoding="utf-8"), _modules()) == []


def test_the_checks_can_fail():
    text = "\n## Packages\n| `glmctl.nowhere` | `glmctl/nowhere/` | x |\n## Next\n"
    assert _package_table(text) == {"glmctl.nowhere": "glmctl/nowhere/"}
    modules = _modules()
    assert _unresolved("`glmctl.plugin.sparse_mla` and `glmctl.plugin.policy.Target`", modules) == [
        "glmctl.plugin.sparse_mla"]
    assert _unresolved("`glmctl.plugin.policy.Nothing`, `glmctl.plugin:register`", modules) == [
        "glmctl.plugin.policy.Nothing"]


def test_the_plugin_top_holds_few_modules_each_named_in_the_doc():
    text = DOC.read_text(encoding="utf-8")
    top = sorted(p.stem for p in (REPO / "glmctl" / "plugin").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= PLUGIN_TOP_MODULES_AT_MOST, f"glmctl/plugin/ holds {len(top)} modules: {top}"
    assert [m for m in top if f"`glmctl.plugin.{m}`" not in text] == []
