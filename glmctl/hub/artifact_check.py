"""Check a downloaded artifact: files present, sizes and hashes, safetensors headers, config.

Expected files come from the Hub's tree listing when online, or from the manifest written at
download time when offline. Hashing runs on a thread pool (hashlib releases the GIL), with one
progress bar counting bytes.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from glmctl.hub.manifest import ExpectedFile, hash_file

Status = Literal["ok", "missing", "size-mismatch", "hash-mismatch", "bad-header"]


class FileCheck(BaseModel):
    path: str
    status: Status
    expected_size: int | None = None
    actual_size: int | None = None
    detail: str = ""


class VerifyReport(BaseModel):
    directory: str
    source: Literal["hub", "manifest", "none"]
    revision: str | None
    hashed: bool
    files: list[FileCheck]
    problems: list[str]   # structural: index, headers, config

    @property
    def bad_files(self) -> list[FileCheck]:
        return [f for f in self.files if f.status != "ok"]

    @property
    def ok(self) -> bool:
        return not self.bad_files and not self.problems


def check_files(
    local_dir: Path, expected: list[ExpectedFile], *, hash_contents: bool, jobs: int = 4, progress=None
) -> list[FileCheck]:
    """Presence, size, then (optionally) content hash of every expected file."""
    checks: dict[str, FileCheck] = {}
    to_hash: list[ExpectedFile] = []
    for exp in expected:
        path = local_dir / exp.path
        if not path.is_file():
            checks[exp.path] = FileCheck(path=exp.path, status="missing", expected_size=exp.size)
            continue
        size = path.stat().st_size
        if size != exp.size:
            checks[exp.path] = FileCheck(
                path=exp.path, status="size-mismatch", expected_size=exp.size, actual_size=size,
                detail="truncated" if size < exp.size else "larger than recorded",
            )
            continue
        checks[exp.path] = FileCheck(path=exp.path, status="ok", expected_size=exp.size, actual_size=size)
        if hash_contents and (exp.sha256 or exp.git_oid):
            to_hash.append(exp)

    if to_hash:
        total = sum(e.size for e in to_hash)
        task = progress.add_task("hashing", total=total) if progress is not None else None

        def on_bytes(n: int) -> None:
            if progress is not None:
                progress.advance(task, n)

        def one(exp: ExpectedFile) -> tuple[ExpectedFile, str]:
            return exp, hash_file(local_dir / exp.path, exp, on_bytes)

        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            for exp, digest in pool.map(one, to_hash):
                want = exp.sha256 or exp.git_oid
                if digest != want:
                    checks[exp.path] = checks[exp.path].model_copy(
                        update={"status": "hash-mismatch", "detail": f"expected {want[:12]}..., got {digest[:12]}..."}
                    )
    return [checks[e.path] for e in expected]


def check_structure(local_dir: Path) -> tuple[list[FileCheck], list[str]]:
    """Safetensors headers parse and cover their files; the index and config agree with them.

    Header parsing is glmctl.quantize's (`read_header`), the same check the converters run.
    """
    from glmctl.quantize.safetensors_io import CheckpointError, read_header

    header_checks: list[FileCheck] = []
    problems: list[str] = []
    shapes: dict[str, list[int]] = {}
    for shard in sorted(local_dir.glob("*.safetensors")):
        try:
            header = read_header(shard)
        except CheckpointError as exc:
            header_checks.append(FileCheck(path=shard.name, status="bad-header", detail=exc.message))
            continue
        shapes.update({name: list(entry.shape) for name, entry in header.tensors.items()})

    index_path = local_dir / "model.safetensors.index.json"
    if index_path.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            problems.append(f"model.safetensors.index.json is unreadable: {exc}")
            weight_map = {}
        for shard in sorted(set(weight_map.values())):
            if not (local_dir / shard).is_file():
                problems.append(f"index names shard {shard}, which is missing")
        if not header_checks:
            missing = sorted(k for k in weight_map if k not in shapes)
            if missing:
                problems.append(f"{len(missing)} tensors in the index are in no shard (first: {missing[0]})")

    config_path = local_dir / "config.json"
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except json.JSONDecodeError as exc:
            problems.append(f"config.json is unreadable: {exc}")
        else:
            problems.extend(_config_vs_tensors(config, shapes))
    elif shapes:
        problems.append("config.json is missing")
    return header_checks, problems


def _config_vs_tensors(config: dict, shapes: dict[str, list[int]]) -> list[str]:
    """A few invariants every GLM-style checkpoint satisfies; silent when tensors are absent.
    (FP8 scale consistency is `glmctl quantize verify`'s job, not repeated here.)"""
    cfg = config.get("text_config") or config
    problems = []
    embed = next((s for k, s in shapes.items() if k.endswith("embed_tokens.weight")), None)
    if embed is not None:
        if "vocab_size" in cfg and embed[0] != cfg["vocab_size"]:
            problems.append(f"config vocab_size {cfg['vocab_size']} != embedding rows {embed[0]}")
        if "hidden_size" in cfg and embed[1] != cfg["hidden_size"]:
            problems.append(f"config hidden_size {cfg['hidden_size']} != embedding width {embed[1]}")
    layers = {int(k.split(".layers.")[1].split(".")[0]) for k in shapes if ".layers." in k}
    if layers and "num_hidden_layers" in cfg:
        n = cfg["num_hidden_layers"]
        extra = cfg.get("num_nextn_predict_layers", 0) or 0
        if not (n <= max(layers) + 1 <= n + extra) or min(layers) != 0:
            problems.append(f"config num_hidden_layers {n} (+{extra} MTP) but tensors cover layers {min(layers)}..{max(layers)}")
    return problems
