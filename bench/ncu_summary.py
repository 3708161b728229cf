#!/usr/bin/env python3
"""Nsight Compute's raw CSV (`ncu --csv --page raw`) of `bench/exl3.py --profile`, grouped per
(path, tokens) and cut down to the figures that say what bounds a kernel.

    python bench/ncu_summary.py NCU.csv PROFILE.log [--json OUT.json]

PROFILE.log holds the profiled process's `PROFILE <path> <tokens>` lines; each (path, tokens)
block of kernels starts after a `spin_kernel` marker, in the same order. Per kernel: duration,
DRAM bytes and throughput (% of peak), achieved / theoretical occupancy, registers, shared memory,
grid, issue-slot use, and the three largest warp-stall reasons (cycles per issued instruction).
"""

from __future__ import annotations

import csv
import json
import sys

FIELDS = {
    "us": ("gpu__time_duration.sum", 1e-3),  # ns -> us
    "dram_read_MB": ("dram__bytes_read.sum", 1e-6),
    "dram_write_MB": ("dram__bytes_write.sum", 1e-6),
    "dram_pct": ("dram__throughput.avg.pct_of_peak_sustained_elapsed", 1),
    "sm_pct": ("sm__throughput.avg.pct_of_peak_sustained_elapsed", 1),
    "occ_achieved_pct": ("sm__warps_active.avg.pct_of_peak_sustained_active", 1),
    "occ_theoretical_pct": ("sm__maximum_warps_per_active_cycle_pct", 1),
    "regs": ("launch__registers_per_thread", 1),
    "smem_dyn": ("launch__shared_mem_per_block_dynamic", 1),
    "smem_static": ("launch__shared_mem_per_block_static", 1),
    "grid": ("launch__grid_size", 1),
    "block": ("launch__block_size", 1),
    "issue_pct": ("smsp__issue_active.avg.pct_of_peak_sustained_active", 1),
    "warp_cycles_per_inst": ("smsp__average_warp_latency_per_inst_issued.ratio", 1),
}
STALL_PREFIX = "smsp__average_warps_issue_stalled_"
STALL_SUFFIX = "_per_issue_active.ratio"


def _num(text: str):
    try:
        return float(text.replace(",", ""))
    except (ValueError, AttributeError):
        return None


UNIT_SCALE = {"nsecond": 1, "usecond": 1e3, "msecond": 1e6, "second": 1e9, "byte": 1, "Kbyte": 1e3,
              "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12}  # to ns and bytes


def read_rows(path: str) -> list[dict]:
    with open(path, newline="") as f:
        lines = [ln for ln in f if not ln.startswith("==")]
    rows = list(csv.DictReader(lines))
    if not rows or rows[0].get("ID", "") != "":
        return rows
    units, rows = rows[0], rows[1:]  # the units row: bring time to ns and sizes to bytes
    for row in rows:
        for key, unit in units.items():
            if unit in UNIT_SCALE and _num(row.get(key, "")) is not None:
                row[key] = str(_num(row[key]) * UNIT_SCALE[unit])
    return rows


def kernel_summary(row: dict) -> dict:
    out = {"kernel": row.get("Kernel Name", "?")[:90]}
    for key, (metric, scale) in FIELDS.items():
        v = _num(row.get(metric, ""))
        if v is not None:
            out[key] = round(v * scale, 2)
    stalls = {k[len(STALL_PREFIX):-len(STALL_SUFFIX)]: _num(v) for k, v in row.items()
              if k.startswith(STALL_PREFIX) and k.endswith(STALL_SUFFIX) and _num(v)}
    out["top_stalls"] = {k: round(v, 2) for k, v in sorted(stalls.items(), key=lambda kv: -kv[1])[:3]}
    return out


def group(rows: list[dict], manifest: list[tuple[str, int]]) -> list[dict]:
    blocks, current = [], None
    for row in rows:
        if "spin_kernel" in row.get("Kernel Name", ""):
            current = {"kernels": []}
            blocks.append(current)
        elif current is not None:
            current["kernels"].append(kernel_summary(row))
    out = []
    for (path, tokens), block in zip(manifest, blocks, strict=False):
        ks = block["kernels"]
        total = sum(k.get("us", 0) for k in ks)
        dram = sum(k.get("dram_read_MB", 0) + k.get("dram_write_MB", 0) for k in ks)
        out.append({"path": path, "tokens": tokens, "kernels_profiled": len(ks), "kernel_us": round(total, 1),
                    "dram_MB": round(dram, 1), "dram_GBps": round(dram / total * 1e3, 1) if total else None,
                    "per_kernel": ks})
    return out


def main() -> int:
    args = sys.argv[1:]
    if len(args) < 2:
        print(__doc__)
        return 2
    manifest = []
    for line in open(args[1]):
        if line.startswith("PROFILE "):
            _, path, tokens = line.split()
            manifest.append((path, int(tokens)))
    summary = group(read_rows(args[0]), manifest)
    if "--json" in args:
        with open(args[args.index("--json") + 1], "w") as f:
            json.dump(summary, f, indent=1)
    for s in summary:
        print(f"{s['path']} T={s['tokens']}: {s['kernels_profiled']} kernels, {s['kernel_us']} us, "
              f"{s['dram_MB']} MB DRAM, {s['dram_GBps']} GB/s")
        for k in s["per_kernel"]:
            print(f"   {k.get('us', '?'):>8} us dram {k.get('dram_pct', '?')}% occ {k.get('occ_achieved_pct', '?')}/"
                  f"{k.get('occ_theoretical_pct', '?')}% regs {k.get('regs', '?')} smem "
                  f"{k.get('smem_dyn', 0) + k.get('smem_static', 0):.0f} grid {k.get('grid', '?')} issue "
                  f"{k.get('issue_pct', '?')}% stalls {k['top_stalls']}  {k['kernel'][:48]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
