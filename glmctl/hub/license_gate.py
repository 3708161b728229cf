"""The licence gate that runs before a restricted artifact is downloaded.

An artifact whose licence restricts use (non-commercial, attribution obligations) is fetched only
after the operator accepts that licence by id (`--accept-license ID`), or has accepted it before.
Acceptance is recorded next to the files (`<dir>/.glmctl/license-<id>.json`) and in glmctl's home,
so serve profiles can check it. Never prompts when stdin is not a terminal.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from pydantic import BaseModel

from glmctl import paths
from glmctl._cli.output import Output
from glmctl.errors import LicenseError
from glmctl.hub.manifest import MANIFEST_DIR, now


class LicenseTerms(BaseModel):
    id: str
    name: str
    url: str | None
    restricted: bool            # must be accepted explicitly before download/serve
    commercial_use: bool
    obligations: list[str]


LICENSES: dict[str, LicenseTerms] = {
    t.id: t
    for t in [
        LicenseTerms(
            id="dflash2-cc-by-nc-nd-4.0", name="CC BY-NC-ND 4.0 (DFlash2 drafter)",
            url="https://creativecommons.org/licenses/by-nc-nd/4.0/legalcode", restricted=True,
            commercial_use=False,
            obligations=["non-commercial use only", "give credit to the licensor",
                         "no derivatives may be distributed"],
        ),
        LicenseTerms(
            id="shapleymcg-1.0", name="ShapleyMcg License 1.0 (EXL3 4-bit experts)", url=None,
            restricted=True, commercial_use=True,
            obligations=["credit ShapleyMcg (Brandon M. Music)", "keep the licence notice with the weights"],
        ),
        LicenseTerms(
            id="glm-5.3-flash-model-license", name="GLM-5.3-Flash model licence (see the model card)",
            url="https://huggingface.co/zai-org/GLM-5.3-Flash", restricted=False, commercial_use=True,
            obligations=["read the model card's licence before deploying"],
        ),
    ]
}


class Acceptance(BaseModel):
    license: str
    text_sha256: str
    accepted_at: str
    artifact: str


def terms(license_id: str) -> LicenseTerms | None:
    return LICENSES.get(license_id)


def _text_hash(t: LicenseTerms) -> str:
    return hashlib.sha256(t.model_dump_json().encode()).hexdigest()


def accepted(license_id: str) -> bool:
    t = terms(license_id)
    record = paths.licenses() / f"{license_id}.json"
    if t is None or not record.is_file():
        return False
    try:
        return Acceptance.model_validate_json(record.read_text()).text_sha256 == _text_hash(t)
    except ValueError:
        return False


def require_license(license_id: str | None, *, accept: list[str], artifact: str, record_dir: Path,
                    out: Output) -> None:
    if license_id is None:
        return
    t = terms(license_id)
    if t is None or not t.restricted:
        if t is not None:
            out.note(f"licence: {t.name}; " + "; ".join(t.obligations))
        return
    if license_id not in accept and not accepted(license_id):
        obligations = "; ".join(t.obligations)
        if sys.stdin.isatty() and out.human:
            out.note(f"{artifact} is licensed under {t.name}: {obligations}. {t.url or ''}")
            answer = input(f"Type the licence id ({license_id}) to accept it: ").strip()
            if answer != license_id:
                raise LicenseError(f"licence {license_id} not accepted; nothing was downloaded")
        else:
            raise LicenseError(
                f"{artifact} is licensed under {t.name} ({obligations}); it must be accepted before download",
                hint=f"pass --accept-license {license_id}",
            )
    record = Acceptance(license=license_id, text_sha256=_text_hash(t), accepted_at=now(), artifact=artifact)
    for path in (paths.licenses() / f"{license_id}.json", record_dir / MANIFEST_DIR / f"license-{license_id}.json"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record.model_dump(), indent=2))
    out.note(f"licence {license_id} accepted and recorded; obligations: {'; '.join(t.obligations)}")
