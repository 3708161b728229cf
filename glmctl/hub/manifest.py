"""What a downloaded artifact should contain, and how to hash it the way the Hub does.

The manifest is written next to the files at download time (`<dir>/.glmctl/manifest.json`) from
the Hub's own tree listing, so `glmctl fetch --verify DIR` can check sizes and hashes offline:

- LFS files (weights): the Hub records their SHA-256 (`lfs.oid`);
- plain git files (configs, tokenizer): the Hub records the git blob id, SHA-1 of
  `b"blob <size>\\0" + content`.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, ConfigDict

MANIFEST_DIR = ".glmctl"
MANIFEST_NAME = "manifest.json"
CHUNK = 8 << 20


class ExpectedFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str
    size: int
    sha256: str | None = None   # LFS files
    git_oid: str | None = None  # plain git blobs


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    repo_id: str
    revision: str                # the commit the files came from
    artifact: str
    license: str | None = None
    created: str
    files: list[ExpectedFile]


def manifest_path(local_dir: Path) -> Path:
    return local_dir / MANIFEST_DIR / MANIFEST_NAME


def write_manifest(local_dir: Path, manifest: Manifest) -> Path:
    """Atomically (write + rename) record what the directory should hold."""
    path = manifest_path(local_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".manifest-", suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; the manifest is as readable as the files
    with os.fdopen(fd, "w") as fh:
        fh.write(manifest.model_dump_json(indent=2))
    os.replace(tmp, path)
    return path


def read_manifest(local_dir: Path) -> Manifest | None:
    path = manifest_path(local_dir)
    if not path.is_file():
        return None
    return Manifest.model_validate(json.loads(path.read_text()))


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def hash_file(path: Path, expected: ExpectedFile, on_bytes=None) -> str:
    """Hash `path` the way the Hub recorded `expected` (sha256 for LFS, git blob sha1 otherwise)."""
    if expected.sha256 is not None:
        digest = hashlib.sha256()
    else:
        digest = hashlib.sha1()  # noqa: S324 - git's object id, not a security primitive
        digest.update(f"blob {path.stat().st_size}\0".encode())
    with path.open("rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
            if on_bytes is not None:
                on_bytes(len(chunk))
    return digest.hexdigest()
