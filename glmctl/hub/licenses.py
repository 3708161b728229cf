"""Licences of the artifacts glmctl serves, and the operator's recorded acceptance of them.

The catalogue (`licenses.yaml`, package data) names each licence glmctl knows: id, name, whether it
allows commercial use, whether it must be accepted before use, the obligations, and the notice
shown to the operator. An acceptance is a small JSON record (licence id, SHA-256 of the notice that
was shown, UTC time, how it was given) kept in a `LicenseStore`: one per user
(`glmctl.paths.licenses()/<id>.json`), and one next to each artifact
(`<artifact>/.glmctl/license-<id>.json`, where `glmctl fetch` also keeps its manifest) so a
checkpoint directory carries the record of the terms it was obtained under. A record only counts
while its hash matches the current notice.

Nothing here prompts: callers decide whether a terminal is there to ask (and never ask without one).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from hashlib import sha256
from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from glmctl import paths, switches
from glmctl.errors import ConfigError

ARTIFACT_DIR = ".glmctl"  # the per-artifact metadata folder (shared with glmctl fetch's manifest)

# Licence identifiers as Hugging Face model cards and SPDX spell them that are known to allow
# commercial use. Anything not known is reported as unknown, never assumed permissive.
_PERMISSIVE = {
    "mit", "apache-2.0", "bsd-2-clause", "bsd-3-clause", "cc0-1.0", "cc-by-4.0", "cc-by-sa-4.0",
    "unlicense", "isc", "zlib",
}
_NONCOMMERCIAL = re.compile(r"^cc-by-nc(-|$)")


class License(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    name: str
    applies_to: str
    spdx: str | None = None
    url: str | None = None
    commercial_use: bool
    requires_acceptance: bool
    aliases: tuple[str, ...] = ()
    obligations: tuple[str, ...] = ()
    notice: str

    @property
    def notice_sha256(self) -> str:
        return sha256(self.notice.encode()).hexdigest()

    def names(self) -> set[str]:
        """Every spelling that refers to this licence (lower case)."""
        found = {self.id.lower(), *(a.lower() for a in self.aliases)}
        if self.spdx:
            found.add(self.spdx.lower())
        return found


class AcceptanceRecord(BaseModel):
    model_config = ConfigDict(extra="ignore")

    license: str
    """The licence id."""
    license_name: str = ""
    text_sha256: str
    """SHA-256 of the notice that was shown when it was accepted (`License.notice_sha256`)."""
    accepted_at: datetime
    via: Literal["flag", "env", "prompt"] = "flag"
    artifact: str | None = None
    glmctl_version: str = ""


@functools.cache
def catalogue() -> dict[str, License]:
    raw = (resources.files("glmctl.hub") / "licenses.yaml").read_text()
    import yaml

    data = yaml.safe_load(raw) or {}
    return {key: License(id=key, **entry) for key, entry in data.items()}


def lookup(name: str) -> License | None:
    """The catalogue entry an id, alias or SPDX id refers to, or None."""
    wanted = name.strip().lower()
    for lic in catalogue().values():
        if wanted in lic.names():
            return lic
    return None


def get_license(name: str) -> License:
    lic = lookup(name)
    if lic is None:
        known = ", ".join(sorted(catalogue()))
        raise ConfigError(f"unknown licence id '{name}'", hint=f"known licence ids: {known}")
    return lic


def commercial_use_allowed(identifier: str) -> bool | None:
    """Whether a licence (catalogue id, HF model-card id or SPDX id) allows commercial use.

    None means glmctl does not know: the caller must not treat that as permission.
    """
    if (lic := lookup(identifier)) is not None:
        return lic.commercial_use
    ident = identifier.strip().lower()
    if _NONCOMMERCIAL.match(ident):
        return False
    if ident in _PERMISSIVE:
        return True
    return None


class LicenseStore:
    """Acceptance records in one directory, one `<prefix><licence id>.json` each, written atomically."""

    def __init__(self, root: Path, prefix: str = "") -> None:
        self.root = Path(root)
        self.prefix = prefix

    def _path(self, license_id: str) -> Path:
        return self.root / f"{self.prefix}{license_id}.json"

    def record(self, license_id: str) -> AcceptanceRecord | None:
        path = self._path(license_id)
        try:
            return AcceptanceRecord.model_validate_json(path.read_text())
        except (OSError, ValidationError, ValueError):
            return None  # absent or unreadable: not accepted (a broken record never counts)

    def accepted(self, lic: License) -> AcceptanceRecord | None:
        """The record of `lic` if it accepts the notice as it reads today."""
        rec = self.record(lic.id)
        return rec if rec is not None and rec.text_sha256 == lic.notice_sha256 else None

    def accept(
        self, lic: License, via: str, artifact: Path | str | None = None
    ) -> AcceptanceRecord:
        from glmctl import __version__

        rec = AcceptanceRecord(
            license=lic.id,
            license_name=lic.name,
            text_sha256=lic.notice_sha256,
            accepted_at=datetime.now(UTC),
            via=via,  # type: ignore[arg-type]
            artifact=str(artifact) if artifact is not None else None,
            glmctl_version=__version__,
        )
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self._path(lic.id).with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(rec.model_dump_json(indent=2) + "\n")
        tmp.replace(self._path(lic.id))
        return rec

    def revoke(self, license_id: str) -> bool:
        try:
            self._path(license_id).unlink()
        except FileNotFoundError:
            return False
        return True

    def records(self) -> list[AcceptanceRecord]:
        if not self.root.is_dir():
            return []
        stems = (p.stem.removeprefix(self.prefix) for p in sorted(self.root.glob(f"{self.prefix}*.json")))
        return [r for r in map(self.record, stems) if r is not None and r.license]


def user_store() -> LicenseStore:
    return LicenseStore(paths.licenses())


def artifact_store(artifact_dir: Path) -> LicenseStore:
    return LicenseStore(Path(artifact_dir) / ARTIFACT_DIR, prefix="license-")


def accepted_from_env() -> set[str]:
    """Licence ids accepted through GLMCTL_ACCEPT_LICENSES (resolved to catalogue ids)."""
    ids = set()
    for item in switches.read("GLMCTL_ACCEPT_LICENSES"):
        ids.add(get_license(item).id)
    return ids


def find_acceptance(lic: License, artifact_dirs: list[Path] = ()) -> AcceptanceRecord | None:
    """A current acceptance of `lic` in the user's store or next to any of the artifacts."""
    for store in [user_store(), *(artifact_store(d) for d in artifact_dirs)]:
        if (rec := store.accepted(lic)) is not None:
            return rec
    return None


