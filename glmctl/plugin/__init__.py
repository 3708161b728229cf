"""The vLLM 0.30 general plugin (entry point `vllm.general_plugins: glmctl`).

vLLM calls `register()` in every process it starts (API server, engine core, workers). It is
idempotent and imports nothing heavy until it knows it has work to do; see `policy` for when
it acts and `activation` for what it installs.
"""


def register() -> None:
    """Called by vLLM in every process; idempotent, and a no-op where nothing is needed."""
    from glmctl.plugin.activation import register_once

    register_once()
