"""Import the collectives' kernel modules under the Triton interpreter for the CPU unit lane.

The interpreter is chosen when triton is first imported (triton.language's own @jit helpers are
built then), so this works only if triton is not yet imported, or was imported interpreted. If not,
`load()` returns None and the test module re-runs itself in a fresh process (`rerun_fresh`).
"""

from __future__ import annotations

import importlib
import os
import sys

from glmctl.kernels.triton_env import run_in_fresh_interpreter_process

from tests.conftest import REPO

# the data paths after the kernels they launch, the dispatch table (datapath) after the paths
NAMES = ("glmctl.collectives.kernels", "glmctl.collectives.direct_kernels",
         "glmctl.collectives.direct_int8_kernels", "glmctl.collectives.direct",
         "glmctl.collectives.datapath")


def _triton_interpreted() -> bool:
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.max, InterpretedFunction)


def load():
    """(kernels, direct_kernels, direct_int8_kernels, direct, datapath) built for the
    interpreter, or None when impossible."""
    if "triton" in sys.modules and not _triton_interpreted():
        return None
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        mods = []
        for name in NAMES:
            mod = sys.modules.get(name)
            if mod is None:
                mod = importlib.import_module(name)
            elif type(getattr(mod, "_reduce_kernel", None)).__name__ == "JITFunction" or name.endswith(
                    ("direct_kernels", "direct_int8_kernels", "direct", "datapath")):
                mod = importlib.reload(mod)
            mods.append(mod)
        return tuple(mods)
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


def rerun_fresh(path: str) -> None:
    """Run the test file in a fresh interpreted process; fails unless it passed >= 1 test, none failed."""
    run_in_fresh_interpreter_process(path, timeout=900, cwd=str(REPO))
