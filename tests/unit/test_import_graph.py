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
            base = _from_base(name, is_package, node)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


def _from_base(name: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module that module `name`'s `from ... import` statement reads from."""
    if not node.level:
        return node.module or ""
    anchor = name.split(".")
    anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
    return ".".join([*anchor, *([node.module] if node.module else [])])


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


def _is_private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _home(dotted: str, known: dict[str, Path]) -> str | None:
    """The package a dotted name's first `_private` part belongs to (None: nothing private in it):
    the package holding it, or, when a module holds it, that module's package.

    `glmctl._cli.options` -> `glmctl` (the private package `_cli` is glmctl's);
    `glmctl.plugin.activation._installed` and `glmctl.plugin.policy.Target._x` -> `glmctl.plugin`;
    `glmctl.plan._x` (a name in a package's `__init__`) -> `glmctl.plan`."""
    parts = dotted.split(".")
    private = next((i for i, part in enumerate(parts) if i and _is_private(part)), None)
    if private is None:
        return None
    owner = parts[:private]
    while owner and ".".join(owner) not in known:
        owner.pop()
    if not owner:
        return None
    holder = ".".join(owner)
    return holder if known[holder].name == "__init__.py" else holder.rpartition(".")[0]


def private_reaches(name: str, path: Path, known: dict[str, Path],
                    root: str = "glmctl") -> list[str]:
    """Every `_private` name under `root` that module `name` imports, or reads off a module it
    imported (`alias._x`, `alias.Class._x`), from outside the package that holds it (`_home`)."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    reached: set[str] = set()
    aliases: dict[str, str] = {}  # local name -> the module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                reached.add(alias.name)
                bound = alias.asname or alias.name.split(".")[0]
                aliases[bound] = alias.name if alias.asname else bound
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(name, is_package, node)
            for alias in node.names:
                reached.add(f"{base}.{alias.name}")
                if f"{base}.{alias.name}" in known:
                    aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            chain, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in aliases:
                reached.add(".".join([aliases[value.id], *reversed(chain)]))
    found = []
    for dotted in sorted(reached):
        if not (dotted == root or dotted.startswith(root + ".")):
            continue
        home = _home(dotted, known)
        if home is not None and not (name == home or name.startswith(home + ".")):
            found.append(f"{name} -> {dotted}")
    return found


def test_private_names_stay_in_their_package(tmp_path):
    """`p.b.n` may not import `_x` from `p.a.m` (a sibling package) nor read `mm.C._w` off it, nor
    may `p.b.deep.d` read `m._x`; `p.a.k` (the same package) may, `p.b.deep.d` may read `n._z` of
    its own package `p.b`, and anything under `p` may use `p._util` and `p`'s own `_y`."""
    files = {
        "p/__init__.py": "_y = 1\n", "p/_util.py": "", "p/a/__init__.py": "", "p/a/m.py": "_x = 1\n",
        "p/a/k.py": "from p.a.m import _x\nfrom p.a import m\nm._x\n",
        "p/b/__init__.py": "", "p/b/deep/__init__.py": "",
        "p/b/n.py": "from p.a.m import _x\nfrom p import _y, _util\nimport p.a.m as mm\nmm.C._w\n",
        "p/b/deep/d.py": "from ...a import m\nprint(m._x)\nfrom .. import n\nn._z\n",
    }
    known = {}
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        parts = Path(rel).with_suffix("").parts
        known[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    found = {m: private_reaches(m, known[m], known, root="p") for m in known}
    assert found["p.a.k"] == []
    assert found["p.b.n"] == ["p.b.n -> p.a.m.C._w", "p.b.n -> p.a.m._x"]
    assert found["p.b.deep.d"] == ["p.b.deep.d -> p.a.m._x"]  # n._z is p.b's: d is inside p.b


def test_no_module_takes_a_private_name_from_another_package():
    """A `_name` is private to the package holding it (a module's: the module's package). Make it
    public, or move the code that needs it into that package."""
    known = modules()
    found = [line for name, path in known.items() for line in private_reaches(name, path, known)]
    assert found == [], "private names used outside their package:\n" + "\n".join(found)
