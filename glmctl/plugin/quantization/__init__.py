"""Quantization methods vLLM builds GLM-5.3-Flash layers with: EXL3 routed experts (`exl3_*`) and
block-FP8 attention projections (`fp8_*`) (vLLM: `model_executor/layers/quantization/`)."""
