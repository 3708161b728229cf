"""Which licences a launch involves, which are accepted, and what a profile's usage forbids.

Rules, in order:
1. A `commercial` profile refuses any artifact whose licence forbids commercial use, whether the
   profile declares it or the artifact does (model card, records next to it); no acceptance, flag
   or environment variable changes that.
2. A licence that requires acceptance is accepted by `--accept-license ID`, by
   `GLMCTL_ACCEPT_LICENSES`, or by an earlier acceptance record (the user's, or one next to the
   artifact). Acceptances given by flag or environment are recorded in both places.
3. Otherwise the launch is refused (exit 2) with the flag to pass; the caller may ask on a terminal
   instead, never without one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from glmctl.errors import ConfigError
from glmctl.hub import licenses
from glmctl.hub.licenses import AcceptanceRecord, License
from glmctl.serving.schema import Profile


@dataclass
class Artifact:
    role: str  # "checkpoint" | "drafter"
    path: Path
    declared: list[str]  # catalogue ids the profile declares for it


@dataclass
class LicenseGate:
    in_play: list[License] = field(default_factory=list)
    accepted: dict[str, AcceptanceRecord] = field(default_factory=dict)
    missing: list[License] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    """Licences artifacts declare that glmctl cannot classify (reported, not refused)."""
    unused_acceptances: list[str] = field(default_factory=list)
    recorded: list[License] = field(default_factory=list)
    """Acceptances given now (flag, env, prompt) and recorded by this evaluation: their notice and
    obligations are for the operator to see."""

    @property
    def ok(self) -> bool:
        return not self.missing and not self.refusals


def artifacts(profile: Profile) -> list[Artifact]:
    found = []
    if profile.model.path is not None:
        found.append(Artifact("checkpoint", Path(profile.model.path), list(profile.model.licenses)))
    drafter = profile.speculative.drafter
    if drafter is not None:
        declared = list(drafter.licenses)
        if drafter.path is not None:
            found.append(Artifact("drafter", Path(drafter.path), declared))
        elif declared:  # not given yet: its licence still decides what the profile may do
            found.append(Artifact("drafter", Path("<drafter not given>"), declared))
    return found


def evaluate(
    profile: Profile,
    accept: list[str] = (),
    confirm: Callable[[License], bool] | None = None,
    record: bool = True,
) -> LicenseGate:
    """Decide the gate for `profile`; records acceptances given by flag, env or `confirm` unless
    `record` is False (a dry run decides the same and writes nothing)."""
    gate = LicenseGate()
    flagged = {licenses.get_license(a).id for a in accept}
    arts = artifacts(profile)
    dirs = [a.path for a in arts if a.path.is_dir()]
    holders: dict[str, list[Path]] = {}  # licence id -> the artifact directories it applies to

    for art in arts:
        ids = list(art.declared)
        if art.path.is_dir():
            for ident in licenses.artifact_license_ids(art.path):
                lic = licenses.lookup(ident)
                if lic is not None:
                    ids.append(lic.id)
                else:
                    allowed = licenses.commercial_use_allowed(ident)
                    if allowed is False and profile.usage == "commercial":
                        gate.refusals.append(
                            f"profile '{profile.name}' is for commercial use, but its {art.role} "
                            f"{art.path} declares licence '{ident}', which forbids commercial use"
                        )
                    elif allowed is None:
                        gate.unknown.append(f"{art.role} {art.path}: licence '{ident}'")
        for lic_id in dict.fromkeys(ids):
            lic = licenses.get_license(lic_id)
            if art.path.is_dir():
                holders.setdefault(lic.id, []).append(art.path)
            if lic not in gate.in_play:
                gate.in_play.append(lic)
            if profile.usage == "commercial" and not lic.commercial_use:
                gate.refusals.append(
                    f"profile '{profile.name}' is for commercial use, but its {art.role} is "
                    f"{lic.applies_to} ({lic.spdx or lic.name}), which forbids commercial use"
                )

    for lic in gate.in_play:
        if not lic.requires_acceptance:
            continue
        # never ask about a launch that is refused anyway
        via, earlier = licenses.acceptance(lic, accept, dirs, confirm=None if gate.refusals else confirm)
        if earlier is not None:
            gate.accepted[lic.id] = earlier
            continue
        if via is None:
            gate.missing.append(lic)
            continue
        if gate.refusals:
            continue  # never record an acceptance for a launch that is refused anyway
        if not record:
            gate.accepted[lic.id] = AcceptanceRecord(license=lic.id, license_name=lic.name,
                                                     text_sha256=lic.notice_sha256, via=via,
                                                     accepted_at=datetime.now(UTC))
            continue
        # Only next to the artifacts under this licence: a record next to an artifact reads as its
        # own declaration later (the drafter's licence must not become the checkpoint's).
        gate.accepted[lic.id] = licenses.record_acceptance(lic, via, list(dict.fromkeys(holders.get(lic.id, []))))
        gate.recorded.append(lic)
    gate.unused_acceptances = sorted(flagged - {lic.id for lic in gate.in_play})
    return gate


def refusal_message(profile: Profile, gate: LicenseGate) -> tuple[str, str]:
    """The operator-facing sentence and hint for a gate that is not ok."""
    if gate.refusals:
        return (
            "; ".join(gate.refusals),
            "use a profile with usage: noncommercial for non-commercial artifacts, or an artifact "
            "licensed for commercial use",
        )
    parts, flags = [], []
    for lic in gate.missing:
        short = lic.spdx or lic.name
        parts.append(f"profile '{profile.name}' uses {lic.applies_to} ({short})")
        flags.append(f"--accept-license {lic.id}")
    obligations = "; ".join(o for lic in gate.missing for o in lic.obligations)
    return (
        "; ".join(parts) + f"; pass {' '.join(flags)} to use it",
        f"by accepting you agree to: {obligations} (glmctl records the acceptance)",
    )


def check_accept_ids(accept: list[str]) -> None:
    for ident in accept:
        if licenses.lookup(ident) is None:
            raise ConfigError(
                f"--accept-license {ident}: no such licence id",
                hint="known ids: " + ", ".join(sorted(licenses.catalogue())),
            )
