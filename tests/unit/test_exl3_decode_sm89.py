"""Every launch of the EXL3 decode path (glmctl.kernels.exl3_moe_decode, exl3_moe_rotate,
exl3_coop_io) fits Ada: cross-compiled for sm_89 at GLM-5.3-Flash's TP8 shape with
`triton.compile` (arguments specialised as glmctl.kernels.sm89_check specialises them), <= 99 KB
of shared memory per program, no Hopper wgmma, no register spills, and the trellis decode
compiled to the instructions it was written for (32-bit multiply, dp4a). The decode configs'
weight kernels (gate/up, down; 16-slot runs) hold <= 128 registers per thread, so an SM keeps
>= 4 of their 4-warp programs in flight: their loop is integer-issue bound and needs warps to hide
latency. The same kernels compiled for sm_90 (the H200 stand-in) must not use wgmma either: every
product has the run's 16 slots as M, below wgmma's 64, so Hopper runs the mma.sync code Ada runs.
The prefill configs (32/64-slot runs, glmctl.kernels.exl3_moe_prefill) feed each decoded weight
to 2-4x the rows, so fewer warps hide the decode; they are held to no spills (on sm_89 149-194
registers at 8 warps, capping them at 128 spills), and the 64-slot ones reach wgmma's M on sm_90:
the H200's prefill benches set DISABLE_MMA_V3=1 (bench/gpu/quick_round.sh) so Hopper runs Ada's
mma.sync there, and the sm_90 check here covers the decode configs. Runs in a fresh
process: the unit lane's kernel tests load the kernels into the interpreter, which cannot
compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SM89_SHARED_LIMIT = 99 * 1024
SCRIPT = textwrap.dedent("""
    import json
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from glmctl.kernels import sm89_check

    configs = list(sm89_check._exl3_configs())
    weights = [c for c in configs if c[0].startswith(("exl3_decode_gate_up", "exl3_decode_down"))
               and "[prefill" not in c[0]]
    for arch, (name, fn, types, constexprs, options) in [(89, c) for c in configs] + [(90, c) for c in weights]:
        names = fn.arg_names
        signature = {n: types.get(n, "constexpr") for n in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                 if signature[n].startswith("*") or n in sm89_check.DIVISIBLE}
        src = ASTSource(fn=fn, signature=signature, attrs=attrs,
                        constexprs={(names.index(k),): v for k, v in constexprs.items()})
        k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
        ptx = k.asm["ptx"]
        print(json.dumps({"kernel": name, "arch": arch, "shared": k.metadata.shared, "wgmma": "wgmma" in ptx,
                          "local_loads": ptx.count("ld.local"), "dp4a": ptx.count("dp4a.u32.u32"),
                          "mul32": ptx.count("mul.lo.s32") + ptx.count("mul.lo.u32"),
                          **sm89_check._cubin_resources(k.asm.get("cubin"))}), flush=True)
""")


@pytest.mark.slow
def test_exl3_decode_kernels_fit_sm89():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=1500)
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert result.returncode == 0, result.stderr[-3000:]
    kinds = {row["kernel"].split("[")[0] for row in rows}
    assert kinds >= {"exl3_decode_prologue", "exl3_decode_gate_up", "exl3_decode_finish", "exl3_decode_down",
                     "exl3_decode_combine", "exl3_coop_inputs"}
    assert {row["arch"] for row in rows} == {89, 90}
    for row in rows:
        assert 0 <= row["shared"] <= SM89_SHARED_LIMIT, row
        assert not row["wgmma"] and row["local_loads"] == 0, row
        assert row["spills"] in (0, None), row
        if row["kernel"].startswith(("exl3_decode_gate_up", "exl3_decode_down")):
            assert row["dp4a"] > 0 and row["mul32"] > 0, row  # the codebook: imul + dp4a, no 64-bit math
            if "[prefill" not in row["kernel"]:
                assert row["regs"] is None or row["regs"] <= 128, row
