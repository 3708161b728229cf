"""Helpers shared by the tests/unit/test_quantize*.py files (not a test module)."""

from __future__ import annotations

import filecmp
import os
import shutil
from pathlib import Path

SMALL = dict(layers=4, hidden=256, vocab=256, kda_heads=2, mla_heads=2, q_lora=128, kv_lora=256,
             head_dim=128, index_heads=4, intermediate=256, experts=2, moe_intermediate=128,
             layers_per_shard=2)


def make_synthetic(tmp_path_factory) -> Path:
    """A small GLM-5.3-Flash-named bf16 checkpoint (2 shards); copy it before modifying it."""
    from tests.synthetic_checkpoint import SyntheticSpec, write_synthetic_checkpoint

    return write_synthetic_checkpoint(tmp_path_factory.mktemp("synthetic") / "src", SyntheticSpec(**SMALL))


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def cli(*args: str) -> tuple[int, str, str]:
    """Run glmctl in-process (torch is already imported here); returns (exit code, stdout, stderr)."""
    import contextlib
    import io

    from glmctl._cli.error_map import run_guarded
    from glmctl.app import app

    out, err = io.StringIO(), io.StringIO()
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "4000"  # Rich wraps at 80 columns off a terminal; keep messages whole
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = run_guarded(lambda: app([*args], prog_name="glmctl"))
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    return code, out.getvalue(), err.getvalue()


def same_tree(a: Path, b: Path, ignore: tuple[str, ...] = ()) -> list[str]:
    """Names of files that differ (or exist on one side only) between two directories."""
    cmp = filecmp.dircmp(a, b, ignore=list(ignore))
    diff = cmp.left_only + cmp.right_only + cmp.diff_files
    _, mismatch, errors = filecmp.cmpfiles(a, b, cmp.common_files, shallow=False)
    return sorted(set(diff + mismatch + errors))


def looks_like_checkpoint(path: Path) -> bool:
    """What loaders need to take a directory for a checkpoint: config.json (and an index)."""
    return (path / "config.json").exists() or (path / "model.safetensors.index.json").exists()
