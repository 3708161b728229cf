"""vllm-lane fixtures: one real tiny vLLM server per test session, shared by every test that needs
a live OpenAI-compatible endpoint (serve, eval, bench, plugin tests), so CI pays for few start-ups.

    def test_something(tiny_server):
        httpx.post(f"{tiny_server.api_url}/completions", json={"model": tiny_server.model, ...})

The server is the `tiny-cpu` profile started through glmctl's own library API
(`glmctl.serving.server.start_server`), on a free loopback port, with its run directory (rendered
config, env, vLLM's log) in the session's temp dir. Treat it as shared: do not stop it, do not
depend on requests other tests sent (metrics counters only ever grow).

Which checkpoint: the tiny GLM-5.3-Flash one (`tiny_checkpoint`) once vLLM CPU can serve it with
the plugin; until then a tiny Llama (vLLM CPU serves Llama unmodified) under the same profile.
GLMCTL_TEST_TINY_MODEL=glm|llama overrides the default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

# Flip to "glm" when main serves the tiny GLM-5.3-Flash checkpoint on vLLM CPU (plugin, issue 5).
DEFAULT_TINY_MODEL = "llama"


@dataclass(frozen=True)
class TinyServer:
    base_url: str
    """http://127.0.0.1:PORT (no /v1)."""
    api_url: str
    """base_url + "/v1", for OpenAI clients."""
    model: str
    """The served model name to put in requests."""
    checkpoint: Path
    architecture: str
    """"glm" or "llama": which tiny checkpoint is being served."""
    log_path: Path
    run_dir: Path
    pid: int


def tiny_model_kind() -> str:
    kind = os.environ.get("GLMCTL_TEST_TINY_MODEL", DEFAULT_TINY_MODEL)
    if kind not in ("glm", "llama"):
        raise pytest.UsageError(f"GLMCTL_TEST_TINY_MODEL must be glm or llama, not {kind!r}")
    return kind


@pytest.fixture(scope="session")
def tiny_llama_checkpoint(tmp_path_factory) -> Path:
    from tests.vllm.tiny_llama import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "ckpt")


@pytest.fixture(scope="session")
def tiny_server_checkpoint(request) -> tuple[str, Path]:
    """(kind, path) of the checkpoint the shared tiny server serves."""
    kind = tiny_model_kind()
    if kind == "glm":
        return kind, Path(request.getfixturevalue("tiny_checkpoint").path)
    return kind, request.getfixturevalue("tiny_llama_checkpoint")


def tiny_profile(kind: str):
    """The tiny-cpu profile, under a served name that says which checkpoint it is."""
    from glmctl.serving import profiles

    prof = profiles.load("tiny-cpu")
    if kind == "llama":
        prof = prof.model_copy(update={"model": prof.model.model_copy(update={"served_name": "tiny-llama"})})
    return prof


@pytest.fixture(scope="session")
def tiny_server(tiny_server_checkpoint, tmp_path_factory):
    from glmctl.serving.server import start_server

    kind, checkpoint = tiny_server_checkpoint
    run_dir = tmp_path_factory.mktemp("tiny-server")
    # check=False: the preflight (and its vLLM parser pass, ~20 s here) is tested on its own in
    # tests/vllm/test_serve.py; this fixture is about a server to talk to.
    server = start_server(tiny_profile(kind), model=checkpoint, port=None, run_dir=run_dir, check=False,
                          timeout_s=900)
    info = server.info
    try:
        yield TinyServer(
            base_url=info.base_url, api_url=f"{info.base_url}/v1", model=info.model, checkpoint=checkpoint,
            architecture=kind, log_path=info.log_path, run_dir=run_dir, pid=info.pid,
        )
    finally:
        server.stop()
