"""vLLM's mHC (hyper-connection) ops on every platform the plugin serves: which path runs them, and
glmctl's Triton kernels registered as torch ops (vLLM: `model_executor/layers/mhc.py`)."""
