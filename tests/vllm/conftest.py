"""vllm-lane fixtures: one real tiny vLLM server per test session, shared by every test that needs
a live OpenAI-compatible endpoint (serve, eval, bench, plugin tests), so CI pays for few start-ups.

    def test_something(tiny_server):
        httpx.post(f"{tiny_server.api_url}/completions", json={"model": tiny_server.model, ...})

`tiny_server` is the `tiny-cpu` profile started through glmctl's own library API
(`glmctl.serving.server.start_server`): the tiny GLM-5.3-Flash checkpoint (`tiny_checkpoint`) on
vLLM CPU with the glmctl plugin, on a free loopback port, its run directory (rendered config, env,
vLLM's log) in the session's temp dir. It is defined only where the plugin's CPU path is installed
(vLLM CPU cannot serve the model without it), so `request.getfixturevalue("tiny_server")` raises
FixtureLookupError elsewhere. Treat it as shared: do not stop it; metrics counters only grow.

`tiny_served` is the same server where the plugin is there, and otherwise a tiny random Llama
(which vLLM CPU serves unmodified) under the same profile: what glmctl's own launch tests need.
GLMCTL_TEST_TINY_MODEL=glm|llama overrides that choice.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.vllm.plugin_servers import ServerHttp


def plugin_serves_tiny_glm() -> bool:
    """The plugin's CPU path (issue 5) is what lets vLLM CPU serve GLM-5.3-Flash at all."""
    return importlib.util.find_spec("glmctl.plugin.activation") is not None


def tiny_model_kind() -> str:
    kind = os.environ.get("GLMCTL_TEST_TINY_MODEL") or ("glm" if plugin_serves_tiny_glm() else "llama")
    if kind not in ("glm", "llama"):
        raise pytest.UsageError(f"GLMCTL_TEST_TINY_MODEL must be glm or llama, not {kind!r}")
    return kind


@dataclass(frozen=True)
class TinyServer(ServerHttp):
    base_url: str
    """http://127.0.0.1:PORT (no /v1)."""
    model: str
    """The served model name to put in requests."""
    architecture: str
    """"glm" (the tiny GLM-5.3-Flash checkpoint) or "llama"."""
    checkpoint: Path
    """The weights being served (load them in transformers for parity checks)."""
    log_path: Path
    run_dir: Path
    pid: int
    """vLLM's server process, leader of its own process group."""

    @property
    def api_url(self) -> str:
        return f"{self.base_url}/v1"

    @property
    def url(self) -> str:
        return self.base_url


@pytest.fixture(scope="session")
def tiny_llama_checkpoint(tmp_path_factory) -> Path:
    from tests.vllm.tiny_llama import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "ckpt")


@pytest.fixture(scope="session")
def tiny_launch_target(request) -> tuple[str, Path]:
    """(kind, checkpoint directory) that the tiny-cpu profile serves in this session."""
    kind = tiny_model_kind()
    if kind == "glm":
        return kind, Path(request.getfixturevalue("tiny_checkpoint").path)
    return kind, request.getfixturevalue("tiny_llama_checkpoint")


def tiny_profile(kind: str):
    """The tiny-cpu profile; for the Llama stand-in, under a name that says what it is."""
    from glmctl.serving import profiles

    prof = profiles.load("tiny-cpu")
    if kind == "llama":
        prof = prof.model_copy(update={"model": prof.model.model_copy(update={"served_name": "tiny-llama"})})
    return prof


@pytest.fixture(scope="session")
def tiny_served(tiny_launch_target, tmp_path_factory):
    from glmctl.serving.server import start_server

    kind, checkpoint = tiny_launch_target
    run_dir = tmp_path_factory.mktemp("tiny-server")
    # check=False: the preflight (and its vLLM parser pass, ~20 s here) is tested on its own in
    # tests/vllm/test_serve.py; this fixture is about a server to talk to.
    server = start_server(tiny_profile(kind), model=checkpoint, port=None, run_dir=run_dir, check=False,
                          timeout_s=900)
    info = server.info
    try:
        yield TinyServer(base_url=info.base_url, model=info.model, architecture=kind, checkpoint=checkpoint,
                         log_path=info.log_path, run_dir=run_dir, pid=info.pid)
    finally:
        server.stop()


if plugin_serves_tiny_glm():

    @pytest.fixture(scope="session")
    def tiny_server(tiny_served):
        if tiny_served.architecture != "glm":
            pytest.skip("GLMCTL_TEST_TINY_MODEL=llama: the shared tiny GLM server is not running")
        return tiny_served
