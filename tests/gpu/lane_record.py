"""The gpu lane's record of the plugin inside real vLLM on CUDA: one JSON file, one entry per case.

    {"vllm_version": "0.30.0", "torch_version": "2.11.0+cu130", "device": "NVIDIA H200 (sm_90, 132 SMs)",
     "cases": [{"name": "eager", "passed": true, "detail": "...", "data": {...}}, ...]}

The file is the one named by $GLMCTL_GPU_LANE_RECORD (bench/gpu/vllm_lane.sh sets it; unset, nothing
is written). Any gpu-lane test adds its cases with `record_case`, which replaces an earlier case of
the same name, so a re-run updates the file instead of growing it:

    from tests.gpu.lane_record import record_case
    record_case("dflash2_greedy", passed, "same 24 tokens as plain decoding", data={"accepted": 0.41})

Writes are atomic (a temp file renamed over the record) under an exclusive lock, so tests in
several processes may add cases to one record. `finish_record` adds, for every case the lane must
have and nobody recorded, a case that says it did not run; such a case counts as not passed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

RECORD_ENV = "GLMCTL_GPU_LANE_RECORD"
REQUIRED_CASES = (
    "eager", "graphs_full", "graphs_piecewise", "kv_fp8", "kv_fp8_ds_mla", "mtp3_greedy",
    "mtp3_sampled", "fp8_attention", "exl3_experts", "exl3_experts_graphs", "batch_invariance",
    "serve_http", "plan_capacity",
)


def record_path() -> Path | None:
    value = os.environ.get(RECORD_ENV)
    return Path(value) if value else None


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_record(path: Path) -> dict:
    try:
        record = json.loads(Path(path).read_text())
    except FileNotFoundError:
        record = {}
    record.setdefault("cases", [])
    return record


def _write(path: Path, record: dict) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f, indent=1, default=str)
        f.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _update(path: Path | None, change) -> dict | None:
    if path is None:
        return None
    with _locked(path):
        record = read_record(path)
        change(record)
        _write(path, record)
        return record


def record_environment(path: Path | None = None, **fields) -> None:
    """Set top-level fields (vllm_version, torch_version, device, ...) of the record."""
    _update(path or record_path(), lambda record: record.update(fields))


def record_case(name: str, passed: bool, detail: str, data: dict | None = None,
                path: Path | None = None) -> None:
    """Add case `name` to the record (replacing one of that name). No-op without a record file."""
    entry = {"name": name, "passed": bool(passed), "detail": detail}
    if data:
        entry["data"] = data

    def change(record: dict) -> None:
        cases = [c for c in record["cases"] if c.get("name") != name]
        record["cases"] = [*cases, entry]

    _update(path or record_path(), change)


def finish_record(path: Path, required: Iterable[str] = REQUIRED_CASES,
                  why_missing: str = "not run: no test recorded it (see the lane's log)") -> dict:
    """Add a not-passed case for every required case missing from the record; return the record."""

    def change(record: dict) -> None:
        have = {c.get("name") for c in record["cases"]}
        record["cases"] += [{"name": n, "passed": False, "detail": why_missing}
                            for n in required if n not in have]

    return _update(Path(path), change)


def render_table(record: dict, width: int = 96) -> str:
    """The short table printed last by the lane: one line per case."""
    head = (f"vLLM {record.get('vllm_version', '?')}, torch {record.get('torch_version', '?')}, "
            f"{record.get('device', '?')}")
    lines = [head, f"{'case':<20} {'result':<6} detail"]
    for case in record.get("cases", []):
        detail = " ".join(str(case.get("detail", "")).split())
        room = width - 28
        lines.append(f"{case['name']:<20} {'PASS' if case.get('passed') else 'FAIL':<6} "
                     f"{detail if len(detail) <= room else detail[: room - 3] + '...'}")
    passed = sum(1 for c in record.get("cases", []) if c.get("passed"))
    lines.append(f"{passed}/{len(record.get('cases', []))} cases passed")
    return "\n".join(lines)


if __name__ == "__main__":  # python tests/gpu/lane_record.py RECORD [WHY] [--cases NAME ...] [--no-table]
    import argparse

    parser = argparse.ArgumentParser(description="finish the lane's record and print its table")
    parser.add_argument("record", type=Path)
    parser.add_argument("why", nargs="?", default="not run: no test recorded it (see the lane's log)")
    parser.add_argument("--cases", nargs="+", default=list(REQUIRED_CASES), help="the cases that must be there")
    parser.add_argument("--no-table", action="store_true")
    args = parser.parse_args()
    finished = finish_record(args.record, args.cases, why_missing=args.why)
    if not args.no_table:
        print(render_table(finished))
