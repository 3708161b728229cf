"""Which shipped serving profiles a probed node can run: the profile's hardware requirements
(preflight's own check) and the planner's KV fit for the GPUs found, for GLM-5.3-Flash as the
planner's preset describes it (doctor runs before any checkpoint is on the node)."""

from __future__ import annotations

from glmctl.probe.doctor_report import DoctorReport
from glmctl.probe.verdict import ProfileFit

PRESET = "glm-5.3-flash"


def fits_for_node(report: DoctorReport) -> list[ProfileFit]:
    from glmctl.errors import GlmctlError
    from glmctl.plan.model import load_model_spec
    from glmctl.serving import preflight, profile_fit, profiles

    # Free memory is judged at serve time; doctor judges the node (its GPUs read as all free).
    gpus = [g.model_copy(update={"free_bytes": None}) for g in report.gpus]
    preset = load_model_spec(PRESET)
    fits = []
    for summary in profiles.summaries():
        if summary.error is not None or summary.platform == "cpu":
            continue
        profile = profiles.load(summary.name)
        failures, _ = preflight.gpu_findings(profile, gpus)
        reasons = [f.message for f in failures]
        if not reasons:
            try:
                verdict = profile_fit.predict(profile, profile_fit.planned_model(profile, preset),
                                              profile_fit.profile_node(profile, gpus))
            except GlmctlError as exc:
                reasons.append(f"cannot plan: {exc.message}")
            else:
                if verdict.available and not verdict.fits:
                    reasons.append(verdict.note + (f" (closest: {verdict.closest})" if verdict.closest else ""))
        fits.append(ProfileFit(profile=summary.name, fits=not reasons, reasons=reasons))
    return fits
