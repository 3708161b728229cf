"""Where one EXL3 prefill call's GPU time goes, kernel by kernel (torch profiler), per path.

    PYTHONPATH=$PWD:$PWD/.whl/ext python3 bench/gpu/exl3_prefill_profile.py [TOKENS] [PATHS]

PATHS: comma-separated Exl3MoE prefill modes (recon, triton); prints a table per path, last."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402
from exl3 import routings  # noqa: E402
from moe_paths import exl3_layer  # noqa: E402

tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
modes = (sys.argv[2] if len(sys.argv) > 2 else "triton,recon").split(",")
layer = exl3_layer(torch, "cuda")
x, ids, w = routings(torch, tokens, 1, "cuda", 7)[0]
for mode in modes:
    layer.prefill_mode = mode
    for _ in range(3):
        layer(x, ids, w)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            layer(x, ids, w)
        torch.cuda.synchronize()
    print(f"== {mode} at {tokens} tokens (5 calls)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
