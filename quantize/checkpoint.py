"""A Hugging Face safetensors checkpoint directory, opened and checked before any tensor is read.

    DIR/config.json                       model config (read; must parse)
    DIR/model.safetensors.index.json      {"metadata": {"total_size": N}, "weight_map": {name: shard}}
    DIR/<shard>.safetensors               every shard the index names
    (or DIR/model.safetensors alone, without an index)

`open_checkpoint` fails with one clear sentence for: no config, a config that is not JSON, an index
that names a missing shard (with how many tensors live there), a damaged shard header, and an index
that disagrees with the shard headers. Everything else in DIR (tokenizer, generation config, chat
template, code) is listed as `extra_files` for converters to copy.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from glmctl.quantize.safetensors_io import CheckpointError, ShardHeader, TensorEntry, read_header

from glmctl.errors import ConfigError, UsageError

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclass
class Checkpoint:
    path: Path
    config: dict
    index: dict | None  # None for a single-file checkpoint
    shards: list[ShardHeader]  # in index order (sorted file names)
    extra_files: list[Path] = field(default_factory=list)  # relative to path

    @property
    def shard_names(self) -> list[str]:
        return [s.path.name for s in self.shards]

    @property
    def total_bytes(self) -> int:
        return sum(s.path.stat().st_size for s in self.shards)

    def tensors(self) -> Iterator[tuple[ShardHeader, TensorEntry]]:
        for shard in self.shards:
            for entry in shard.tensors.values():
                yield shard, entry

    def tensor_index(self) -> dict[str, tuple[ShardHeader, TensorEntry]]:
        return {entry.name: (shard, entry) for shard, entry in self.tensors()}

    def text_config(self) -> dict:
        """The language model's config: `text_config` of a multimodal config, else the config."""
        inner = self.config.get("text_config")
        return inner if isinstance(inner, dict) else self.config

    def fingerprint(self) -> str:
        """Changes when the config, the index or any shard's size or mtime changes (no hashing)."""
        h = hashlib.sha256()
        h.update(json.dumps(self.config, sort_keys=True).encode())
        h.update(json.dumps(self.index, sort_keys=True).encode())
        for s in self.shards:
            st = s.path.stat()
            h.update(f"{s.path.name}:{st.st_size}:{st.st_mtime_ns}".encode())
        return h.hexdigest()


def read_json(path: Path, what: str) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ConfigError(f"{path.parent} has no {path.name}", hint=f"{what} must be a Hugging Face "
                          "checkpoint directory (config.json + *.safetensors)") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}", hint="restore the file from the "
                          "original checkpoint") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


def open_checkpoint(path: Path, what: str = "SRC") -> Checkpoint:
    path = Path(path)
    if not path.is_dir():
        raise UsageError(f"{what} {path} is not a directory",
                         hint="pass the checkpoint directory (the one holding config.json)")
    config = read_json(path / CONFIG, what)
    index_path = path / INDEX
    if index_path.exists():
        index = read_json(index_path, what)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConfigError(f"{index_path} has no weight_map", hint="restore it from the original checkpoint")
        by_shard: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            by_shard.setdefault(str(shard), []).append(name)
        missing = sorted(s for s in by_shard if not (path / s).is_file())
        if missing:
            first = missing[0]
            raise CheckpointError(
                f"{len(missing)} shard(s) named in {INDEX} are missing from {path}: "
                f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} "
                f"({len(by_shard[first])} tensors live in {first}, e.g. {sorted(by_shard[first])[0]})",
                hint="finish the download (glmctl fetch resumes it) or copy the missing shards",
            )
        shards = [read_header(path / s) for s in sorted(by_shard)]
        _check_index_matches(path, by_shard, shards)
    elif (path / SINGLE).is_file():
        index = None
        shards = [read_header(path / SINGLE)]
    else:
        raise CheckpointError(f"{path} has neither {INDEX} nor {SINGLE}",
                              hint=f"{what} must hold safetensors weights")
    skip = {CONFIG, INDEX, *(s.path.name for s in shards)}
    extra = sorted(p.relative_to(path) for p in path.rglob("*")
                   if p.is_file() and p.name not in skip and not _hidden(p.relative_to(path)))
    return Checkpoint(path, config, index, shards, extra)


def _hidden(rel: Path) -> bool:
    # .cache/huggingface (download state), editor files and our own partial/job files stay behind.
    return any(part.startswith(".") for part in rel.parts)


def _check_index_matches(path: Path, by_shard: dict[str, list[str]], shards: list[ShardHeader]) -> None:
    for shard in shards:
        listed = set(by_shard[shard.path.name])
        present = set(shard.tensors)
        if listed - present:
            gone = sorted(listed - present)
            raise CheckpointError(
                f"{INDEX} places {len(gone)} tensor(s) in {shard.path.name} that its header does not "
                f"hold, e.g. {gone[0]}", hint=f"the index and the shards of {path} come from different "
                "downloads; fetch the checkpoint again")
        if present - listed:
            extra = sorted(present - listed)
            raise CheckpointError(
                f"{shard.path.name} holds {len(extra)} tensor(s) that {INDEX} does not list, "
                f"e.g. {extra[0]}", hint=f"the index and the shards of {path} come from different "
                "downloads; fetch the checkpoint again")
