#!/usr/bin/env python3
"""How fast one GPU decodes EXL3 4-bit trellis weights, and what that predicts for the routed
experts of a decode step.

    python bench/exl3_decode_rate.py [--out DIR] [--json]     on a GPU: everything below
    python bench/exl3_decode_rate.py --isa [--out DIR]        SASS counts only (CPU: cross-compiled)
    python bench/exl3_decode_rate.py --summary DIR            the short table of a bench/gpu/exl3_round.sh run

Timed (CUDA events, median of 5 rounds of 8 launches):
  copy       a 1 GiB device-to-device copy, read + write bytes per second (the floor's unit)
  stream     glmctl's decode loop (glmctl.kernels.exl3_moe_decode._run_gemv, the MoE kernels' own
             loop) over 1024 programs' worth of gate-shaped expert trellis [4096, 256], 16
             activation rows, nothing kept but the products' sum. mode raw: the MoE kernels'
             decode (raw integers, affine map in the epilogue); affine: exllamav3's fp16 values
             (one fp16 fma per weight pair more); load: the words alone, xor-folded.
             dram: 1024 distinct experts (537 MB, > 10x L2); l2: 16 experts (8.4 MB) read again
             and again (the decode's own ceiling).
  exllamav3  exl3_gemm (mul1 codebook, its small-m GEMV path) with m = 1 and 8 rows over the same
             trellis bytes (dram: n = 262144; l2: n = 4096), input and output rotations included.
Rates are decoded weights per second (4 bits each). The ISA section counts the SASS of the
stream loop per decoded weight (cross-compiled for sm_89 and sm_90 with Triton, counted with the
cuobjdump Triton ships), split by the pipes that bound it: all issue (1 warp instruction per
clock per SM sub-partition), FMA-heavy (IMAD, IDP: 16 lanes), ALU (shifts, logic, prmt: 16 lanes).

The model (JSON "model", printed): routed experts of a step >= layers x max(touched bytes /
copy bandwidth, decoded weights / decode rate); decoded weights = touched experts x 3 x 4096 x
256 (each expert decoded once per run of <= 16 slots: once, at these sizes); touched experts =
288 (1 - (1 - 8/288)^T) for T tokens (uniform routing). Every figure is labelled measured (this
run) or predicted (from what).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from exl3_floor import HIDDEN, INTER, isa_prediction, model  # noqa: E402

GRID_EXPERTS, DRAM_EXPERTS, L2_EXPERTS = 1024, 1024, 16
STREAM_CONFIGS = (  # (name, mode, block_k, warps, stages, split): x<split> programs per expert column block
    ("raw_k64_w4_s1_x4", "raw", 64, 4, 1, 4), ("raw_k64_w4_s2_x4", "raw", 64, 4, 2, 4),
    ("raw_k128_w4_s1_x4", "raw", 128, 4, 1, 4), ("raw_k64_w4_s1_x16", "raw", 64, 4, 1, 16),
    ("affine_k64_w4_s1_x4", "affine", 64, 4, 1, 4), ("load_k64_w4_s1_x4", "load", 64, 4, 1, 4),
)
ISA_CONFIGS = ("raw_k64_w4_s1_x4", "raw_k128_w4_s1_x4", "affine_k64_w4_s1_x4")
CLOCKS_HZ = {"H200": 1.98e9, "H100": 1.98e9, "L40": 2.49e9}  # max SM clocks (spec)
FMA_HEAVY = {"IMAD", "IDP", "IMUL"}
ALU = {"SHF", "LOP3", "PRMT", "SGXT", "IADD3", "ISETP", "SEL", "LEA", "BMSK", "PLOP3", "MOV"}


tl = _run_gemv = block_offsets = None  # triton.language and the kernels' helpers, bound by _kernel()


def _stream(tr_ptr, a_ptr, out_ptr, e_stride, e_phys, MODE: tl.constexpr, AFFINE: tl.constexpr,
            K: tl.constexpr, ROW_WORDS: tl.constexpr, KB: tl.constexpr, BKT: tl.constexpr, FAST: tl.constexpr):
    """One program: 128 columns x K / split rows of one expert (program 0 modulo e_phys)."""
    e = tl.program_id(0) % e_phys
    base = tr_ptr + e * e_stride + tl.program_id(1) * 256 + tl.program_id(2) * (KB * BKT * ROW_WORDS)
    if MODE == 0:  # the words alone
        woff, poff = block_offsets(ROW_WORDS, BKT)
        acc = tl.zeros([8, 8, BKT, 4], dtype=tl.int32)
        for kb in range(KB):
            koff = kb * (BKT * ROW_WORDS)
            acc ^= tl.load(base + koff + woff) + tl.load(base + koff + poff)[:, :, :, None]
        total = tl.sum(tl.sum(tl.sum(tl.sum(acc, 3), 2), 1), 0).to(tl.float32)
    else:
        rows = tl.arange(0, 16)
        a_ptrs = a_ptr + rows[:, None] * K + tl.program_id(2) * (KB * BKT * 16) + tl.arange(0, BKT * 16)[None, :]
        acc0, acc1 = _run_gemv(base, a_ptrs, rows < 16, ROW_WORDS, KB, BKT, 16, AFFINE, FAST)
        total = tl.sum(tl.sum(acc0 + acc1, 1), 0)
    pid = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2)
    tl.store(out_ptr + pid, total)


_jitted: list = []


def _kernel():
    """`_stream` as a Triton kernel; triton and the kernels' helpers become this module's globals
    here, so that importing the bench (its unit test) does not import triton."""
    if not _jitted:
        import triton
        import triton.language
        from glmctl.kernels.exl3_moe_decode import _run_gemv as run_gemv
        from glmctl.kernels.exl3_trellis import block_offsets as offsets

        globals().update(tl=triton.language, _run_gemv=run_gemv, block_offsets=offsets)
        _jitted.append(triton.jit(_stream))
    return _jitted[0]


def _constexprs(mode: str, block_k: int, split: int, fast: bool) -> dict:
    return dict(MODE=0 if mode == "load" else 1, AFFINE=mode == "affine", K=HIDDEN,
                ROW_WORDS=(INTER // 16) * 32, KB=HIDDEN // block_k // split, BKT=block_k // 16, FAST=fast)


# -- ISA ----------------------------------------------------------------------------------------
def _sass(cubin: bytes) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return ""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        Path(path).write_bytes(cubin)
        return subprocess.run([tool, "-sass", path], capture_output=True, text=True).stdout


def loop_counts(sass: str) -> collections.Counter:
    """Opcode counts of the largest loop body (from a backward branch's target to the branch)."""
    ins = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in
           re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", sass)]
    best: collections.Counter = collections.Counter()
    for addr, op, args in ins:
        target = re.search(r"0x([0-9a-f]+)", args) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < addr:
            lo = int(target.group(1), 16)
            body = collections.Counter(o.split(".")[0] for a, o, _ in ins if lo <= a <= addr)
            if sum(body.values()) > sum(best.values()):
                best = body
    return best


def isa(arch: int, name: str, mode: str, block_k: int, warps: int, stages: int) -> dict:
    """Loop SASS per decoded weight of one stream config, cross-compiled for sm_<arch>."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _kernel()
    names = fn.arg_names
    types = dict(tr_ptr="*i32", a_ptr="*fp16", out_ptr="*fp32", e_stride="i64", e_phys="i32")
    sig = {n: types.get(n, "constexpr") for n in names}
    cx = _constexprs(mode, block_k, 4, True)
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in cx.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in types})
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps, num_stages=stages))
    body = loop_counts(_sass(k.asm["cubin"]))
    per_thread = 8 * 8 * (block_k // 16) * 4 * 8 / (32 * warps)  # weights per thread per iteration
    total = sum(body.values())
    return {"arch": f"sm_{arch}", "config": name, "weights_per_thread_iter": per_thread,
            "instr_per_weight": round(total / per_thread, 3) if total else None,
            "fma_heavy_per_weight": round(sum(v for o, v in body.items() if o in FMA_HEAVY) / per_thread, 3),
            "alu_per_weight": round(sum(v for o, v in body.items() if o in ALU) / per_thread, 3),
            "opcodes": dict(body.most_common(14))}


# -- timing -------------------------------------------------------------------------------------
def _events(torch, fn, launches: int = 8, rounds: int = 5) -> float:
    """Median microseconds per launch."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(launches):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1000 / launches)
    return statistics.median(out)


def copy_bandwidth(torch, size: int = 1 << 30) -> float:
    src = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * size / (_events(torch, lambda: dst.copy_(src), launches=4) * 1e-6)


def stream_rows(torch, trellis, acts, copy_bw: float) -> list[dict]:
    fn = _kernel()
    out = torch.empty(GRID_EXPERTS * 2 * 16, dtype=torch.float32, device="cuda")
    words = trellis.view(torch.int32)
    rows = []
    for name, mode, block_k, warps, stages, split in STREAM_CONFIGS:
        for residency, e_phys in (("dram", DRAM_EXPERTS), ("l2", L2_EXPERTS)):
            cx = _constexprs(mode, block_k, split, True)

            def launch(cx=cx, warps=warps, stages=stages, split=split, e_phys=e_phys):
                fn[(GRID_EXPERTS, 2, split)](words, acts, out, words.stride(0), e_phys, **cx, num_warps=warps,
                                             num_stages=stages)
            us = _events(torch, launch)
            weights = GRID_EXPERTS * HIDDEN * INTER
            rows.append({"kernel": "glmctl_stream", "config": name, "mode": mode, "residency": residency,
                         "us": round(us, 1), "weights_per_s": weights / (us * 1e-6),
                         "frac_copy": round(weights / 2 / (us * 1e-6) / copy_bw, 3)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def exllamav3_rows(torch, copy_bw: float) -> tuple[list[dict], list[str]]:
    rows, notes = [], []
    try:
        from glmctl.plugin.quantization.exl3_experts import ext

        lib = ext()
    except Exception as exc:
        return rows, [f"exllamav3: {type(exc).__name__}: {str(exc)[:160]}"]
    g = torch.Generator(device="cuda").manual_seed(5)
    for residency, n in (("dram", DRAM_EXPERTS * INTER), ("l2", L2_EXPERTS * INTER)):
        b = torch.randint(-2**15, 2**15, (HIDDEN // 16, n // 16, 64), dtype=torch.int16, device="cuda", generator=g)
        suh = (torch.randint(0, 2, (HIDDEN,), device="cuda", generator=g) * 2 - 1).half()
        svh = (torch.randint(0, 2, (n,), device="cuda", generator=g) * 2 - 1).half()
        for m in (1, 8):
            a = torch.randn(m, HIDDEN, device="cuda", generator=g).half()
            a_had, c = torch.empty_like(a), torch.empty((m, n), dtype=torch.float16, device="cuda")
            try:
                tag = lib.exl3_gemm(a, b, c, suh, a_had, svh, 0, False, True, 0)
                args = (a, b, c, suh, a_had, svh, 0, False, True, 0)
                us = _events(torch, lambda args=args: lib.exl3_gemm(*args))
            except Exception as exc:
                notes.append(f"exl3_gemm m={m} {residency}: {type(exc).__name__}: {str(exc)[:160]}")
                continue
            weights = HIDDEN * n
            rows.append({"kernel": "exllamav3_exl3_gemm", "config": f"m{m} kernel tag {tag}", "mode": "affine",
                         "residency": residency, "us": round(us, 1), "weights_per_s": weights / (us * 1e-6),
                         "frac_copy": round(weights / 2 / (us * 1e-6) / copy_bw, 3)})
            print(json.dumps(rows[-1]), flush=True)
        del b
    return rows, notes


# -- model --------------------------------------------------------------------------------------
# -- output -------------------------------------------------------------------------------------
def _g(x: float | None, unit: float = 1e12) -> str:
    return "-" if x is None else f"{x / unit:.2f}"


def table(result: dict) -> str:
    lines = [f"EXL3 decode rate on {result['device']} ({result['sm_count']} SMs, {result['clock_hz'] / 1e9:.2f} GHz "
             f"{result['clock_label']}), copy {result['copy_bw_bytes_per_s'] / 1e12:.2f} TB/s (r+w, measured)", "",
             "| kernel | config | dram Tw/s | l2 Tw/s | dram frac_copy |", "|---|---|---|---|---|"]
    by = collections.defaultdict(dict)
    for r in result["rows"]:
        by[(r["kernel"], r["config"])][r["residency"]] = r
    for (kernel, config), v in by.items():
        d, l2 = v.get("dram"), v.get("l2")
        lines.append(f"| {kernel} | {config} | {_g(d and d['weights_per_s'])} | {_g(l2 and l2['weights_per_s'])} | "
                     f"{d['frac_copy'] if d else '-'} |")
    lines += ["", "| ISA (loop SASS per weight) | all | IMAD+IDP | ALU |", "|---|---|---|---|"]
    lines += [f"| {r['arch']} {r['config']} | {r['instr_per_weight']} | {r['fma_heavy_per_weight']} | "
              f"{r['alu_per_weight']} |" for r in result["isa"]]
    m = result.get("model", {})
    lines += ["", "| routed experts per step (45 layers) | cell | bytes floor ms | decode floor ms | floor ms |",
              "|---|---|---|---|---|"]
    for label, steps in (("this GPU, glmctl decode (l2 rate)", m.get("device", {}).get("glmctl_steps")),
                         ("this GPU, exllamav3 decode (l2 rate)", m.get("device", {}).get("exllamav3_steps")),
                         ("L40 predicted, glmctl decode", m.get("l40", {}).get("steps"))):
        for cell, s in (steps or {}).items():
            lines.append(f"| {label} | {cell} | {s['bytes_floor_ms']} | {s['decode_floor_ms']} | {s['floor_ms']} ({s['bound']}) |")
    lines += [f"note: {n}" for n in result.get("notes", [])]
    return "\n".join(lines)


def run(args) -> dict:
    import torch

    props = torch.cuda.get_device_properties(0)
    clock = next((v for k, v in CLOCKS_HZ.items() if k in props.name), 1.98e9)
    result = {"device": props.name, "sm_count": props.multi_processor_count, "clock_hz": clock,
              "clock_label": "spec max SM clock (predicted figures use it)", "torch": torch.__version__,
              "how": "CUDA events, median of 5 rounds of 8 launches; weights/s = decoded 4-bit weights per second; "
                     "frac_copy = trellis bytes per second / copy bandwidth (read + write)", "notes": []}
    started = time.perf_counter()
    result["copy_bw_bytes_per_s"] = copy_bandwidth(torch)
    g = torch.Generator(device="cuda").manual_seed(3)
    trellis = torch.randint(-2**15, 2**15, (DRAM_EXPERTS, HIDDEN // 16, INTER // 16, 64), dtype=torch.int16,
                            device="cuda", generator=g)
    acts = torch.randn(16, HIDDEN, device="cuda", generator=g).half()
    result["rows"] = stream_rows(torch, trellis, acts, result["copy_bw_bytes_per_s"])
    del trellis
    result["isa"] = []
    _checkpoint(result, args.out)
    exl_rows, notes = exllamav3_rows(torch, result["copy_bw_bytes_per_s"])
    result["rows"] += exl_rows
    result["notes"] += notes
    _checkpoint(result, args.out)
    result["isa"] = isa_rows(result["notes"])
    result["model"] = model(result)
    result["bench_seconds"] = round(time.perf_counter() - started, 1)
    return result


def _checkpoint(result: dict, out: Path | None) -> None:
    """A run cut short by its time limit still leaves what it measured (and the model of it)."""
    if out:
        out.mkdir(parents=True, exist_ok=True)
        partial = dict(result, partial=True, model=model(result))
        (out / "exl3-decode-rate.json").write_text(json.dumps(partial, indent=1, default=str) + "\n")


def isa_rows(notes: list[str]) -> list[dict]:
    rows = []
    for arch in (90, 89):
        for name, mode, block_k, warps, stages, _ in (c for c in STREAM_CONFIGS if c[0] in ISA_CONFIGS):
            try:
                rows.append(isa(arch, name, mode, block_k, warps, stages))
            except Exception as exc:  # no cuobjdump / compiler here: the rates stand alone
                notes.append(f"isa sm_{arch} {name}: {type(exc).__name__}: {str(exc)[:120]}")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--isa", action="store_true", help="SASS counts only (no GPU needed)")
    ap.add_argument("--summary", type=Path, default=None, help="print the round's table from this folder")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.summary:
        from exl3_round_summary import summary

        print(summary(args.summary))
        return 0
    if args.isa:
        import triton

        notes: list[str] = []
        result = {"what": "SASS of glmctl's EXL3 decode loop (bench/exl3_decode_rate.py stream kernel, the MoE "
                          "kernels' _run_gemv), cross-compiled with triton.compile", "triton": triton.__version__,
                  "isa": isa_rows(notes), "notes": notes}
        result["predicted"] = isa_prediction(result["isa"])
        text = json.dumps(result, indent=1)
    else:
        result = run(args)
        text = table(result)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / ("exl3-decode-isa.json" if args.isa else "exl3-decode-rate.json")).write_text(
            json.dumps(result, indent=1, default=str) + "\n")
    print(json.dumps(result, indent=1, default=str) if args.json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
