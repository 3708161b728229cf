"""Shell-completion values: profile names, fetch targets, KV-cache dtypes.

Completion runs on every Tab, so these read the file names and the catalogue's YAML directly and
import no model of the libraries (no pydantic profile loading, nothing of torch or vLLM).
"""

from __future__ import annotations


def profile_names(incomplete: str) -> list[str]:
    from importlib import resources
    from pathlib import Path

    from glmctl import paths

    names: set[str] = set()
    for root in (paths.user_profiles(), Path(str(resources.files("glmctl.profiles")))):
        if root.is_dir():
            names.update(p.stem for p in root.glob("*.yaml"))
    return sorted(n for n in names if n.startswith(incomplete))


def fetch_targets(incomplete: str) -> list[str]:
    from importlib import resources

    import yaml

    try:
        artifacts = yaml.safe_load(resources.files("glmctl.hub").joinpath("catalog.yaml").read_text())["artifacts"]
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return []
    return sorted(n for n in artifacts if n.startswith(incomplete))


def kv_cache_dtypes(incomplete: str) -> list[str]:
    from glmctl.kernels.layouts import KV_CACHE_DTYPES

    return [d for d in KV_CACHE_DTYPES if d.startswith(incomplete)]
