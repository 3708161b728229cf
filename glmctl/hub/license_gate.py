"""The licence gate that runs before a restricted artifact is downloaded.

An artifact whose licence requires acceptance (`glmctl.hub.licenses`: non-commercial terms,
attribution obligations) is fetched only after the operator accepts that licence by id
(`--accept-license ID` or `GLMCTL_ACCEPT_LICENSES`), or has accepted it before. Acceptance is
recorded next to the files (`<dir>/.glmctl/license-<id>.json`) and in glmctl's home, in the format
`glmctl serve` checks. Never prompts when stdin is not a terminal.
"""

from __future__ import annotations

import sys
from pathlib import Path

from glmctl._cli.output import Output
from glmctl.errors import LicenseError
from glmctl.hub import licenses


def require_license(license_id: str | None, *, accept: list[str], artifact: str, record_dir: Path,
                    out: Output) -> None:
    if license_id is None:
        return
    lic = licenses.lookup(license_id)
    if lic is None or not lic.requires_acceptance:
        if lic is not None:
            out.note(f"licence: {lic.name}; " + "; ".join(lic.obligations))
        return
    obligations = "; ".join(lic.obligations)
    flagged = {licenses.get_license(a).id for a in accept}
    via = "flag" if lic.id in flagged else "env" if lic.id in licenses.accepted_from_env() else None
    earlier = licenses.find_acceptance(lic, [record_dir]) if via is None else None
    if via is None and earlier is None:
        if sys.stdin.isatty() and out.human:
            out.note(f"{artifact} is licensed under {lic.name}: {obligations}. {lic.url or ''}")
            out.note(lic.notice.strip())
            answer = input(f"Type the licence id ({lic.id}) to accept it: ").strip()
            if answer != lic.id:
                raise LicenseError(f"licence {lic.id} not accepted; nothing was downloaded")
            via = "prompt"
        else:
            raise LicenseError(
                f"{artifact} is licensed under {lic.name} ({obligations}); it must be accepted before download",
                hint=f"pass --accept-license {lic.id}",
            )
    here = licenses.artifact_store(record_dir)
    if earlier is not None:  # accepted before: the new download carries that record too
        if here.accepted(lic) is None:
            here.accept(lic, earlier.via, artifact=artifact)
        return
    licenses.user_store().accept(lic, via)
    here.accept(lic, via, artifact=artifact)
    out.note(f"licence {lic.id} accepted and recorded; obligations: {obligations}")
