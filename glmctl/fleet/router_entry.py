"""Run vllm-router's own launcher, unchanged, as `glmctl fleet up` supervises it.

    python -m glmctl.fleet.router_entry --worker-urls http://127.0.0.1:8001 ... --policy sticky_least_loaded

The same as the `vllm-router` script, except that under a glmctl supervisor the kernel stops the
router if glmctl dies (even by SIGKILL), as it does vLLM (`glmctl.serving.vllm_entry`).
"""

from __future__ import annotations

import sys

from glmctl.serving.vllm_entry import stop_with_supervisor


def main() -> None:
    stop_with_supervisor()
    from vllm_router.launch_router import main as router_main

    sys.argv = ["vllm-router", *sys.argv[1:]]
    router_main()


if __name__ == "__main__":
    main()
