"""Rich rendering of a doctor report and its verdict (nvbandwidth / nccl-tests shapes)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from glmctl.probe.doctor_report import DoctorReport
from glmctl.probe.verdict import Verdict

STATE_STYLE = {"ok": "green", "not-supported": "yellow", "reported-but-broken": "bold red",
               "not-reported-but-works": "cyan", "untested": "dim", "error": "red"}


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:,.1f} GiB"


def render(report: DoctorReport, verdict: Verdict, console: Console) -> None:
    sw = report.software
    t = Table(title="Software", show_header=False)
    for k, v in [("glmctl", sw.glmctl), ("python", sw.python), ("torch", f"{sw.torch} ({'CUDA ' + sw.torch_cuda if sw.torch_cuda else 'no CUDA'})" if sw.torch else None),
                 ("triton", sw.triton), ("vllm", sw.vllm), ("exllamav3", sw.exllamav3),
                 ("NVIDIA driver", sw.nvidia_driver), ("/dev/shm", _gib(sw.shm_bytes)),
                 ("host", f"{report.host.cpu_model}, {report.host.cpu_cores} cores, {_gib(report.host.memory_bytes)}, "
                          f"{report.host.numa_nodes} NUMA node(s)")]:
        t.add_row(k, escape(str(v)) if v is not None else "-")
    for k, v in sw.env.items():
        t.add_row(f"env {k}", escape(v))
    console.print(t)

    if not report.gpus:
        console.print(f"[yellow]no CUDA device[/yellow]: {escape(report.cuda_error or '')}")
    else:
        g = Table(title="GPUs")
        for col in ("#", "name", "cc", "memory", "PCIe now/max", "NUMA"):
            g.add_column(col)
        for gpu in report.gpus:
            pcie = (f"gen{gpu.pcie_gen_current} x{gpu.pcie_width_current} / gen{gpu.pcie_gen_max} x{gpu.pcie_width_max}"
                    if gpu.pcie_gen_max else "-")
            g.add_row(str(gpu.index), gpu.name, "{}.{}".format(*gpu.compute_capability), _gib(gpu.memory_bytes), pcie,
                      "-" if gpu.numa_node is None else str(gpu.numa_node))
        console.print(g)

    if report.p2p:
        n = len(report.gpus)
        m = Table(title="Peer-to-peer: state (driver says / write test), row = writer, column = owner")
        m.add_column("src\\dst")
        for j in range(n):
            m.add_column(str(j))
        cells = {(p.src, p.dst): p for p in report.p2p}
        for i in range(n):
            row = []
            for j in range(n):
                p = cells.get((i, j))
                row.append("-" if p is None else f"[{STATE_STYLE[p.state]}]{p.state}[/]")
            m.add_row(str(i), *row)
        console.print(m)

    if report.bandwidth:
        b = Table(title="Copy bandwidth (GB/s = 1e9 B/s)")
        for col in ("measurement", "GPU", "size", "GB/s", "how"):
            b.add_column(col)
        for x in report.bandwidth:
            b.add_row(x.name, "all" if x.gpu is None else str(x.gpu), f"{x.bytes / 2**20:,.0f} MiB", f"{x.gbps:,.1f}", x.method)
        console.print(b)

    if report.collectives:
        c = Table(title="Collectives (busbw: nccl-tests formula)")
        for col in ("op", "backend", "dtype", "ranks", "env", "size", "latency us", "algbw GB/s", "busbw GB/s"):
            c.add_column(col)
        for x in report.collectives:
            env = " ".join(f"{k}={v}" for k, v in x.env.items()) or "-"
            c.add_row(x.op, x.backend, x.dtype, str(x.ranks), env, f"{x.bytes / 2**10:,.0f} KiB",
                      f"{x.latency_us:,.1f}", f"{x.algbw_gbps:,.2f}", f"{x.busbw_gbps:,.2f}")
        console.print(c)

    for note in report.notes:
        console.print(f"[dim]note: {escape(note)}[/dim]")

    v = Table(title="Verdict", show_header=False)
    v.add_row("can serve", f"[green]yes[/green] ({verdict.chosen_profile})" if verdict.can_serve
              else f"[red]no[/red] ({verdict.chosen_profile})")
    v.add_row("kernels", verdict.kernels)
    v.add_row("collectives", verdict.collectives_mode)
    if verdict.required_settings:
        v.add_row("required settings", " ".join(verdict.required_settings))
    if verdict.prefill_floor_s is not None:
        v.add_row("256k prefill floor", f"{verdict.prefill_floor_s:,.0f} s ({verdict.prefill_floor_method})")
    for p in verdict.profiles:
        v.add_row(f"profile {p.profile}", ("fits" if p.fits else "does not fit") + (f": {'; '.join(p.reasons)}" if p.reasons else ""))
    for r in verdict.reasons:
        v.add_row("reason", escape(r))
    console.print(v)
