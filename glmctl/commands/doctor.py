"""`glmctl doctor`: probe the node and say whether (and how) it can serve GLM-5.3-Flash."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from glmctl._cli.completion import profile_names
from glmctl._cli.options import JsonOpt, QuietOpt, examples


def doctor(
    quick: Annotated[bool, typer.Option("--quick", help="Skip the long measurements (P2P write tests, big sizes).")] = False,
    profile: Annotated[str, typer.Option("--profile", "-p", autocompletion=profile_names, help="The profile the exit code is about.")] = "commercial",
    record: Annotated[Path | None, typer.Option("--record", help="Also write the full report JSON to this file.")] = None,
    replay: Annotated[Path | None, typer.Option("--from", help="Judge a recorded report instead of probing.")] = None,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Probe GPUs, peer-to-peer, copy / NCCL / host-staged bandwidth; exit 0 if the profile can run here.

    Exit 0 when --profile can run on this node, 1 when it cannot (the reasons are printed), 2 for an unknown profile or an unreadable --from report.
    """
    from glmctl._cli.output import Output
    from glmctl.probe import run_probes
    from glmctl.probe.doctor_tables import render
    from glmctl.probe.verdict import decide
    from glmctl.serving.profiles import find

    out = Output.from_flags(json_, quiet)
    find(profile)  # an unknown profile is a usage error before anything is probed
    if record is not None:
        from glmctl.evals.results import check_writable

        check_writable(record, "--record")
    report = _replayed(replay) if replay is not None else run_probes.run(quick=quick, feedback=out.feedback())
    verdict = decide(report, chosen=profile, profiles=run_probes.profile_fits(report))
    if record is not None:
        from glmctl.evals.results import write_atomic

        write_atomic(record, report.model_dump_json(indent=2))
    out.result({"report": report, "verdict": verdict}, render=lambda console: render(report, verdict, console))
    if not verdict.can_serve:
        raise typer.Exit(1)


def _replayed(path: Path):
    from pydantic import ValidationError

    from glmctl.errors import UsageError
    from glmctl.probe.doctor_report import DoctorReport

    try:
        return DoctorReport.model_validate_json(path.read_bytes())
    except FileNotFoundError as exc:
        raise UsageError(f"--from {path} does not exist", hint="record one with glmctl doctor --record FILE") from exc
    except OSError as exc:
        raise UsageError(f"cannot read --from {path}: {exc.strerror or exc}") from exc
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(document)"
        raise UsageError(f"--from {path} is not a glmctl doctor report ({where}: {first['msg']})",
                         hint="record one with glmctl doctor --record FILE") from exc


doctor.epilog = examples("glmctl doctor", "glmctl doctor --quick --json", "glmctl doctor --from node.json --profile latency")
