"""glmctl's modules import each other without circles.

A static walk over the source (`ast`, nothing is imported): every `import` statement counts, at
module level, inside functions and under `TYPE_CHECKING` alike, because a deferred import that
closes a circle still ties the two modules into one idea. The folders map into the package as
pyproject.toml says: `glmctl/`, `kernels/` -> `glmctl.kernels`, `quantize/` -> `glmctl.quantize`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = {"glmctl": ROOT / "glmctl", "glmctl.kernels": ROOT / "kernels",
                "glmctl.quantize": ROOT / "quantize"}


def modules() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the installed package."""
    found = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def imported_names(name: str, path: Path) -> set[str]:
    """Every absolute dotted name the module's import statements mention (`from a import b` gives
    `a.b`, which `import_graph` resolves to the submodule `a.b` or, when b is a name in it, `a`)."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph = {}
    for name, path in known.items():
        targets = set()
        for imported in imported_names(name, path):
            # `import glmctl.a.b` names the module glmctl.a.b; take the longest known prefix
            while imported and imported not in known:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_walk_sees_the_package():
    graph = import_graph()
    assert {"glmctl.app", "glmctl.kernels.layouts", "glmctl.quantize.fp8", "glmctl.plugin.activation"} <= set(graph)
    assert "glmctl.quantize.fp8" in graph["glmctl.quantize.fp8_convert"]


def test_the_walk_finds_a_circle_through_a_deferred_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_relative_and_deferred_imports_are_edges(tmp_path):
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .a import x\n")
    (pkg / "a.py").write_text("def f():\n    from . import b\n    from .b import y\n")
    assert imported_names("p", pkg / "__init__.py") == {"p.a.x"}
    assert imported_names("p.a", pkg / "a.py") == {"p.b", "p.b.y"}


def test_glmctl_has_no_import_circles():
    found = circles(import_graph())
    assert found == [], "import circles (break each: move the shared piece below both sides):\n" + \
        "\n".join(" <-> ".join(c) for c in found)


CLI = ("glmctl.app", "glmctl._cli", "glmctl.commands", "glmctl.__main__")


def _is_under(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_libraries_do_not_import_the_cli():
    """Libraries speak through callbacks (`glmctl.feedback`), never through the CLI's Output."""
    graph = import_graph()
    found = sorted(f"{m} -> {t}" for m, targets in graph.items() if not _is_under(m, CLI)
                   for t in targets if _is_under(t, CLI))
    assert found == [], "a library imports the CLI:\n" + "\n".join(found)


def test_the_planner_and_serving_read_no_plugin_policy():
    """The KV layout rules both sides use live below both (`glmctl.kernels.layouts`)."""
    graph = import_graph()
    found = sorted(f"{m} -> {t}" for m, targets in graph.items()
                   if _is_under(m, ("glmctl.plan", "glmctl.serving")) for t in targets
                   if t == "glmctl.plugin.policy")
    assert found == [], "\n".join(found)


def test_no_two_modules_share_a_file_name():
    """A file name says what its module holds, so one name is one module across the package
    (`glmctl/`, `kernels/`, `quantize/`); packages' `__init__.py` are the only repeats."""
    by_name: dict[str, list[str]] = {}
    for name, path in modules().items():
        if path.name != "__init__.py":
            by_name.setdefault(path.name, []).append(name)
    assert {file: names for file, names in by_name.items() if len(names) > 1} == {}


def test_one_class_is_called_model_spec():
    """`ModelSpec` is the planner's architecture numbers (glmctl.plan.model); a profile's model
    section is `ProfileModel`."""
    defined = [name for name, path in modules().items()
               for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path)))
               if isinstance(node, ast.ClassDef) and node.name == "ModelSpec"]
    assert defined == ["glmctl.plan.model"]


def test_every_module_of_the_package_is_used_by_the_package():
    """Nothing ships that only the tests use: each module is imported by another module, or named
    by a string the package or pyproject.toml holds (entry points, vLLM's dotted backend paths, a
    script run by file name). Test-only helpers live under tests/."""
    graph = import_graph()
    imported = set().union(*graph.values())
    texts = [path.read_text(encoding="utf-8") for path in modules().values()]
    texts.append((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    unused = []
    for name, path in modules().items():
        if path.name in ("__init__.py", "__main__.py") or name in imported:
            continue
        own = path.read_text(encoding="utf-8")
        if not any(text is not own and (name in text or path.name in text) for text in texts):
            unused.append(name)
    assert not unused, f"modules no part of the package uses (move test-only helpers to tests/): {unused}"
