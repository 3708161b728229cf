"""Shared test setup: every user directory points at a temp dir; GPU tests skip without CUDA."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _isolated_user_dirs(tmp_path_factory, monkeypatch):
    """No test reads or writes the developer's real ~/.config/glmctl or ~/.cache/glmctl."""
    root = tmp_path_factory.mktemp("glmctl-user")
    monkeypatch.setenv("GLMCTL_HOME", str(root / "home"))
    monkeypatch.setenv("GLMCTL_CACHE", str(root / "cache"))
    monkeypatch.delenv("GLMCTL_DEBUG", raising=False)
    yield


@functools.cache
def cuda_available() -> bool:
    # Only asked when a gpu-marked test was collected, so the unit lane never imports torch here.
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if gpu_items and not cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA device (gpu lane: make gpu-check)")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture
def run_cli():
    """Run the real `glmctl` entry point in a subprocess; returns CompletedProcess."""
    import subprocess

    def _run(*args: str, env: dict | None = None, timeout: float = 120, input: str | None = None):
        full_env = {**os.environ, **(env or {})}
        return subprocess.run(
            [sys.executable, "-m", "glmctl", *args],
            capture_output=True,
            text=True,
            env=full_env,
            timeout=timeout,
            input=input,
            cwd=REPO,
        )

    return _run


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """The default tiny GLM-5.3-Flash checkpoint (seed 0), built once per test session.

    Returns a `glmctl.testing.tiny_checkpoint.TinyCheckpointInfo`; `.path` is the directory. Treat
    it as read-only: every lane shares it. Needs torch and tokenizers (the [cpu] extra).
    """
    from glmctl.testing.tiny_checkpoint import build

    return build(tmp_path_factory.mktemp("tiny-glm") / "ckpt", seed=0)


@pytest.fixture(scope="session")
def tiny_drafter(tmp_path_factory, tiny_checkpoint):
    """The tiny DFlash2 drafter (seed 0) for `tiny_checkpoint`, built once per test session.

    A `glmctl.testing.tiny_drafter.TinyDrafterInfo`; `.path` is the directory. Read-only.
    """
    from glmctl.testing.tiny_drafter import build

    return build(tmp_path_factory.mktemp("tiny-dflash2") / "ckpt", tiny_checkpoint.path, seed=0)
