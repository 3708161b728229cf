"""KDA decode / MTP verification at one TP8 rank of GLM-5.3-Flash (8 heads x 128, conv width 4,
MTP-3: 4 tokens a sequence): glmctl's one-launch kernel (`glmctl.kernels.kda_decode`) against what
vLLM 0.30's layer runs (`causal_conv1d_update`, `fused_recurrent_kda`, `rms_norm_gated`: three
launches), on the GPU at hand.

Cells: 8x4 (8 sequences, the 8x22k decode cell's 32 tokens) and 1x4 (the 1x64k cell). Each row
is a CUDA graph of LAYERS = 34 layers' calls on 34 distinct caches (every layer's recurrent state
streams from DRAM, as in the model), median of REPLAYS replays (torch.cuda.Event) over 34.
Paths: `vllm` (the three kernels as the layer calls them); `glmctl` (the config the launcher picks,
norm fused); `glmctl:<config>` for every config; `glmctl-no-norm` (the picked config without the
norm, then vLLM's norm kernel). `bytes` is what one layer's call must move (recurrent state read
once and written after every token, conv state, inputs, output); `frac_copy` = bytes / time over
the measured device-to-device copy bandwidth; `per_step_us` = 34 x us, the model's KDA share of
one decode step predicted from this row. `max_rel` compares the row's output with vLLM's on the
same inputs. Note: vLLM's conv kernel launches with PDL on sm_90+ only; an sm_89 node has none.

    python bench/gpu/kda_bench.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from bench.kernels_common import copy_bandwidth, graph_calls_us  # noqa: E402

H, D, W, NUM_SPEC, LOWER_BOUND, EPS = 8, 128, 4, 3, -5.0, 1e-5
LAYERS, REPLAYS = 34, 7
CELLS = {"8x4": 8, "1x4": 1}


def make_layer(seqs: int, seed: int, tokens_per_seq: int = NUM_SPEC + 1, spec: bool = True,
               device: str = "cuda") -> dict:
    """One KDA layer's step inputs and caches at the rank's shapes, laid out as vLLM's layer holds
    them: q|k|v|beta as column slices of the in-projection's output, the conv state as the
    transposed view of an SD-layout cache, the recurrent state as a slot-strided view (padded
    slots, like the hybrid KV pool's pages). Sequence n owns slots 1 + C n .. C (n + 1)."""
    g = torch.Generator(device=device).manual_seed(seed)
    cols = NUM_SPEC + 1 if spec else 1
    tokens = seqs * tokens_per_seq
    slots = 1 + seqs * cols
    proj = torch.randn(tokens, 3 * H * D + H + 2 * D, generator=g, device=device).to(torch.bfloat16)
    cache_sd = torch.randn(slots, W - 1 + NUM_SPEC, 3 * H * D, generator=g, device=device).to(torch.bfloat16)
    pool = torch.randn(slots, H * D * D + 1024, generator=g, device=device) * 0.05
    layer = dict(
        qkv=proj[:, : 3 * H * D], beta=proj[:, 3 * H * D : 3 * H * D + H].unsqueeze(0),
        conv_state=cache_sd.transpose(1, 2),
        conv_w=torch.randn(3 * H * D, W, generator=g, device=device) * 0.5,
        g1=torch.randn(1, tokens, H, D, generator=g, device=device).to(torch.bfloat16),
        a_log=torch.randn(1, 1, H, 1, generator=g, device=device) * 0.3,
        g_bias=torch.randn(H * D, generator=g, device=device) * 0.2,
        state=pool[:, : H * D * D].view(slots, H, D, D),
        norm_gate=torch.randn(tokens, H, D, generator=g, device=device).to(torch.bfloat16),
        norm_w=(torch.rand(D, generator=g, device=device) + 0.5).to(torch.bfloat16),
        cu=torch.arange(0, tokens + 1, tokens_per_seq, dtype=torch.int32, device=device),
        out=torch.empty(1, tokens, H, D, dtype=torch.bfloat16, device=device),
        conv_out=torch.empty(tokens, 3 * H * D, dtype=torch.bfloat16, device=device),
        counters=torch.zeros(seqs * H, dtype=torch.int32, device=device),
    )
    base = 1 + torch.arange(seqs, device=device, dtype=torch.int32)[:, None] * cols
    if spec:
        layer["idx"] = base + torch.arange(cols, device=device, dtype=torch.int32)[None, :]
        layer["acc"] = torch.randint(1, cols + 1, (seqs,), generator=g, device=device, dtype=torch.int32)
    else:
        layer["idx"], layer["acc"] = base[:, 0].contiguous(), None
    return layer


def clone_caches(layer: dict) -> dict:
    out = dict(layer)
    out["conv_state"] = layer["conv_state"].clone()
    out["state"] = layer["state"].clone()
    out["out"] = torch.empty_like(layer["out"])
    out["conv_out"] = torch.empty_like(layer["conv_out"])
    return out


def vllm_step(layer: dict, norm: bool = True) -> torch.Tensor:
    """What vLLM 0.30's Glm5NextLinearAttention runs on a pure decode / MTP-verify step (conv
    output into its own buffer instead of over the projections: the same bytes)."""
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update
    from vllm.models.glm5next.nvidia.ops.third_party.kda import fused_recurrent_kda

    spec = layer["acc"] is not None
    seqs = layer["cu"].numel() - 1
    conv_idx = layer["idx"][:, 0][:seqs] if spec else layer["idx"][:seqs]
    kwargs = dict(num_accepted_tokens=layer["acc"], query_start_loc=layer["cu"],
                  max_query_len=layer["idx"].shape[1]) if spec else {}
    x = causal_conv1d_update(layer["qkv"], layer["conv_state"], layer["conv_w"], None, activation="silu",
                             conv_state_indices=conv_idx, out=layer["conv_out"], **kwargs)
    q, k, v = (t.reshape(1, -1, H, D) for t in x.split(H * D, dim=-1))
    fused_recurrent_kda(q=q, k=k, v=v, g=layer["g1"], beta=layer["beta"], initial_state=layer["state"],
                        use_qk_l2norm_in_kernel=True, cu_seqlens=layer["cu"], ssm_state_indices=layer["idx"],
                        num_accepted_tokens=layer["acc"], out=layer["out"], sigmoid_beta=True,
                        a_log=layer["a_log"], g_bias=layer["g_bias"], compute_gate=True, lower_bound=LOWER_BOUND)
    if norm:
        vllm_norm(layer)
    return layer["out"][0]


def vllm_norm(layer: dict) -> None:
    from vllm.third_party.flash_linear_attention.ops.kda import rms_norm_gated

    rms_norm_gated(layer["out"], layer["norm_gate"], layer["norm_w"], None, activation="sigmoid", eps=EPS)


def glmctl_step(layer: dict, config=None, norm: bool = True) -> torch.Tensor:
    from glmctl.kernels.kda_decode import kda_decode

    return kda_decode(layer["qkv"], layer["conv_state"], layer["conv_w"], layer["g1"], layer["beta"][0],
                      layer["a_log"], layer["g_bias"], layer["state"], layer["cu"], layer["idx"], LOWER_BOUND,
                      num_accepted_tokens=layer["acc"], out=layer["out"][0],
                      norm_gate=layer["norm_gate"] if norm else None, norm_weight=layer["norm_w"], norm_eps=EPS,
                      counters=layer["counters"], config=config)


def step_bytes(layer: dict) -> int:
    seqs, tokens = layer["cu"].numel() - 1, layer["qkv"].shape[0]
    state = H * D * D * layer["state"].element_size()
    width = layer["conv_state"].shape[2]
    conv = seqs * 3 * H * D * 2 * ((W - 1) + min(width, W - 2 + tokens // seqs))
    inputs = tokens * (3 * H * D + H + 2 * H * D) * 2  # qkv, beta, gate logits, norm gate
    return seqs * state + tokens * state + conv + inputs + tokens * H * D * 2


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def cell_rows(cell: str, seqs: int, bw: float) -> list[dict]:
    from glmctl.kernels.kda_decode import CONFIGS, choose_config

    layers = [make_layer(seqs, seed=100 * seqs + i) for i in range(LAYERS)]
    probe = make_layer(seqs, seed=7)
    want = vllm_step(clone_caches(probe)).clone()
    picked = choose_config(seqs * H, D)
    paths = {"vllm": vllm_step, f"glmctl ({picked.name})": glmctl_step,
             "glmctl-no-norm + vllm norm": lambda L: (glmctl_step(L, norm=False), vllm_norm(L))}
    for cfg in CONFIGS.values():
        if cfg is not picked:
            paths[f"glmctl:{cfg.name}"] = lambda L, c=cfg: glmctl_step(L, config=c)
    rows = []
    nbytes = step_bytes(layers[0])
    for name, fn in paths.items():
        check = clone_caches(probe)
        fn(check)
        err = max_rel(check["out"][0], want)
        us = graph_calls_us([lambda L=L, fn=fn: fn(L) for L in layers], REPLAYS)
        rows.append(dict(cell=cell, path=name, us=round(us, 2), per_step_us=round(LAYERS * us, 1),
                         bytes=nbytes, gb_s=round(nbytes / us / 1e3, 1),
                         frac_copy=round(nbytes / (us * 1e-6) / bw, 3), max_rel=float(f"{err:.2e}")))
        print(f"  {cell} {name}: {us:.2f} us", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "kda-bench.json"))
    args = ap.parse_args()
    start = time.time()
    bw = copy_bandwidth()[0]
    device = torch.cuda.get_device_name()
    rows = []
    for cell, seqs in CELLS.items():
        rows += cell_rows(cell, seqs, bw)
    record = dict(device=device, copy_gb_s=round(bw / 1e9, 1), layers=LAYERS, replays=REPLAYS,
                  shapes=dict(heads=H, head_dim=D, conv_width=W, num_spec=NUM_SPEC), rows=rows,
                  seconds=round(time.time() - start, 1))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"\n{device}, copy {bw / 1e9:.0f} GB/s; one layer's call, graph of {LAYERS} layers "
          f"(per_step = {LAYERS} layers); written {args.out}")
    print(f"{'cell':5} {'path':32} {'us':>7} {'per_step_us':>11} {'MB':>6} {'GB/s':>7} {'frac':>6} {'max_rel':>9}")
    for r in rows:
        print(f"{r['cell']:5} {r['path']:32} {r['us']:7.2f} {r['per_step_us']:11.1f} {r['bytes'] / 1e6:6.2f} "
              f"{r['gb_s']:7.1f} {r['frac_copy']:6.3f} {r['max_rel']:9.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
