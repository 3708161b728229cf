"""pyproject's explicit package list covers every package folder (discovery can't follow the map)."""

from __future__ import annotations

import tomllib

from tests.conftest import REPO


def _declared() -> set[str]:
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    return set(data["tool"]["setuptools"]["packages"])


def _on_disk() -> set[str]:
    found = set()
    mapping = {"glmctl": REPO / "glmctl", "glmctl.kernels": REPO / "kernels",
               "glmctl.quantize": REPO / "quantize", "glmctl.profiles": REPO / "profiles"}
    for prefix, root in mapping.items():
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root).parts
            found.add(".".join([prefix, *rel]))
    return found


def test_every_package_folder_is_declared():
    missing = _on_disk() - _declared()
    assert not missing, f"add to pyproject [tool.setuptools] packages: {sorted(missing)}"


def test_no_top_level_kernels_or_quantize_package_installed():
    import importlib.util

    import glmctl.kernels  # noqa: F401  (maps to kernels/)

    spec = importlib.util.find_spec("glmctl.kernels")
    assert spec is not None and spec.origin is not None
    assert spec.origin.endswith("kernels/__init__.py")
