"""The licence gate `glmctl fetch` runs before a restricted artifact is downloaded.

Licences and acceptance records are glmctl.hub.licenses' (shared with `glmctl serve`): an artifact
whose licence requires acceptance is fetched only after `--accept-license ID`, the
GLMCTL_ACCEPT_LICENSES variable, or an earlier record; the acceptance is then recorded for the user
and next to the files (`<dir>/.glmctl/license-<id>.json`), where serve profiles find it. A terminal
may be asked; without one the fetch stops with the flag to pass.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from glmctl._cli.output import Output
from glmctl.errors import LicenseError
from glmctl.hub import licenses


@dataclass
class LicenseDecision:
    """An accepted (or acceptance-free) licence, not yet recorded: `record` once the files exist."""

    license: licenses.License | None
    via: str | None  # "flag", "env" or "prompt"; None: an earlier record, or nothing to accept
    earlier: licenses.AcceptanceRecord | None = None

    def record(self, *, artifact: str, record_dir: Path, out: Output) -> None:
        lic = self.license
        if lic is None or not lic.requires_acceptance:
            return
        for store in (licenses.user_store(), licenses.artifact_store(record_dir)):
            if self.via is not None or store.accepted(lic) is None:  # copy an earlier acceptance as given
                store.accept(lic, self.via or self.earlier.via, artifact=artifact)
        out.note(f"licence {lic.id} accepted and recorded; obligations: {'; '.join(lic.obligations)}")


def decide_license(license_id: str | None, *, accept: list[str], artifact: str, record_dir: Path,
                   out: Output) -> LicenseDecision:
    """Whether `artifact` may be fetched, asked before anything reaches the network: raises
    LicenseError (exit 2) with the flag to pass; may ask on a terminal. Records nothing."""
    if license_id is None:
        return LicenseDecision(None, None)
    lic = licenses.lookup(license_id)
    if lic is None:
        out.warn(f"licence '{license_id}' of {artifact} is not in glmctl's catalogue: read it on the model card")
        return LicenseDecision(None, None)
    obligations = "; ".join(lic.obligations)
    if not lic.requires_acceptance:
        out.note(f"licence: {lic.name}; {obligations}")
        return LicenseDecision(lic, None)
    flagged = {licenses.get_license(a).id for a in accept}
    via = "flag" if lic.id in flagged else "env" if lic.id in licenses.accepted_from_env() else None
    earlier = licenses.find_acceptance(lic, [record_dir]) if via is None else None
    if via is None and earlier is None:
        if not (sys.stdin.isatty() and out.human):
            raise LicenseError(
                f"{artifact} is licensed under {lic.name} ({obligations}); it must be accepted before download",
                hint=f"pass --accept-license {lic.id}",
            )
        out.note(f"{artifact} is licensed under {lic.name}:\n{lic.notice.strip()}")
        if input(f"Type the licence id ({lic.id}) to accept it: ").strip() != lic.id:
            raise LicenseError(f"licence {lic.id} not accepted; nothing was downloaded",
                               hint=f"pass --accept-license {lic.id}")
        via = "prompt"
    if via is not None:
        out.note(f"{lic.name}:\n{lic.notice.strip()}\nobligations: {obligations}")
    return LicenseDecision(lic, via, earlier)


def require_license(license_id: str | None, *, accept: list[str], artifact: str, record_dir: Path,
                    out: Output) -> None:
    """`decide_license`, then record the acceptance at once."""
    decide_license(license_id, accept=accept, artifact=artifact, record_dir=record_dir, out=out).record(
        artifact=artifact, record_dir=record_dir, out=out)
