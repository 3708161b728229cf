"""The licence gate `glmctl fetch` runs before a restricted artifact is downloaded.

Licences and acceptance records are glmctl.hub.licenses' (shared with `glmctl serve`): an artifact
whose licence requires acceptance is fetched only after `--accept-license ID`, the
GLMCTL_ACCEPT_LICENSES variable, or an earlier record; the acceptance is then recorded for the user
and next to the files (`<dir>/.glmctl/license-<id>.json`), where serve profiles find it. A terminal
may be asked; without one the fetch stops with the flag to pass.
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
    if lic is None:
        out.warn(f"licence '{license_id}' of {artifact} is not in glmctl's catalogue: read it on the model card")
        return
    obligations = "; ".join(lic.obligations)
    if not lic.requires_acceptance:
        out.note(f"licence: {lic.name}; {obligations}")
        return
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
    for store in (licenses.user_store(), licenses.artifact_store(record_dir)):
        if via is not None or store.accepted(lic) is None:  # copy an earlier acceptance as it was given
            store.accept(lic, via or earlier.via, artifact=artifact)
    out.note(f"licence {lic.id} accepted and recorded; obligations: {obligations}")
