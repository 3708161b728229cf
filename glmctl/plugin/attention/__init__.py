"""The sparse-MLA attention backend, the kpool indexer op and the per-target kernel table they
call (vLLM: `v1/attention/backends/`, `model_executor/layers/sparse_attn_indexer_kpool.py`)."""
