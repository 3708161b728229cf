"""Is a checkpoint directory complete enough to hand to vLLM? (Present and readable, not hashed.)

Checks, cheap enough to run before every launch: the directory and `config.json` exist and parse;
every shard the safetensors index names is there (or, without an index, at least one shard); each
shard's header parses and covers the file exactly (safetensors' own reader: a truncated or
overwritten file fails here, not forty minutes into loading); a tokenizer is present for the
served checkpoint. Content hashes are `glmctl fetch --verify`'s job.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass
class ArtifactReport:
    role: str
    path: Path
    shards: int = 0
    tensors: int = 0
    bytes: int = 0
    missing: bool = False
    """The directory (or its config.json) is not there at all: a wrong path, not a broken file."""
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _shard_names(root: Path, report: ArtifactReport) -> list[str]:
    indexes = sorted(root.glob("*.safetensors.index.json"))
    if not indexes:
        names = sorted(p.name for p in root.glob("*.safetensors"))
        if not names:
            report.problems.append(f"{root} has no *.safetensors files")
        return names
    names: list[str] = []
    for index in indexes:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            report.problems.append(f"{index.name} is not a safetensors index ({exc})")
            continue
        names += sorted(set(weight_map.values()))
    return list(dict.fromkeys(names))


def _check_shard(path: Path, report: ArtifactReport) -> None:
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        report.problems.append(f"{path.name} is listed in the index but missing")
        return
    try:
        with safe_open(str(path), framework="numpy") as shard:
            report.tensors += len(list(shard.keys()))
    except (SafetensorError, OSError) as exc:
        report.problems.append(f"{path.name} is unreadable: {exc}")
        return
    report.shards += 1
    report.bytes += path.stat().st_size


def verify_checkpoint(path: Path, role: str = "checkpoint", need_tokenizer: bool = True) -> ArtifactReport:
    root = Path(path).expanduser()
    report = ArtifactReport(role=role, path=root)
    if not root.is_dir():
        report.missing = True
        report.problems.append(f"{role} directory {root} does not exist")
        return report
    config = root / "config.json"
    if not config.is_file():
        report.missing = True
        report.problems.append(f"{root} has no config.json: not a Hugging Face checkpoint directory")
        return report
    try:
        json.loads(config.read_text())
    except ValueError as exc:
        report.problems.append(f"{config} is not valid JSON ({exc})")
    for name in _shard_names(root, report):
        _check_shard(root / name, report)
    if need_tokenizer and not any((root / f).is_file() for f in TOKENIZER_FILES):
        report.problems.append(f"{root} has no tokenizer ({' / '.join(TOKENIZER_FILES)})")
    return report


def _config(path: Path) -> dict:
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _quantization(config: dict) -> dict:
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    return quant if isinstance(quant, dict) else {}


@dataclass(frozen=True)
class WeightsFormat:
    kind: str
    """"bf16", "fp8", "exl3", or the checkpoint's own quant_method when it is none of those."""
    tp_degrees: tuple[int, ...] | None = None
    """EXL3: the tensor-parallel degrees the converter checked its 128-element slices for."""


def weights_format(path: Path) -> WeightsFormat:
    """How a checkpoint stores its weights, from its `quantization_config` (glmctl's EXL3 format:
    quantize/exl3_format.py; block FP8: quant_method fp8; none: bf16)."""
    quant = _quantization(_config(path))
    method = str(quant.get("quant_method", "")).lower()
    if not method:
        return WeightsFormat("bf16")
    if method == "glmctl_exl3":
        degrees = (quant.get("experts") or {}).get("tp_degrees")
        return WeightsFormat("exl3", tuple(degrees) if isinstance(degrees, list) else None)
    return WeightsFormat(method)


def max_positions(path: Path) -> int | None:
    """The longest context a checkpoint's config allows (max_position_embeddings), if it says."""
    config = _config(path)
    for section in (config, config.get("text_config") or {}):
        value = section.get("max_position_embeddings") if isinstance(section, dict) else None
        if isinstance(value, int | float) and value > 0:
            return int(value)
    return None
