"""What the doctor concludes from a report. Pure functions of the recorded data: no probing here.

Rules, in order of what an operator must do about them:
- no CUDA device -> cannot serve GPU profiles; only the tiny-cpu profile runs here;
- compute capability: 8.x uses glmctl's Triton sparse-MLA/indexer kernels; 9.x/10.x/12.x vLLM's own;
  below 8.0 is unsupported (bf16 and the kernels need sm_80+);
- peer-to-peer: a pair the driver reports but whose write test failed or hung means vLLM's custom
  all-reduce would hang -> NCCL_P2P_DISABLE=1 and --disable-custom-all-reduce are required; without
  working P2P the collectives mode is host-staged unless NCCL measured faster at >= 1 MB;
- prefill floor for a 256k prompt: the time of its tensor-parallel all-reduces host-staged, from
  `glmctl.collectives.cost_model` with this node's measured host and pinned-copy bandwidth (a
  prediction from measurements, labelled as such).
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from glmctl.collectives import cost_model
from glmctl.probe.doctor_report import DoctorReport


class ProfileFit(BaseModel):
    profile: str
    fits: bool
    reasons: list[str] = Field(default_factory=list)


class Verdict(BaseModel):
    can_serve: bool                  # the chosen profile can run on this node
    chosen_profile: str
    kernels: str
    collectives_mode: str
    required_settings: list[str] = Field(default_factory=list)
    prefill_floor_s: float | None = None
    prefill_floor_method: str | None = None
    profiles: list[ProfileFit] = Field(default_factory=list)
    reasons: list[str] = Field(default_factory=list)   # why not, or what to watch


def kernels_for(report: DoctorReport) -> tuple[str, list[str]]:
    if not report.gpus:
        return "none (no CUDA device)", []
    majors = {g.compute_capability[0] for g in report.gpus}
    if len(majors) > 1:
        return "mixed GPU generations", ["GPUs of different compute capability cannot share one tensor-parallel group"]
    major = majors.pop()
    if major < 8:
        return f"unsupported (sm_{major}x)", [f"compute capability {major}.x is below 8.0: no bf16, no Triton DSA kernels"]
    if major == 8:
        return "glmctl Triton sparse-MLA + indexer kernels (sm_8x)", []
    return "vLLM's native FlashMLA / DeepGEMM kernels", []


def collectives_for(report: DoctorReport) -> tuple[str, list[str], list[str]]:
    """(mode, required settings, reasons)."""
    n = len(report.gpus)
    if n < 2:
        return "none (one GPU)", [], []
    broken = [p for p in report.p2p if p.state in ("reported-but-broken",)]
    working = [p for p in report.p2p if p.state == "ok"]
    settings, reasons = [], []
    if broken:
        pairs = ", ".join(f"{p.src}->{p.dst}" for p in broken[:6])
        settings += ["NCCL_P2P_DISABLE=1", "--disable-custom-all-reduce"]
        reasons.append(f"P2P is reported but broken for {len(broken)} pairs ({pairs}): custom all-reduce would hang")
    if report.p2p and len(working) == len(report.p2p):
        return "nccl (P2P works on every pair)", settings, reasons
    nccl = {c.bytes: c.busbw_gbps for c in report.collectives
            if c.backend == "nccl" and c.op == "all_reduce" and c.bytes >= 1 << 20 and not c.env.get("NCCL_P2P_DISABLE") == "0"}
    staged = {c.bytes: c.busbw_gbps for c in report.collectives
              if c.backend == "host-staged" and c.op == "all_reduce" and c.dtype != "int8" and c.bytes >= 1 << 20}
    common = sorted(set(nccl) & set(staged))
    if common and all(nccl[b] > staged[b] for b in common):
        return "nccl (measured faster than host-staged at >= 1 MB)", settings, reasons
    if not report.p2p:
        reasons.append("P2P was not tested (--quick); host-staged is the safe choice without P2P")
    return "host-staged (pinned host memory, INT8 for prefill)", settings, reasons


def host_bandwidth_gbps(report: DoctorReport) -> tuple[float, str] | None:
    """The host-memory ceiling every cross-GPU byte passes through without P2P."""
    candidates = [(m.gbps, m.name) for m in report.bandwidth
                  if m.name.startswith("host memcpy") or m.name.startswith("all-GPU pinned")]
    return min(candidates) if candidates else None


def node_links(report: DoctorReport) -> cost_model.NodeLinks | None:
    """The cost model's view of this node: measured host bandwidth, and the slowest GPU's pinned
    copies (the reference node's 25 GB/s where they were not measured)."""
    host = host_bandwidth_gbps(report)
    if host is None:
        return None
    pinned = {d: [m.gbps for m in report.bandwidth if m.name == f"pinned {d}"] for d in ("D2H", "H2D")}
    ref = cost_model.L40_NODE
    return cost_model.NodeLinks(
        name=f"this node ({host[1]})", host_gbps=host[0],
        link_d2h_gbps=min(pinned["D2H"]) if pinned["D2H"] else ref.link_d2h_gbps,
        link_h2d_gbps=min(pinned["H2D"]) if pinned["H2D"] else ref.link_h2d_gbps)


def prefill_floor(report: DoctorReport, tp: int) -> tuple[float, str] | None:
    """Seconds of host-staged all-reduce in a 256k prefill at tensor parallel `tp` (bf16)."""
    node = node_links(report)
    if node is None or tp < 2:
        return None
    seconds = cost_model.prefill_all_reduce_s(tp, "bf16", node=node)
    method = (f"predicted by glmctl.collectives.cost_model: {cost_model.PREFILL_TOKENS} tokens in "
              f"chunks of {cost_model.PREFILL_CHUNK}, {cost_model.ALL_REDUCES_PER_LAYER} bf16 "
              f"all-reduces per layer, host memory {node.host_gbps:.0f} GB/s measured, links "
              f"{node.link_d2h_gbps:.0f}/{node.link_h2d_gbps:.0f} GB/s; INT8 payloads about halve it")
    return seconds, method


def decide(report: DoctorReport, chosen: str = "commercial", profiles: list[ProfileFit] | None = None) -> Verdict:
    kernels, k_reasons = kernels_for(report)
    mode, settings, c_reasons = collectives_for(report)
    reasons = list(k_reasons) + list(c_reasons)
    if not report.gpus:
        reasons.insert(0, f"no CUDA device ({report.cuda_error or 'none found'}): cannot serve GPU profiles; tiny-cpu only")
        chosen_fits = chosen == "tiny-cpu"
    else:
        fit = next((p for p in profiles or [] if p.profile == chosen), None)
        chosen_fits = not k_reasons and (fit.fits if fit is not None else True)
        if fit is not None and not fit.fits:
            reasons += [f"profile {chosen}: {r}" for r in fit.reasons]
    floor = prefill_floor(report, len(report.gpus))
    return Verdict(
        can_serve=chosen_fits, chosen_profile=chosen, kernels=kernels, collectives_mode=mode,
        required_settings=settings, prefill_floor_s=floor[0] if floor else None,
        prefill_floor_method=floor[1] if floor else None, profiles=profiles or [], reasons=reasons,
    )
