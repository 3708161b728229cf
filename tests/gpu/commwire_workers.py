"""Rank body for the vLLM-path gpu test: glmctl's host-staged collectives called the way vLLM 0.30
calls its TP communicator (vLLM itself does not run on the GPU test machine).

`CudaCommunicator`'s role is played by a bare object whose own all_reduce / all_gather raise, so a
call that falls back to vLLM's path fails loudly; `glmctl.plugin.distributed.tp_communicator._route` installs the
host-staged routes on it exactly as it does on vLLM's instance. Capture follows
`GroupCoordinator.graph_capture` + `CUDAGraphWrapper`: a side stream, `ca_comm.capture()` around
everything, one eager warm-up run per size, then `torch.cuda.graph(g, stream=current stream)`.
"""

from __future__ import annotations

from types import SimpleNamespace

MiB = 1 << 20
HIDDEN = 1024
CAPTURE_SIZES = (1, 8, 48)


def _gen(seed: int, shape, dtype, torch):
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    return torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)


def _fp32_rank_order_sum(parts, torch):
    """What the host-staged all-reduce computes: fp32 sums in rank order, cast once."""
    acc = torch.zeros_like(parts[0], dtype=torch.float32)
    for p in parts:
        acc += p.float()
    return acc.to(parts[0].dtype)


def _checksum(t, torch) -> int:
    w = t.contiguous().view(-1).view(torch.uint8).to(torch.int64)
    return int((w * (torch.arange(w.numel(), device=w.device) % 65521 + 1)).sum().item())


def vllm_path(rank: int, world: int, session: str, replays: int) -> dict:
    import torch

    torch.cuda.set_device(0)
    from glmctl.collectives import HostStagedCommunicator
    from glmctl.plugin.distributed.tp_communicator import (
        HostStagedCustomAllreduce,
        ModelFacts,
        _route,
        capture_warmup,
    )

    def vllm_fallback(*args, **kwargs):
        raise AssertionError("the call fell back to vLLM's own path")

    comm = HostStagedCommunicator(rank, world, session, 1 * MiB, timeout_s=30)
    facts = ModelFacts(hidden_size=HIDDEN, elem_bytes=2, max_batched_tokens=2048,
                       capture_sizes=CAPTURE_SIZES)
    int8_min = 256 * 1024
    ca = HostStagedCustomAllreduce(comm, int8_min_bytes=int8_min, warmup=capture_warmup(comm, facts))
    dc = SimpleNamespace(unique_name="tp:0", all_reduce=vllm_fallback, all_gather=vllm_fallback,
                         all_gatherv=vllm_fallback, destroy=lambda: None)
    _route(dc, ca)
    res: dict = {"eager": {}, "checksums": []}
    try:
        # eager: decode-size (bf16, exact) and a 4 MiB prefill message (INT8, in 4 pieces)
        for name, tokens, seed in (("decode", 48, 11), ("prefill_int8", 2048, 12)):
            parts = [_gen(seed * 100 + j, (tokens, HIDDEN), torch.bfloat16, torch) for j in range(world)]
            x = parts[rank].clone()
            y = dc.all_reduce(x)
            assert torch.equal(x, parts[rank]), "all_reduce changed its input"
            if y.numel() * 2 >= int8_min:
                ref = sum(p.double() for p in parts)
                err = ((y.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
                res["eager"][name] = {"int8_rel_rms": err, "ok": err <= 0.01}
            else:
                res["eager"][name] = {"exact": bool(torch.equal(y, _fp32_rank_order_sum(parts, torch)))}
            res["checksums"].append(_checksum(y, torch))
        # the logits gather ([tokens, vocab / tp] along -1), token ids (int64), a gather in pieces
        for name, shape, dtype, dim in (("logits", (37, 1000), torch.bfloat16, -1),
                                        ("logits_fp32", (5, 777), torch.float32, -1),
                                        ("ids", (37, 4), torch.int64, -1),
                                        ("pieces", (300, 2000), torch.float32, -1),
                                        ("rows", (33, 64), torch.bfloat16, 0)):
            parts = [_gen(7000 + 10 * j + len(name), shape, torch.float32, torch) * 1000
                     for j in range(world)]
            parts = [p.to(dtype) for p in parts]
            got = dc.all_gather(parts[rank].clone(), dim) if name != "rows" else \
                dc.all_gatherv(parts[rank].clone(), 0, [shape[0]] * world)
            res["eager"][name] = {"exact": bool(torch.equal(got, torch.cat(parts, dim)))}
            res["checksums"].append(_checksum(got, torch))
        # capture as vLLM does, then replay with fresh inputs written into the static buffers
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graphs = {}
        with torch.cuda.stream(stream), ca.capture():
            for tokens in CAPTURE_SIZES:
                x = torch.zeros((tokens, HIDDEN), dtype=torch.bfloat16, device="cuda")

                def layer_pair(x=x):
                    h = dc.all_reduce(x)  # attention output projection
                    return h, dc.all_reduce(h + x)  # MoE / MLP output

                layer_pair()  # vLLM's one eager warm-up run per captured size
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=torch.cuda.current_stream()):
                    h, h2 = layer_pair()
                graphs[tokens] = (g, x, h, h2)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        bad, exact = 0, 0
        for it in range(replays):
            for tokens, (g, x, h, h2) in graphs.items():
                parts = [_gen(31 * it + 7 * j + tokens, (tokens, HIDDEN), torch.bfloat16, torch)
                         for j in range(world)]
                x.copy_(parts[rank])
                g.replay()
                want_h = _fp32_rank_order_sum(parts, torch)
                want_h2 = _fp32_rank_order_sum([want_h + p for p in parts], torch)
                ok = torch.equal(h, want_h) and torch.equal(h2, want_h2)
                exact += ok
                bad += not ok
        torch.cuda.synchronize()
        res["graph"] = {"replays": replays * len(graphs), "exact": exact, "bad": bad}
        comm.check()
    finally:
        dc.destroy()
    res["closed"] = comm.disabled
    return res
