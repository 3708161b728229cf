"""Everything `glmctl serve` checks before it starts vLLM, each failure with its fix.

Order (cheap and decisive first): licences (refusal raises at once: nothing else matters if the
launch is not allowed), then artifacts and the port; only if those pass, the checks that cost
seconds: vLLM and the plugin importable and vLLM's parser accepting the config (one child
process), the GPUs against the profile's requirements, and the planner's capacity prediction.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

from glmctl.errors import GlmctlError, LicenseError
from glmctl.hub.licenses import License
from glmctl.serving import launch_licenses, profile_fit
from glmctl.serving.artifacts import (
    ArtifactReport,
    max_positions,
    verify_checkpoint,
    weights_format,
)
from glmctl.serving.launch_files import RenderedLaunch
from glmctl.serving.profile_fit import CapacityVerdict
from glmctl.serving.vllm_args import VllmCheck


@dataclass
class Finding:
    check: str
    message: str
    hint: str | None = None
    usage: bool = False
    """A failure fixed in the command or the profile (exit 2), not on the node (exit 1)."""


@dataclass
class PreflightReport:
    profile: str
    failures: list[Finding] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    passed: list[str] = field(default_factory=list)
    gate: launch_licenses.LicenseGate | None = None
    artifacts: list[ArtifactReport] = field(default_factory=list)
    vllm: VllmCheck | None = None
    gpus: list | None = None
    capacity: CapacityVerdict | None = None

    @property
    def ok(self) -> bool:
        return not self.failures


class PreflightError(GlmctlError):
    """One or more preflight checks failed; the message lists each with its fix."""

    def __init__(self, report: PreflightReport) -> None:
        lines = []
        for f in report.failures:
            lines.append(f"  - {f.check}: {f.message}" + (f"\n      fix: {f.hint}" if f.hint else ""))
        super().__init__(f"profile '{report.profile}' cannot start:\n" + "\n".join(lines))
        self.report = report
        self.exit_code = 2 if any(f.usage for f in report.failures) else 1


def port_problem(host: str, port: int) -> str | None:
    """Why vLLM could not listen on host:port, or None. Binds the way uvicorn does (SO_REUSEADDR)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"cannot resolve host '{host}': {exc}"
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"port {port} on {host} is already in use"
            return f"cannot listen on {host}:{port}: {exc.strerror}"
    return None


def _licences(launch: RenderedLaunch, accept: list[str], confirm, report: PreflightReport,
              record: bool = True) -> None:
    gate = launch_licenses.evaluate(launch.profile, accept=accept, confirm=confirm, record=record)
    report.gate = gate
    if not gate.ok:
        message, hint = launch_licenses.refusal_message(launch.profile, gate)
        raise LicenseError(message, hint=hint)
    report.warnings += [f"unknown licence ({u}): read it before deploying" for u in gate.unknown]
    report.warnings += [f"--accept-license {i}: not used by profile '{launch.profile.name}'"
                        for i in gate.unused_acceptances]
    if gate.in_play:
        report.passed.append("licences: " + ", ".join(lic.id for lic in gate.in_play))


def _artifacts(launch: RenderedLaunch, report: PreflightReport) -> None:
    for art in launch_licenses.artifacts(launch.profile):
        if not str(art.path).startswith("/"):
            continue  # a placeholder for a drafter not given (render refuses that earlier)
        rep = verify_checkpoint(art.path, role=art.role, need_tokenizer=art.role == "checkpoint")
        report.artifacts.append(rep)
        if rep.ok:
            report.passed.append(f"{art.role}: {rep.shards} shards, {rep.tensors} tensors, "
                                 f"{rep.bytes / 2**30:.2f} GiB in {art.path}")
            if art.role == "checkpoint":
                _checkpoint_fits_profile(launch, art.path, report)
            continue
        flag = "--model" if art.role == "checkpoint" else "--drafter"
        hint = (f"check the path given to {flag}; `glmctl fetch` downloads checkpoints"
                if rep.missing else f"repair it: glmctl fetch --verify {art.path} --repair")
        report.failures.append(Finding(art.role, "; ".join(rep.problems), hint, usage=rep.missing))


def _checkpoint_fits_profile(launch: RenderedLaunch, path, report: PreflightReport) -> None:
    """The checkpoint is the one the profile was planned for: weight format, TP slices, context."""
    prof = launch.profile
    fmt = weights_format(path)
    if fmt.kind != prof.model.weights:
        report.failures.append(Finding(
            "weights", f"profile '{prof.name}' is planned for {prof.model.weights} weights, but {path} holds "
            f"{fmt.kind} weights", "pass the checkpoint this profile is for with --model, or pick the profile "
            "made for this one (glmctl profile ls)", usage=True))
    elif fmt.tp_degrees is not None and prof.tensor_parallel_size not in fmt.tp_degrees:
        report.failures.append(Finding(
            "weights", f"{path} was converted for tensor-parallel sizes {list(fmt.tp_degrees)}, not "
            f"{prof.tensor_parallel_size}", "convert it again for this TP size (glmctl quantize exl3)", usage=True))
    limit = max_positions(path)
    if limit is not None and prof.max_model_len > limit:
        report.failures.append(Finding(
            "context", f"max_model_len {prof.max_model_len:,} is longer than {path} supports "
            f"(max_position_embeddings {limit:,})", f"set max_model_len <= {limit:,} in profile '{prof.name}'",
            usage=True))


def _port(launch: RenderedLaunch, report: PreflightReport) -> None:
    problem = port_problem(launch.host, launch.port)
    if problem is None:
        report.passed.append(f"port {launch.port} on {launch.host} is free")
    else:
        report.failures.append(Finding("port", problem, "stop what holds it, or pass --port N"))


