"""Summarise ``ncu --csv --page raw`` output: one line per profiled kernel launch with its time,
DRAM and memory throughput, achieved occupancy, registers, shared memory, and the top warp stall
reasons (cycles per issued instruction), as ``bench/gpu/kernels_v2.sh explore`` prints them.

    python bench/kernels_ncu.py ncu-raw.csv
"""

from __future__ import annotations

import csv
import re
import sys

FIELDS = {
    "us": "gpu__time_duration.sum",
    "dram%": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "mem%": "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
    "occ%": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "regs": "launch__registers_per_thread",
    "smem": "launch__shared_mem_per_block",
    "grid": "launch__grid_size",
    "warps": "launch__block_size",
}
STALL = re.compile(r"smsp__average_warps?_(?:issue_stalled|latency_issue_stalled)_(\w+?)"
                   r"_per_issue_active\.ratio$")


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def summarise(path: str) -> list[str]:
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # drop ncu's own log lines
    rows = list(csv.reader(lines))
    if len(rows) < 3:
        return ["no ncu rows"]
    header, units, data = rows[0], rows[1], rows[2:]
    col = {name: i for i, name in enumerate(header)}
    out = []
    for row in data:
        name = row[col.get("Kernel Name", 0)][:34]
        parts = [f"{name:<34}"]
        for label, metric in FIELDS.items():
            i = col.get(metric)
            value = _number(row[i]) if i is not None else None
            if value is not None and label == "us" and units[i].strip() in ("nsecond", "ns"):
                value /= 1e3
            if value is not None and label == "us" and units[i].strip() in ("msecond", "ms"):
                value *= 1e3
            if value is not None and label == "warps":
                value /= 32
            parts.append(f"{label} {value:.4g}" if value is not None else f"{label} -")
        stalls = []
        for metric, i in col.items():
            found = STALL.search(metric)
            value = _number(row[i]) if found else None
            if value:
                stalls.append((value, found.group(1)))
        stalls.sort(reverse=True)
        parts.append("stalls " + ", ".join(f"{n} {v:.1f}" for v, n in stalls[:4]))
        out.append("  ".join(parts))
    return out


if __name__ == "__main__":
    print("\n".join(summarise(sys.argv[1])))
