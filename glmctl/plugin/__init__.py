"""The vLLM 0.30 general plugin (entry point `vllm.general_plugins: glmctl`)."""


def register() -> None:
    """Called by vLLM in every process; must be idempotent and cheap when nothing is needed."""
    return None
