"""What one vLLM platform needs beyond the adapters every platform shares: `cuda_ops` (the
GLM-5.3-Flash pieces vLLM runs only on sm_90+, given an sm_8x path) and `cpu` (vLLM CPU).
(vLLM: `platforms/`, and the GPU ops its glm5next model binds by name.)"""
