"""`glmctl profile validate`: a profile checked as far as it can be without starting anything.

Schema and `extends` (always), the licence policy of its declared artifacts (a commercial profile
with a non-commercial artifact is invalid), the rendered config against vLLM 0.30's `vllm serve`
options (shipped as data, so this holds where vLLM is not installed), and, when vLLM is
importable, vLLM's own parser on the rendered config. Paths the profile leaves to serve time
(`--model`, `--drafter`) are filled with placeholders for the parser, which does not open them.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

from glmctl.errors import ConfigError
from glmctl.serving import launch_files, launch_licenses, profiles
from glmctl.serving.schema import Profile

PLACEHOLDER_MODEL = Path("/placeholder/checkpoint")
PLACEHOLDER_DRAFTER = Path("/placeholder/drafter")


@dataclass
class ValidationReport:
    profile: str
    source: str
    valid: bool
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    checked_by: list[str] = field(default_factory=list)
    """What checked it: "schema", "licence policy", "vLLM 0.30.0 parser"."""
    needs_acceptance: list[str] = field(default_factory=list)
    """Licence ids serve will ask for (--accept-license)."""


def with_placeholders(prof: Profile) -> Profile:
    model = None if prof.model.path is not None else PLACEHOLDER_MODEL
    drafter = None
    if prof.speculative.drafter is not None and prof.speculative.drafter.path is None:
        drafter = PLACEHOLDER_DRAFTER
    return launch_files.with_paths(prof, model=model, drafter=drafter)


def validate(name_or_path: str, use_vllm: bool | None = None) -> ValidationReport:
    """Validate a profile by name or file; `use_vllm=None` uses vLLM's parser when importable."""
    try:
        prof = profiles.load(name_or_path)
    except ConfigError as exc:
        return ValidationReport(str(name_or_path), str(name_or_path), False, errors=[exc.message],
                                checked_by=["schema"])
    source = next((str(s.path) for s in profiles.sources() if s.name == prof.name), str(name_or_path))
    report = ValidationReport(prof.name, source, True, checked_by=["schema"])
    report.warnings += prof.advisories()

    gate = launch_licenses.evaluate(prof)
    report.checked_by.append("licence policy")
    report.errors += gate.refusals
    report.needs_acceptance = [lic.id for lic in gate.missing]

    from glmctl.serving import vllm_args

    launch = launch_files.render(with_placeholders(prof))
    table = vllm_args.shipped_flags()
    report.checked_by.append(f"vLLM {table.vllm_version} flag list")
    report.errors += [f"vllm_args: {p}" for p in table.problems(launch.config)]
    if use_vllm is None:
        use_vllm = importlib.util.find_spec("vllm") is not None
    if use_vllm:
        check = vllm_args.check(launch.config_yaml(), launch.env)
        if check.error is not None:
            report.errors.append(check.error)
        else:
            report.checked_by.append(f"vLLM {check.vllm_version} parser")
            report.errors += [f"vLLM rejects the rendered config: {p}" for p in check.problems]
    else:
        report.warnings.append("vLLM is not importable here: vLLM's parser did not check vllm_args")
    report.valid = not report.errors
    return report
