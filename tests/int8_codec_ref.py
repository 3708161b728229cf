"""INT8 payload codec, torch reference for the tests: the record format of
`glmctl.collectives.call_plan.Int8Layout`, written plainly.

The Triton kernels in `glmctl/collectives/kernels.py` produce the same records (up to a one-step
rounding difference where the GPU contracts a multiply-add); tests compare the two, and bound the
round-trip error:
per element at most half a quantization step, `amax(group) / 254`.
"""

from __future__ import annotations

import torch

from glmctl.collectives.call_plan import Int8Layout, int8_layout

QMAX = 127.0


def quantize_int8_ref(x: torch.Tensor, layout: Int8Layout) -> torch.Tensor:
    """Records of the flat message `x` (any float dtype): a uint8 tensor of `layout.total_bytes`."""
    flat = x.reshape(-1).to(torch.float32)
    numel = flat.numel()
    padded = layout.chunks * layout.chunk_elems
    if numel > padded:
        raise ValueError(f"{numel} elements do not fit {layout}")
    v = torch.zeros(padded, dtype=torch.float32, device=x.device)
    v[:numel] = flat
    groups = v.view(layout.chunks, layout.groups_per_chunk, layout.group)
    amax = groups.abs().amax(dim=-1)
    scale = amax / QMAX
    inv = torch.where(amax > 0, QMAX / amax, torch.zeros_like(amax))
    y = groups * inv.unsqueeze(-1)
    half = torch.where(y >= 0, 0.5, -0.5)
    q = torch.trunc(y + half).clamp_(-QMAX, QMAX).to(torch.int8)
    out = torch.zeros(layout.chunks, layout.record_bytes, dtype=torch.uint8, device=x.device)
    out[:, : layout.chunk_elems] = q.view(layout.chunks, -1).view(torch.uint8)
    s0, s1 = layout.scales_offset, layout.scales_offset + 4 * layout.groups_per_chunk
    out[:, s0:s1] = scale.contiguous().view(torch.uint8).view(layout.chunks, -1)
    return out.view(-1)


def dequantize_int8_ref(
    records: torch.Tensor, layout: Int8Layout, numel: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The flat message of `numel` elements back from its records, as `q * scale` in fp32, then cast."""
    rec = records.view(torch.uint8).reshape(layout.chunks, layout.record_bytes)
    q = rec[:, : layout.chunk_elems].contiguous().view(torch.int8).to(torch.float32)
    s0, s1 = layout.scales_offset, layout.scales_offset + 4 * layout.groups_per_chunk
    scale = rec[:, s0:s1].contiguous().view(torch.float32)
    x = q.view(layout.chunks, layout.groups_per_chunk, layout.group) * scale.unsqueeze(-1)
    return x.reshape(-1)[:numel].to(dtype)


def int8_round_trip_ref(x: torch.Tensor, chunks: int = 1, group: int = 128) -> torch.Tensor:
    layout = int8_layout(x.numel(), chunks, group)
    return dequantize_int8_ref(quantize_int8_ref(x, layout), layout, x.numel(), x.dtype).view_as(x)


def all_reduce_int8_ref(inputs: list[torch.Tensor], *, two_shot: bool, group: int = 128) -> torch.Tensor:
    """What the INT8 all-reduce computes: every contribution quantized once, dequantized and summed in
    fp32 in rank order; two-shot re-quantizes each reduced chunk once more for the all-gather hop."""
    world = len(inputs)
    numel = inputs[0].numel()
    chunks = world if two_shot else 1
    layout = int8_layout(numel, chunks, group)
    acc = torch.zeros(numel, dtype=torch.float32, device=inputs[0].device)
    for x in inputs:
        acc += dequantize_int8_ref(quantize_int8_ref(x, layout), layout, numel)
    if two_shot:
        acc = dequantize_int8_ref(quantize_int8_ref(acc, layout), layout, numel)
    return acc.to(inputs[0].dtype).view_as(inputs[0])


def direct_two_shot_int8_ref(inputs: list[torch.Tensor], group: int = 128) -> torch.Tensor:
    """What the direct path's INT8 two-shot all-reduce computes (`direct_int8_kernels`): chunk c
    of the message (the `world`-chunk layout) is reduced by rank c, in fp32 in rank order, from
    the peers' INT8 records and rank c's own native elements; the sum is encoded once more and
    every rank, rank c included, decodes that record."""
    world, numel = len(inputs), inputs[0].numel()
    layout = int8_layout(numel, world, group)
    decoded = [dequantize_int8_ref(quantize_int8_ref(x, layout), layout, numel) for x in inputs]
    out = torch.zeros(numel, dtype=torch.float32, device=inputs[0].device)
    for c in range(world):
        lo, hi = min(c * layout.chunk_elems, numel), min((c + 1) * layout.chunk_elems, numel)
        acc = torch.zeros(hi - lo, dtype=torch.float32, device=out.device)
        for j in range(world):
            acc += (inputs[j].reshape(-1)[lo:hi].float() if j == c else decoded[j][lo:hi])
        out[lo:hi] = acc
    out = dequantize_int8_ref(quantize_int8_ref(out, layout), layout, numel)
    return out.to(inputs[0].dtype).view_as(inputs[0])