def _vllm(launch: RenderedLaunch, report: PreflightReport) -> None:
    from glmctl.serving import vllm_args

    check = vllm_args.check(launch.config_yaml(), launch.env)
    report.vllm = check
    if check.error is not None:
        report.failures.append(Finding("vllm", check.error, "install vLLM: pip install 'glmctl[gpu]' "
                                       "(GPU nodes) or 'glmctl[cpu]' (CPU)"))
        return
    report.passed.append(f"vLLM {check.vllm_version} on platform {check.platform}")
    if not check.plugin_registered or check.plugin_error:
        report.failures.append(Finding(
            "plugin", check.plugin_error or "glmctl's vLLM plugin is not registered",
            "reinstall glmctl in vLLM's environment (pip install -e .), and keep 'glmctl' in VLLM_PLUGINS if set",
        ))
    want = launch.profile.platform
    if check.platform is not None and check.platform != want:
        extra = "cpu" if want == "cpu" else "gpu"
        report.failures.append(Finding(
            "platform", f"profile '{launch.profile.name}' runs on vLLM's {want} platform, but this "
            f"vLLM runs on {check.platform}", f"use a {check.platform} profile, or install glmctl[{extra}]",
        ))
    for problem in check.problems:
        report.failures.append(Finding(
            "vllm arguments", f"vLLM rejects the rendered config: {problem}",
            f"fix vllm_args in profile '{launch.profile.name}' (glmctl profile validate "
            f"{launch.profile.name})", usage=True,
        ))


def gpu_findings(profile, gpus: list) -> tuple[list[Finding], str | None]:
    """What the visible GPUs lack for `profile` (failures), or a one-line summary of the fit."""
    hw = profile.hardware
    need = max(hw.gpus or 0, profile.tensor_parallel_size)
    if len(gpus) < need:
        return [Finding("gpus", f"profile '{profile.name}' needs {need} GPUs; {len(gpus)} visible",
                        "run on a node with enough GPUs (check CUDA_VISIBLE_DEVICES and `nvidia-smi`)")], None
    used = gpus[:need]
    found = []
    if hw.min_compute_capability:
        major, minor = (int(x) for x in hw.min_compute_capability.split("."))
        low = [g for g in used if tuple(g.compute_capability) < (major, minor)]
        if low:
            names = ", ".join(f"GPU {g.index} {g.name} (sm_{g.compute_capability[0]}{g.compute_capability[1]})"
                              for g in low)
            found.append(Finding("gpus", f"needs compute capability >= {hw.min_compute_capability}: {names}",
                                 "Ampere (8.0) or newer is required"))
    if hw.min_gpu_memory_gib:
        small = [g for g in used if g.total_gib < hw.min_gpu_memory_gib]
        if small:
            names = ", ".join(f"GPU {g.index} ({g.total_gib:.1f} GiB)" for g in small)
            found.append(Finding("gpus", f"needs {hw.min_gpu_memory_gib:g} GiB per GPU: {names}",
                                 "use GPUs with more memory, or a profile planned for these"))
    util = profile.gpu_memory_utilization or 0.92  # vLLM 0.30's default
    busy = [g for g in used if g.free_gib < util * g.total_gib]
    if busy:
        names = ", ".join(f"GPU {g.index} ({g.free_gib:.1f} of {g.total_gib:.1f} GiB free)" for g in busy)
        found.append(Finding("gpus", f"vLLM will claim {util:.0%} of each GPU, but memory is in use: {names}",
                             "stop the other processes on these GPUs (nvidia-smi)"))
    first = used[0]
    summary = (f"{need} GPUs: {first.name}, sm_{first.compute_capability[0]}{first.compute_capability[1]}, "
               f"{first.total_gib:.1f} GiB")
    return found, None if found else summary


def _gpus(launch: RenderedLaunch, report: PreflightReport) -> None:
    from glmctl.probe.gpus import inventory

    report.gpus = inventory()
    failures, summary = gpu_findings(launch.profile, report.gpus)
    report.failures += failures
    if summary:
        report.passed.append(summary)


def _capacity(launch: RenderedLaunch, report: PreflightReport) -> None:
    verdict = profile_fit.predict_for_checkpoint(launch.profile, launch.model_dir, report.gpus)
    report.capacity = verdict
    if not verdict.available:
        report.warnings.append(f"capacity not checked: {verdict.note}")
    elif not verdict.fits:
        report.failures.append(Finding("capacity", verdict.note, verdict.closest, usage=True))
    else:
        report.passed.append(f"capacity: {verdict.note}")


def run(
    launch: RenderedLaunch,
    *,
    accept: list[str] = (),
    confirm: Callable[[License], bool] | None = None,
    record: bool = True,
) -> PreflightReport:
    """All checks for `launch`; raises LicenseError or PreflightError, else returns the report.
    `record=False` (a dry run) records no licence acceptance; every check is the same."""
    report = PreflightReport(profile=launch.profile.name)
    report.warnings += launch.profile.advisories()
    if launch.profile.speculative.method == "dflash2":
        from glmctl.plugin.spec_decode.dflash2_layout import serving_limits

        report.warnings += serving_limits(launch.profile.platform)
    _licences(launch, list(accept), confirm, report, record)
    _artifacts(launch, report)
    _port(launch, report)
    if report.failures:
        raise PreflightError(report)
    _vllm(launch, report)
    if launch.profile.platform == "cuda" and (report.vllm is None or report.vllm.platform == "cuda"):
        _gpus(launch, report)
    _capacity(launch, report)
    if report.failures:
        raise PreflightError(report)
    return report
