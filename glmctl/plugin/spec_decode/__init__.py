"""Speculative decoding on GLM-5.3-Flash: the MTP drafter across two KV-cache groups, and DFlash2
drafting (aux hidden states, the selector walk, the drafter's pages in the target's pool) (vLLM:
`v1/spec_decode/`)."""
