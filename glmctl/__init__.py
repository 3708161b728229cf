"""glmctl: serve GLM-5.3-Flash with stock vLLM 0.30 on Ada/Ampere nodes without GPU peer-to-peer.

Importing this package is cheap: it must never pull in torch, triton, transformers or vllm, so that
`glmctl --help`, shell completion and `glmctl plan` stay fast on any machine.
"""

__version__ = "0.1.0"
