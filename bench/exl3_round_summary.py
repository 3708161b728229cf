"""The short table of one bench/gpu/exl3_round.sh run, from the files it leaves in its folder:
exl3-decode-tests.xml (pytest), exl3-decode-rate.json (bench/exl3_decode_rate.py),
moe-bench-uniform.json and moe-bench-hot16.json (bench/exl3.py). Missing files are named, not
fatal: the table shows what the round measured."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _tests(path: Path) -> str:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return "gpu tests: no report"
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [c.get("name") for s in suites for c in s.iter("testcase") if c.find("failure") is not None
              or c.find("error") is not None]
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    return (f"gpu tests: {passed} passed, {n['failures'] + n['errors']} failed, {n['skipped']} skipped"
            + (f" ({', '.join(failed[:6])})" if failed else ""))


def _rate_lines(rate: dict | None) -> list[str]:
    if not rate:
        return ["decode rate: no exl3-decode-rate.json"]
    rows = rate["rows"]

    def pick(kernel, residency, prefix=""):
        hits = [r for r in rows if r["kernel"] == kernel and r["residency"] == residency
                and r["config"].startswith(prefix)]
        return max(hits, key=lambda r: r["weights_per_s"]) if hits else None

    def fmt(r):
        return f"{r['weights_per_s'] / 1e12:.2f} ({r['config']})" if r else "-"

    bw = rate["copy_bw_bytes_per_s"]
    lines = [f"{rate['device']}: copy {bw / 1e12:.2f} TB/s = {2 * bw / 1e12:.2f} T 4-bit weights/s of bytes "
             "(measured)", "decode rate, T weights/s (measured, best config):"]
    for label, kernel, prefix in (("glmctl raw", "glmctl_stream", "raw"), ("glmctl affine", "glmctl_stream", "affine"),
                                  ("words only", "glmctl_stream", "load"), ("exllamav3", "exllamav3_exl3_gemm", "")):
        lines.append(f"  {label:14s} dram {fmt(pick(kernel, 'dram', prefix))}   l2 {fmt(pick(kernel, 'l2', prefix))}")
    for r in rate.get("isa", []):
        if r["config"] == "raw_k64_w4_s1_x4" or r["config"].startswith("affine"):
            lines.append(f"  ISA {r['arch']} {r['config']}: {r['instr_per_weight']} SASS/weight "
                         f"(IMAD+IDP {r['fma_heavy_per_weight']}, ALU {r['alu_per_weight']})")
    model = rate.get("model", {})
    for label, steps in (("this GPU, glmctl decode rate", model.get("device", {}).get("glmctl_steps")),
                         ("this GPU, exllamav3 decode rate", model.get("device", {}).get("exllamav3_steps")),
                         ("L40 (predicted)", model.get("l40", {}).get("steps"))):
        for cell, s in (steps or {}).items():
            lines.append(f"  routed experts {cell} {label}: bytes {s['bytes_floor_ms']} ms, decode "
                         f"{s['decode_floor_ms']} ms -> floor {s['floor_ms']} ms ({s['bound']}-bound)")
    return lines


def _ab_table(uniform: dict | None, hot: dict | None) -> list[str]:
    def rows(result, path):
        return {r["tokens"]: r for r in (result or {}).get("rows", []) if r["path"] == path}

    lines = ["| tokens | uniform coop_lean us | uniform triton us | triton/coop | hot16 coop_lean us | "
             "hot16 triton us | triton/coop | uniform triton frac_copy |", "|---|---|---|---|---|---|---|---|"]
    uc, ut = rows(uniform, "exl3_coop_lean"), rows(uniform, "exl3_triton")
    hc, ht = rows(hot, "exl3_coop_lean"), rows(hot, "exl3_triton")
    def us(d, t):
        return d[t]["us"] if t in d else "-"

    def ratio(a, b, t):
        return f"{b[t]['us'] / a[t]['us']:.2f}" if t in a and t in b else "-"

    for t in sorted(set(uc) | set(ut) | set(hc) | set(ht)):
        lines.append(f"| {t} | {us(uc, t)} | {us(ut, t)} | {ratio(uc, ut, t)} | {us(hc, t)} | {us(ht, t)} | "
                     f"{ratio(hc, ht, t)} | {ut[t]['frac_copy'] if t in ut else '-'} |")
    sweep = [r for r in (uniform or {}).get("rows", []) if r["path"].startswith("exl3_triton.")]
    if sweep:
        lines.append("sweep (uniform, us): " + "; ".join(f"{r['path'][12:]}@{r['tokens']} {r['us']}" for r in sweep))
    for name, result in (("uniform", uniform), ("hot16", hot)):
        if result is None:
            lines.append(f"{name}: no moe-bench-{name}.json")
        else:
            for k, v in (result.get("agree") or {}).items():
                lines.append(f"agree {name} {k}: {v}")
            lines += [f"note {name}: {n}" for n in result.get("notes", [])]
    return lines


def summary(folder: Path) -> str:
    folder = Path(folder)
    lines = [_tests(folder / "exl3-decode-tests.xml")]
    lines += _rate_lines(_load(folder / "exl3-decode-rate.json"))
    lines += ["", "routed experts, one MoE layer, one TP8 rank, CUDA graphs (measured, bench/exl3.py):"]
    lines += _ab_table(_load(folder / "moe-bench-uniform.json"), _load(folder / "moe-bench-hot16.json"))
    return "\n".join(lines)