def acceptance(lic: License, accept: Iterable[str], artifact_dirs: list[Path] = (),
               confirm: Callable[[License], bool] | None = None) -> tuple[str | None, AcceptanceRecord | None]:
    """How `lic` is accepted, in the one order `glmctl fetch` and `glmctl serve` both use: by
    `--accept-license` (`accept`), by GLMCTL_ACCEPT_LICENSES, by an earlier record (the user's, or
    one next to an artifact), then by `confirm` (the operator asked; None: nobody can be).
    (via, None) for an acceptance given now ("flag", "env", "prompt"), (None, record) for an
    earlier one, (None, None) when `lic` is not accepted. Records nothing."""
    if lic.id in {get_license(a).id for a in accept}:
        return "flag", None
    if lic.id in accepted_from_env():
        return "env", None
    if (earlier := find_acceptance(lic, artifact_dirs)) is not None:
        return None, earlier
    if confirm is not None and confirm(lic):
        return "prompt", None
    return None, None


def record_acceptance(lic: License, via: str | None, artifact_dirs: list[Path] = (), artifact: str | None = None,
                      earlier: AcceptanceRecord | None = None) -> AcceptanceRecord:
    """Record an acceptance of `lic` for the user and next to each artifact (`artifact`: the name
    the records give it; default: the user's record names none, each artifact's its directory).
    With `earlier` (an acceptance found, none given now) it is copied only where it is missing.
    Returns the user's record."""
    stores = [(user_store(), artifact), *((artifact_store(d), artifact if artifact is not None else d)
                                          for d in artifact_dirs)]
    first = None
    for store, name in stores:
        rec = store.accepted(lic) if earlier is not None else None
        if rec is None:
            rec = store.accept(lic, via or earlier.via, artifact=name)
        first = first or rec
    return first


def artifact_license_ids(artifact_dir: Path) -> list[str]:
    """The licences an artifact declares about itself, as written (lower case, de-duplicated).

    Read from the model card's front matter (`license`, `license_name`; Hugging Face convention),
    from `glmctl fetch`'s manifest, and from acceptance records stored next to the artifact.
    """
    found: list[str] = []
    card = Path(artifact_dir) / "README.md"
    if card.is_file():
        meta = _front_matter(card.read_text(errors="replace"))
        for key in ("license", "license_name"):
            value = meta.get(key)
            values = value if isinstance(value, list) else [value]
            found += [str(v).strip().lower() for v in values if v and str(v).lower() != "other"]
    from glmctl.hub.manifest import read_manifest

    try:
        manifest = read_manifest(Path(artifact_dir))
    except (OSError, ValueError):
        manifest = None
    if manifest is not None and manifest.license:
        found.append(manifest.license.lower())
    found += [rec.license.lower() for rec in artifact_store(artifact_dir).records()]
    return list(dict.fromkeys(found))


def _front_matter(text: str) -> dict:
    if not text.startswith("---"):
        return {}
    end = text.find("\n---", 3)
    if end < 0:
        return {}
    import yaml

    try:
        meta = yaml.safe_load(text[3:end])
    except yaml.YAMLError:
        return {}
    return meta if isinstance(meta, dict) else {}


def describe(lic: License) -> dict:
    """Plain data for output: what the licence is and what it obliges."""
    return {
        "id": lic.id,
        "name": lic.name,
        "applies_to": lic.applies_to,
        "url": lic.url,
        "commercial_use": lic.commercial_use,
        "requires_acceptance": lic.requires_acceptance,
        "obligations": list(lic.obligations),
        "notice": lic.notice.strip(),
    }
