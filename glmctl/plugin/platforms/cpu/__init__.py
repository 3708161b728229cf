"""What only vLLM's CPU platform needs: torch versions of the Triton kernels the model, MTP, DFlash
and the indexer metadata builder launch there (`cpu_ops`, `cpu_mtp`, `dflash2_cpu`, `cpu_metadata`),
and the import fix for installs without torchvision (`env_fixes`)."""
