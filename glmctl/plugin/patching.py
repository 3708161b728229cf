"""Patching vLLM classes once per process (the plugin's `register()` may run several times)."""

from __future__ import annotations

from collections.abc import Callable


def wrap_once(cls, name: str, make: Callable, tag: str) -> bool:
    """Replace `cls.<name>` by `make(original)` unless this tag already did (a marker in the
    class's own dict, so a subclass is never mistaken for its base); True if it patched now."""
    marker = f"_glmctl_{tag}_{name}"
    if cls.__dict__.get(marker):
        return False
    setattr(cls, name, make(getattr(cls, name)))
    setattr(cls, marker, True)
    return True


def after_init(cls, tag: str, then: Callable) -> bool:
    """Run `then(self, *args, **kwargs)` after `cls.__init__`, patched once per tag."""

    def make(stock_init):
        def __init__(self, *args, **kwargs):
            stock_init(self, *args, **kwargs)
            then(self, *args, **kwargs)

        return __init__

    return wrap_once(cls, "__init__", make, tag)
