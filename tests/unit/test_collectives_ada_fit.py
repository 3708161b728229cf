"""Every collectives kernel compiles for Ada (sm_89) and needs far less than its 99 KB of shared
memory per block (cross-compiled on CPU, in a subprocess so TRITON_INTERPRET cannot leak in); the
direct path's kernels poll with volatile loads and issue no system-scope fence or atomic."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

if importlib.util.find_spec("triton") is None:  # not imported here: see the docstring
    pytest.skip("needs triton", allow_module_level=True)

PROBE = r"""
import json
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from glmctl.collectives import direct_kernels as d
from glmctl.collectives import kernels as k

P = "*i32"
TICK = {"tick_dev": P, "tick_host": P}
cases = {
    "reduce": (k._reduce_kernel, {"peer": "*bf16", "own": "*bf16", "out": "*bf16", "out2": "*bf16",
               "numel": "i32", "slot_stride": "i32", "rank": "i32", "world": "i32", **TICK},
               {"WRITE2": True, "TICK": True, "BLOCK": k.REDUCE_BLOCK}, 8),
    "copy": (k._copy_records_kernel, {"src": "*fp16", "dst": "*fp16", "n_valid": "i32",
             "total": "i32", "src_stride": "i32", "dst_stride": "i32", "skip": "i32", "rec0": "i32",
             **TICK}, {"TICK": True, "BLOCK": k.COPY_BLOCK}, 8),
    "quantize": (k._quantize_kernel, {"x": "*fp32", "numel": "i32", "rec8": "*i8", "rec32": "*fp32",
                 "dup8": "*i8", "dup32": "*fp32", "chunk_elems": "i32", "rec_stride": "i32",
                 "n_groups": "i32", **TICK},
                 {"DUAL": True, "TICK": True, "G": 128, "GPP": k.GROUPS_PER_PROGRAM}, 4),
    "dequant_reduce": (k._dequant_reduce_kernel, {"peer8": "*i8", "peer32": "*fp32", "own8": "*i8",
                       "own32": "*fp32", "out": "*bf16", "res8": "*i8", "res32": "*fp32",
                       "dup8": "*i8", "dup32": "*fp32", "n_valid": "i32", "chunk_elems": "i32",
                       "slot_stride": "i32", "chunk_off": "i32", "rank": "i32", "world": "i32",
                       **TICK}, {"REQUANT": True, "DUAL": True, "TICK": True, "G": 256,
                       "GPP": k.GROUPS_PER_PROGRAM}, 4),
    "dequant_records": (k._dequant_records_kernel, {"src8": "*i8", "src32": "*fp32", "out": "*fp16",
                        "n_valid": "i32", "total": "i32", "rec_stride": "i32", "out_stride": "i32",
                        "chunk_elems": "i32", "skip": "i32", "rec0": "i32", **TICK},
                        {"TICK": True, "G": 128, "GPP": k.GROUPS_PER_PROGRAM}, 4),
    "progress": (k._progress_kernel, dict(TICK), {}, 4),
}
WP2, BLOCK = d.tile_block(8)
COMMON = {"epochs": P, "abort": P, "status": P, "epoch_word": P, **TICK}
for gather in (False, True):
    for dt in ("bf16", "fp32"):
        sig = {"x": "*" + dt, "out": "*" + dt, "slots": "*i64", **COMMON, "numel": "i32",
               "units": "i32", "slot_units": "i32", "rank": "i32", "world": "i32",
               "wait_status": "i32", "done_status": "i32"}
        const = {"GATHER_OUT": gather, "PHASE": 3, "EPW": 2 if dt == "bf16" else 1, "WP2": WP2,
                 "TICK": True, "BLOCK": BLOCK}
        cases[f"direct[ll {'gather' if gather else 'reduce'} {dt}]"] = (d._ll_kernel, sig, const, 4)
for mode in (d.REDUCE, d.GATHER, d.REDUCE_SCATTER, d.GATHER_SUMS):
    for dt in ("bf16", "fp32"):
        sig = {"x": "*" + dt, "out": "*" + dt, "slots": "*" + dt, "flags": P, **COMMON,
               "numel": "i32", "lo": "i32", "hi": "i32", "chunk": "i32", "slot_elems": "i32",
               "res_off": "i32", "rank": "i32", "world": "i32", "wait_status": "i32",
               "done_status": "i32"}
        const = {"MODE": mode, "ROUND": int(mode == d.GATHER_SUMS), "BUMP": mode != d.REDUCE_SCATTER,
                 "PHASE": 3, "WP2": WP2, "TICK": mode != d.REDUCE_SCATTER, "BLOCK": BLOCK}
        cases[f"direct[collect {mode} {dt}]"] = (d._collect_kernel, sig, const, 4)
for dt in ("bf16", "fp32"):
    sig = {"x": "*" + dt, "slots": "*" + dt, "epochs": P, "numel": "i32", "skip_lo": "i32",
           "skip_hi": "i32", "slot_elems": "i32", "rank": "i32", "world": "i32"}
    cases[f"direct[publish {dt}]"] = (d._publish_kernel, sig, {"BLOCK": d.PUBLISH_BLOCK}, 4)
out, ptx = {}, {}
for name, (fn, sig, const, warps) in cases.items():
    sig = {**sig, **{c: "constexpr" for c in const}}
    c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const),
                       target=GPUTarget("cuda", 89, 32), options={"num_warps": warps})
    out[name] = c.metadata.shared
    ptx[name] = c.asm["ptx"]
print("@@" + json.dumps({"shared": out, "ptx": ptx}))
"""


def test_kernels_fit_ada():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.split("@@", 1)[1])
    shared, ptx = got["shared"], got["ptx"]
    assert {"reduce", "copy", "quantize", "dequant_reduce", "dequant_records", "progress"} <= set(shared)
    assert len([n for n in shared if n.startswith("direct[")]) == 14
    assert max(shared.values()) <= 16 * 1024, shared  # Ada allows 99 KB; these are reductions only
    for name, text in ptx.items():
        if not name.startswith("direct["):
            continue
        # no system-scope fence and no atomic on host memory in any direct kernel: the fence
        # between kernels is a stream memory write (`direct.py`)
        assert "membar.sys" not in text and "fence.sc.sys" not in text and "atom." not in text, name
        if "publish" not in name:
            assert "ld.volatile.global" in text, name  # polls never hit a cached line
        if "[ll" in name:
            assert "st.global.b64" in text or "st.global.v2.b64" in text, name  # payload + epoch
