"""`glmctl doctor`: probe the node and say whether (and how) it can serve GLM-5.3-Flash."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from glmctl._cli.options import JsonOpt, QuietOpt, examples


def doctor(
    quick: Annotated[bool, typer.Option("--quick", help="Skip the long measurements (P2P write tests, big sizes).")] = False,
    profile: Annotated[str, typer.Option("--profile", "-p", help="The profile the exit code is about.")] = "commercial",
    record: Annotated[Path | None, typer.Option("--record", help="Also write the full report JSON to this file.")] = None,
    replay: Annotated[Path | None, typer.Option("--from", help="Judge a recorded report instead of probing.")] = None,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Probe GPUs, peer-to-peer, copy / NCCL / host-staged bandwidth; exit 0 if the profile can run here."""
    from glmctl._cli.output import Output
    from glmctl.probe import doctor as probe_doctor
    from glmctl.probe.render import render
    from glmctl.probe.report import DoctorReport
    from glmctl.probe.verdict import decide

    out = Output.from_flags(json_, quiet)
    if replay is not None:
        report = DoctorReport.model_validate_json(replay.read_text())
    else:
        report = probe_doctor.run(quick=quick, out=out)
    verdict = decide(report, chosen=profile, profiles=probe_doctor.profile_fits(report))
    if record is not None:
        tmp = record.with_suffix(record.suffix + ".tmp")
        tmp.write_text(report.model_dump_json(indent=2))
        tmp.replace(record)
    out.result({"report": report, "verdict": verdict}, render=lambda console: render(report, verdict, console))
    if not verdict.can_serve:
        raise typer.Exit(1)


doctor.epilog = examples("glmctl doctor", "glmctl doctor --quick --json", "glmctl doctor --from node.json --profile latency")
