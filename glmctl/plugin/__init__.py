"""The vLLM 0.30 general plugin (entry point `vllm.general_plugins: glmctl`).

vLLM calls `register()` in every process it starts (API server, engine core, workers). It is
idempotent and imports nothing heavy until it knows it has work to do; see `policy` for when
it acts and `activation` for what it installs.
"""


def register() -> None:
    """Called by vLLM in every process; idempotent, and a no-op where nothing is needed. The
    switches (`glmctl.switches`) are read once here and handed to each installer."""
    from glmctl import switches
    from glmctl.plugin.activation import register_once
    from glmctl.plugin.distributed.tp_communicator import install_collectives
    from glmctl.plugin.quantization.exl3_config import register_exl3_quantization
    from glmctl.plugin.quantization.fp8_attention import install_fp8_attention

    env = switches.snapshot()
    register_exl3_quantization(env)  # EXL3-experts checkpoints on any platform; GLMCTL_EXL3=off skips it
    register_once(env)
    install_fp8_attention(env)  # block-FP8 attention projections on any platform; GLMCTL_FP8_ATTENTION=off skips it
    install_collectives(env)  # only GLMCTL_COLLECTIVES=host-staged|auto on CUDA; else nothing is touched
