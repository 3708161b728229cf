"""The licence gate `glmctl fetch` runs before a restricted artifact is downloaded.

Licences, acceptance and its records are glmctl.hub.licenses' (shared with `glmctl serve`): an
artifact whose licence requires acceptance is fetched only after `--accept-license ID`, the
GLMCTL_ACCEPT_LICENSES variable, an earlier record, or the operator's answer (`feedback.confirm`);
the acceptance is then recorded for the user and next to the files (`<dir>/.glmctl/license-<id>.json`),
where serve profiles find it. Without anyone to ask the fetch stops with the flag to pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from glmctl.errors import LicenseError
from glmctl.feedback import QUIET, Feedback
from glmctl.hub import licenses


@dataclass
class LicenseDecision:
    """An accepted (or acceptance-free) licence, not yet recorded: `record` once the files exist."""

    license: licenses.License | None
    via: str | None  # "flag", "env" or "prompt"; None: an earlier record, or nothing to accept
    earlier: licenses.AcceptanceRecord | None = None

    def record(self, *, artifact: str, record_dir: Path, feedback: Feedback = QUIET) -> None:
        lic = self.license
        if lic is None or not lic.requires_acceptance:
            return
        licenses.record_acceptance(lic, self.via, [record_dir], artifact=artifact,
                                   earlier=self.earlier if self.via is None else None)
        feedback.note(f"licence {lic.id} accepted and recorded; obligations: {'; '.join(lic.obligations)}")


def decide_license(license_id: str | None, *, accept: list[str], artifact: str, record_dir: Path,
                   feedback: Feedback = QUIET) -> LicenseDecision:
    """Whether `artifact` may be fetched, asked before anything reaches the network: raises
    LicenseError (exit 2) with the flag to pass; may ask (`feedback.confirm`). Records nothing."""
    if license_id is None:
        return LicenseDecision(None, None)
    lic = licenses.lookup(license_id)
    if lic is None:
        feedback.warn(f"licence '{license_id}' of {artifact} is not in glmctl's catalogue: read it on the model card")
        return LicenseDecision(None, None)
    obligations = "; ".join(lic.obligations)
    if not lic.requires_acceptance:
        feedback.note(f"licence: {lic.name}; {obligations}")
        return LicenseDecision(lic, None)

    def ask(lic: licenses.License) -> bool:
        feedback.note(f"{artifact} is licensed under {lic.name}:\n{lic.notice.strip()}")
        if not feedback.confirm(lic):
            raise LicenseError(f"licence {lic.id} not accepted; nothing was downloaded",
                               hint=f"pass --accept-license {lic.id}")
        return True

    via, earlier = licenses.acceptance(lic, accept, [record_dir], confirm=ask if feedback.confirm else None)
    if via is None and earlier is None:
        raise LicenseError(
            f"{artifact} is licensed under {lic.name} ({obligations}); it must be accepted before download",
            hint=f"pass --accept-license {lic.id}",
        )
    if via is not None:
        feedback.note(f"{lic.name}:\n{lic.notice.strip()}\nobligations: {obligations}")
    return LicenseDecision(lic, via, earlier)


def require_license(license_id: str | None, *, accept: list[str], artifact: str, record_dir: Path,
                    feedback: Feedback = QUIET) -> None:
    """`decide_license`, then record the acceptance at once."""
    decide_license(license_id, accept=accept, artifact=artifact, record_dir=record_dir, feedback=feedback).record(
        artifact=artifact, record_dir=record_dir, feedback=feedback)
