"""Fixtures shared by the vllm lane (tests that start real vLLM processes on the CPU)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_server(tiny_checkpoint, tmp_path_factory):
    """The tiny GLM-5.3-Flash checkpoint served by a real `vllm serve` with the glmctl plugin.

    One process group for the whole session (start-up is ~30 s on 2 cores); `.base_url`, `.post()`,
    `.get()`, `.log_text()`. See tests/vllm/plugin_servers.py for the exact command line.
    """
    from tests.vllm.plugin_servers import start_server

    server = start_server(tiny_checkpoint.path, tmp_path_factory.mktemp("tiny-server") / "vllm.log")
    yield server
    server.stop()
