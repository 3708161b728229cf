"""Which shipped serving profiles a probed node can run: the profile's hardware requirements
(preflight's own check) and the planner's KV fit for the GPUs found, for GLM-5.3-Flash as the
planner's preset describes it (doctor runs before any checkpoint is on the node)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from glmctl.probe.report import DoctorReport
from glmctl.probe.verdict import ProfileFit

PRESET = "glm-5.3-flash"
GIB = 1024**3


def fits_for_node(report: DoctorReport) -> list[ProfileFit]:
    from glmctl.errors import GlmctlError
    from glmctl.serving import capacity, preflight, profiles
    from glmctl.serving import render as rendering
    from glmctl.serving.gpus import Gpu

    # Free memory is judged at serve time; doctor judges the node, so free = total here.
    gpus = [Gpu(g.index, g.name, tuple(g.compute_capability), g.memory_bytes / GIB, g.memory_bytes / GIB)
            for g in report.gpus]
    fits = []
    for summary in profiles.summaries():
        if summary.error is not None or summary.platform == "cpu":
            continue
        profile = profiles.load(summary.name)
        failures, _ = preflight.gpu_findings(profile, gpus)
        reasons = [f.message for f in failures]
        if not reasons:
            try:
                launch = rendering.render(rendering.with_paths(profile, model=Path(PRESET)))
                launch = dataclasses.replace(launch, config={**launch.config, "model": PRESET})
                verdict = capacity.predict(launch, gpus)
            except GlmctlError as exc:
                reasons.append(f"cannot plan: {exc.message}")
            else:
                if verdict.available and not verdict.fits:
                    reasons.append(verdict.note + (f" (closest: {verdict.closest})" if verdict.closest else ""))
        fits.append(ProfileFit(profile=summary.name, fits=not reasons, reasons=reasons))
    return fits
