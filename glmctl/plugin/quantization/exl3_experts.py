"""Routed experts of one MoE layer on one TP rank, run by exllamav3 1.6.5's fused MoE kernel.

No vLLM here (the vLLM adapter is glmctl.plugin.quantization.exl3_method): plain torch tensors in the
glmctl-exl3/1 layout (glmctl.quantize.exl3_format) and `exllamav3_ext` ops, so the gpu lane and
bench/exl3.py run it on a machine without vLLM. `moe_reference` / `dequantize` beside it are the
torch references.

How a forward runs (T tokens, top-k experts each, E local experts, R = FUSED_ROWS):
  1. x (bf16) -> fp16, the kernel's only activation type: values beyond +-65280 are clamped and
     counted in a device counter (`fp16_clamped`), never silently turned into inf.
  Decode (up to 64 tokens): the path glmctl.plugin.quantization.exl3_decode picks: exllamav3's
     `exl3_moe_coop` (vLLM's routing as it is; 256 (token, expert) slots per call, so 33-64
     tokens take two calls) or glmctl's Triton kernels (glmctl.kernels.exl3_moe_decode).
     Larger batches:
  2. Routing on the device: the (token, expert) picks are sorted by expert (argsort), counted per
     expert with scatter_add_ (bincount would size its output from the data: a host sync), and
     the routing weights go to fp16 in the same order.
  3. `exl3_moe` with num_active = -1 (unknown: the launch is sized for the device, never from a
     count read back): gather + input Hadamard + gate/up GEMMs + clamped SwiGLU + down GEMM +
     output Hadamard + weighted scatter-add into an fp32 output, for every expert in one launch.
     A token picks an expert at most once, so no expert can hold more than T rows: for T <= R
     every expert fits the kernel's R-row buffers. Experts with more than 16 / 32 rows run in
     32- / 64-row tiles through separate launches that the kernel filters by row count on the
     device; which launches are needed follows from T alone.
  4. T > R (prefill): while a CUDA graph is being captured, the tokens go through in slices of R
     (sync-free, every expert fits each slice). Eagerly (vLLM runs batches above its capture sizes
     eagerly) the per-expert counts are read back once per layer: experts with <= R rows take the
     fused kernel in one pass, heavier ones are reconstructed to fp16 (`reconstruct_had_slice`)
     and run as batched GEMMs ("heavy experts").
Nothing on the decode path reads device memory from the host, allocates outside torch's caching
allocator or depends on data-dependent shapes, so the whole forward can be captured.

CUDA-graph hazards of exllamav3 1.6.5 that `warm_up` clears before vLLM captures: the first
`exl3_moe` call on a device allocates and zeroes its lock/barrier buffer with cudaMalloc +
cudaMemset (`DevCtx::get_locks`), and each kernel instance sets its shared-memory attribute on
first use. `exl3_moe` has no autotuner (exl3_gemm / exl3_mgemm do, and they are not used here).
The kernel's group barriers spin on a device-global counter block shared by every exllamav3
launch on the device: never run two exllamav3 kernels concurrently on one GPU (the shared expert
is not EXL3 here, so vLLM's shared-expert side stream never runs one).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import cache

import torch

from glmctl import switches
from glmctl.plugin.quantization.exl3_decode import (
    TritonDecode,
    decode_path_from_env,
    pick_decode_path,
)

FP16_SAFE = 65280.0  # the largest bf16 value that fp16 can hold (fp16 max 65504 rounds up in bf16)
FUSED_ROWS = 256  # rows per expert in the fused kernel's buffers (its 64-row tiles reach 256)
TIERS = ((1, 16, 16), (17, 32, 32), (33, FUSED_ROWS, 64))  # (rows from, rows to, tile rows)
COOP_SLOTS = 256  # exl3_moe_coop's scratch bound (MAX_SLOTS, exl3_moe_coop_kernel.cuh): T * top-k
COOP_CALLS = 2  # up to this many coop calls per batch (64 tokens at top-8) before exl3_moe takes over
HEAVY_GROUP_BYTES = 512 * 2**20  # fp16 weights reconstructed at once for heavy experts


@cache
def ext():
    """exllamav3's CUDA extension: the prebuilt module if importable, else exllamav3's JIT build.

    exllamav3's package import switches torch's CUDA allocator to expandable segments unless told
    otherwise; inside vLLM that would change vLLM's memory behaviour, so it is told otherwise.
    """
    try:
        import exllamav3_ext  # type: ignore[import-not-found]

        return exllamav3_ext
    except ImportError:
        os.environ.setdefault("EXL3_EXPANDABLE_SEGMENTS", "0")
        from exllamav3.ext import exllamav3_ext  # type: ignore[import-not-found]

        return exllamav3_ext


@dataclass
class Exl3Projection:
    """One projection kind (gate, up or down) of E experts: views into the stored tensors.

    trellis [E, in/16, out/16, 16*K] int16, suh [E, in] fp16, svh [E, out] fp16; each expert's
    slice must be contiguous (its rows may be strided, e.g. gate and up interleaved in vLLM's w13).
    """

    trellis: torch.Tensor
    suh: torch.Tensor
    svh: torch.Tensor

    @property
    def experts(self) -> int:
        return self.trellis.shape[0]

    @property
    def in_features(self) -> int:
        return self.suh.shape[1]

    @property
    def out_features(self) -> int:
        return self.svh.shape[1]

    def pointers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """int64 device tables of each expert's data address (what exl3_moe reads)."""
        return tuple(_pointer_table(t) for t in (self.trellis, self.suh, self.svh))  # type: ignore[return-value]

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.trellis[e], self.suh[e], self.svh[e]


def _pointer_table(t: torch.Tensor) -> torch.Tensor:
    inner = t[0]
    if not inner.is_contiguous():
        raise ValueError(f"each expert's tensor must be contiguous, got strides {tuple(t.stride())}")
    step = t.stride(0) * t.element_size()
    return torch.arange(t.shape[0], dtype=torch.int64, device=t.device) * step + t.data_ptr()


@dataclass
class _Buffers:
    state_g: torch.Tensor
    state_u: torch.Tensor
    interm_g: torch.Tensor
    interm_u: torch.Tensor


_buffers: dict[tuple, _Buffers] = {}


@dataclass
class _CoopBuffers:
    """exl3_moe_coop's scratch for COOP_SLOTS slots; its counters start at zero and the kernels
    leave them at zero, so one set serves every layer. `out` always has `rows` rows: the kernel
    places its counters by that row count, which must not change between calls."""

    had_g: torch.Tensor
    had_u: torch.Tensor
    gu_g: torch.Tensor
    gu_u: torch.Tensor
    act_out: torch.Tensor
    d_out: torch.Tensor
    ctr: torch.Tensor
    out: torch.Tensor


_coop_buffers: dict[tuple, _CoopBuffers] = {}


def _shared_coop_buffers(device: torch.device, hidden: int, intermediate: int, rows: int) -> _CoopBuffers:
    key = (device, hidden, intermediate, rows)
    b = _coop_buffers.get(key)
    if b is None:
        s, h, i = COOP_SLOTS, hidden, intermediate
        counters = s * (i // 128) + rows * (h // 128) + 2 + (s + 1) + s  # exl3_moe_coop_ctr_len
        f16, f32 = torch.float16, torch.float32
        b = _CoopBuffers(*(torch.empty(shape, dtype=dt, device=device) for shape, dt in (
            ((s, h), f16), ((s, h), f16), ((s, i), f16), ((s, i), f16), ((s, i), f16), ((s, h), f32))),
            ctr=torch.zeros(counters, dtype=torch.int32, device=device),
            out=torch.empty((rows, h), dtype=f32, device=device))
        _coop_buffers[key] = b
    return b


def _shared_buffers(device: torch.device, hidden: int, intermediate: int) -> _Buffers:
    """The kernel's per-group scratch, one set per device and shape: layers run one at a time."""
    key = (device, hidden, intermediate)
    b = _buffers.get(key)
    if b is None:
        groups = ext().exl3_moe_max_concurrency(device.index)
        b = _Buffers(*(torch.empty((groups, FUSED_ROWS, d), dtype=torch.float16, device=device)
                       for d in (hidden, hidden, intermediate, intermediate)))
        _buffers[key] = b
    return b


class Exl3MoE:
    """The routed experts of one layer on one rank. Call with bf16/fp16 x and vLLM's routing."""

    def __init__(self, gate: Exl3Projection, up: Exl3Projection, down: Exl3Projection, bits: int,
                 act_limit: float | None = None) -> None:
        self.gate, self.up, self.down = gate, up, down
        self.experts = gate.experts
        self.hidden, self.intermediate = gate.in_features, gate.out_features
        if (up.in_features, up.out_features, down.in_features, down.out_features) != (
                self.hidden, self.intermediate, self.intermediate, self.hidden):
            raise ValueError("gate/up/down shapes do not form an expert MLP")
        if self.hidden % 128 or self.intermediate % 128:
            raise ValueError(f"exl3_moe needs 128-multiples, got hidden {self.hidden}, intermediate {self.intermediate}")
        self.bits = float(bits)
        self.act_limit = float(act_limit or 0.0)  # 0: no clamp (the kernel's convention)
        self.device = gate.trellis.device
        self._tables = [*gate.pointers(), *up.pointers(), *down.pointers()]
        self._buffers = _shared_buffers(self.device, self.hidden, self.intermediate)
        self.fp16_clamped = torch.zeros((), dtype=torch.int64, device=self.device)
        self.prefill_mode = switches.read("GLMCTL_EXL3_PREFILL")  # recon / chunk: exl3_moe; triton: 64-slot runs
        self.decode_kernel = decode_path_from_env()  # glmctl.plugin.quantization.exl3_decode: paths and the auto rule
        self._triton = (TritonDecode(gate, up, down, self.act_limit)
                        if TritonDecode.supports(self.bits, self.hidden, self.intermediate) else None)

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for p in (self.gate, self.up, self.down)
                   for t in (p.trellis, p.suh, p.svh))

    # -- forward -----------------------------------------------------------------------------------
    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        tokens, top_k = x.shape[0], topk_ids.shape[1]
        if tokens == 0:
            return torch.zeros((0, self.hidden), dtype=x.dtype, device=x.device)
        from glmctl.kernels.exl3_moe_decode import MAX_TOKENS

        path = self.decode_kernel
        if path == "auto":
            path = pick_decode_path(tokens, top_k, self.bits, self._triton is not None)
        if path == "triton":
            if self._triton is not None and tokens <= MAX_TOKENS:
                return self._triton(x, topk_ids, topk_weights, self.fp16_clamped)
            path = "coop_lean"
        rows = COOP_SLOTS // top_k  # tokens per exl3_moe_coop call (32 at top-8)
        if path in ("coop", "coop_lean") and tokens <= COOP_CALLS * rows:
            if path == "coop_lean":
                from glmctl.kernels.exl3_coop_io import coop_inputs

                x16, ids, weights = coop_inputs(x, topk_ids, topk_weights, self.fp16_clamped)
            else:
                x16 = to_fp16_checked(x, self.fp16_clamped)
                ids, weights = topk_ids.to(torch.int64), topk_weights
            if tokens <= rows:
                return self._coop(x16, ids, weights).to(x.dtype)
            y = torch.empty((tokens, self.hidden), dtype=x.dtype, device=x.device)
            for t0 in range(0, tokens, rows):  # the kernel's output buffer is reused: copy out first
                y[t0:t0 + rows].copy_(self._coop(x16[t0:t0 + rows], ids[t0:t0 + rows], weights[t0:t0 + rows]))
            return y
        if self.prefill_mode == "triton" and self._triton is not None:
            return self._triton.prefill(x, topk_ids, topk_weights, self.fp16_clamped)
        x16 = to_fp16_checked(x, self.fp16_clamped)
        out = torch.zeros((tokens, self.hidden), dtype=torch.float32, device=x.device)
        ids, weights = topk_ids.to(torch.int64), topk_weights
        if tokens <= FUSED_ROWS:
            self._fused(x16, out, ids, weights, tokens)
        elif self.prefill_mode == "chunk" or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            for t0 in range(0, tokens, FUSED_ROWS):
                t1 = min(t0 + FUSED_ROWS, tokens)
                self._fused(x16[t0:t1], out[t0:t1], ids[t0:t1], weights[t0:t1], t1 - t0)
        else:
            self._prefill(x16, out, ids, weights)
        return out.to(x.dtype)

    def _coop(self, x16: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        b = _shared_coop_buffers(self.device, self.hidden, self.intermediate, COOP_SLOTS // ids.shape[1])
        ext().exl3_moe_coop(
            x16, ids.contiguous(), weights.to(torch.float16).contiguous(),
            -1, -1,  # no expert-range filter: this rank holds every expert's slice
            self.hidden, *self._tables,
            None, None, None,  # no biases
            self.bits, self.bits, self.bits, False, True,  # mcg, mul1
            0, self.act_limit, True,  # SiLU, GLM's swiglu clamp, gated
            b.had_g, b.had_u, b.gu_g, b.gu_u, b.act_out, b.d_out, b.ctr, b.out,
            None, None,  # shared expert: vLLM runs it
        )
        return b.out[: x16.shape[0]]

    def _route(self, ids: torch.Tensor, weights: torch.Tensor):
        flat = ids.reshape(-1)
        order = torch.argsort(flat)
        token_sorted = torch.div(order, ids.shape[1], rounding_mode="floor")
        weight_sorted = weights.reshape(-1)[order].to(torch.float16)
        counts = torch.zeros(self.experts + 1, dtype=torch.int64, device=ids.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))  # last bin: the kernel's sentinel, unused
        return token_sorted, weight_sorted, counts

    def _fused(self, x16, out, ids, weights, max_rows: int, routed=None, active=None) -> None:
        token_sorted, weight_sorted, counts = routed or self._route(ids, weights)
        tiers = [t for t in TIERS if t[0] <= max_rows]
        for i, (lo, hi, tile) in enumerate(tiers):
            hi = FUSED_ROWS if i == len(tiers) - 1 else hi  # the last tier launched takes the rest
            n = -1 if active is None else active[i]
            if n == 0:
                continue
            self._launch(x16, out, counts, token_sorted, weight_sorted, n, lo, hi, tile)

    def _launch(self, x16, out, counts, token_sorted, weight_sorted, num_active, lo, hi, tile) -> None:
        b = self._buffers
        ext().exl3_moe(
            x16, out, counts, token_sorted, weight_sorted,
            b.state_g, b.state_u, b.interm_g, b.interm_u,
            0,  # act_function: SiLU (GLM's clamped SwiGLU with act_limit)
            self.bits, self.bits, self.bits,
            *self._tables,
            False, True, False, True, False, True,  # mcg/mul1 per gate, up, down: mul1
            self.act_limit, num_active,
            None, None,  # no slot scratch: fp32 atomic accumulation into `out`
            lo, hi, tile,
        )

    def _prefill(self, x16, out, ids, weights) -> None:
        """Eager T > R: one count read-back; fused kernel for <= R rows, reconstruction above."""
        routed = self._route(ids, weights)
        counts = routed[2][: self.experts].tolist()  # the one host sync of this path
        active = [sum(1 for c in counts if lo <= c <= (FUSED_ROWS if i == len(TIERS) - 1 else hi))
                  for i, (lo, hi, _) in enumerate(TIERS)]
        self._fused(x16, out, ids, weights, FUSED_ROWS, routed, active)
        heavy = [e for e, c in enumerate(counts) if c > FUSED_ROWS]
        if heavy:
            self._heavy(x16, out, routed, counts, heavy)

    def _heavy(self, x16, out, routed, counts, heavy: list[int]) -> None:
        """Experts with more rows than the fused kernel holds: fp16 weights + batched GEMMs."""
        token_sorted, weight_sorted, _ = routed
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        per_expert = 3 * self.hidden * self.intermediate * 2
        group = max(1, HEAVY_GROUP_BYTES // per_expert)
        sink = torch.zeros((1, self.hidden), dtype=torch.float32, device=out.device)
        out_ext = torch.cat([out, sink])  # padding rows land in the extra row
        for g0 in range(0, len(heavy), group):
            experts = heavy[g0:g0 + group]
            rows = max(counts[e] for e in experts)
            idx = torch.full((len(experts), rows), out.shape[0], dtype=torch.int64)
            pos = torch.full((len(experts), rows), -1, dtype=torch.int64)
            for j, e in enumerate(experts):
                pos[j, : counts[e]] = torch.arange(starts[e], starts[e] + counts[e])
            pos = pos.to(out.device, non_blocking=True)
            valid = pos >= 0
            safe = pos.clamp(min=0)
            idx = torch.where(valid, token_sorted[safe], idx.to(out.device))
            w = torch.where(valid, weight_sorted[safe].float(), torch.zeros((), device=out.device))
            xg = torch.cat([x16, torch.zeros_like(x16[:1])])[idx]  # [g, rows, hidden]
            wg, wu, wd = (self._reconstruct(p, experts) for p in (self.gate, self.up, self.down))
            g, u = torch.bmm(xg, wg), torch.bmm(xg, wu)
            y = torch.bmm(swiglu(g, u, self.act_limit).to(torch.float16), wd).float() * w.unsqueeze(-1)
            out_ext.index_add_(0, idx.reshape(-1), y.reshape(-1, self.hidden))
        out.copy_(out_ext[:-1])

    def _reconstruct(self, p: Exl3Projection, experts: list[int]) -> torch.Tensor:
        w = torch.empty((len(experts), p.in_features, p.out_features), dtype=torch.float16, device=self.device)
        for j, e in enumerate(experts):
            trellis, suh, svh = p.expert(e)
            ext().reconstruct_had_slice(w[j], trellis, suh, svh, self.bits, False, True, 0)
        return w

    # -- CUDA graphs -------------------------------------------------------------------------------
    def warm_up(self, token_counts: list[int] | tuple[int, ...], top_k: int) -> None:
        """Run every batch size that will be captured once, eagerly, before any capture."""
        gen = torch.Generator(device=self.device).manual_seed(0)
        for t in sorted(set(token_counts)):
            x = torch.randn((t, self.hidden), generator=gen, device=self.device, dtype=torch.bfloat16)
            scores = torch.rand((t, self.experts), generator=gen, device=self.device)
            w, ids = scores.topk(min(top_k, self.experts), dim=-1)
            self(x, ids, w)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def swiglu(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    """GLM-5.3-Flash's expert activation: silu(min(g, L)) * clamp(u, -L, L) (no clamp for L = 0)."""
    g, u = g.float(), u.float()
    if limit:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return torch.nn.functional.silu(g) * u


def to_fp16_checked(x: torch.Tensor, clamped: torch.Tensor) -> torch.Tensor:
    """x in fp16, values outside +-FP16_SAFE (and NaN) counted into `clamped` on the device."""
    if x.dtype == torch.float16:
        return x.contiguous()
    clamped += (~(x.abs() <= FP16_SAFE)).sum()
    return x.clamp(-FP16_SAFE, FP16_SAFE).to(torch.float16).contiguous()


# -- references -------------------------------------------------------------------------------------
@cache
def _hadamard128(device: torch.device) -> torch.Tensor:
    h = torch.ones((1, 1), dtype=torch.float32)
    while h.shape[0] < 128:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)  # Sylvester
    return (h / math.sqrt(128)).to(device)


def dequantize(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, bits: int) -> torch.Tensor:
    """The (in, out) fp32 weight one stored projection encodes, from the format's definition.

    W = diag(suh) . Had . T . Had . diag(svh) with T the decoded trellis (exllamav3's `reconstruct`,
    rotated basis) and Had the normalised 128x128 Sylvester Hadamard, blockwise.
    """
    k, n = suh.shape[0], svh.shape[0]
    t = torch.empty((k, n), dtype=torch.float16, device=trellis.device)
    ext().reconstruct(t, trellis, float(bits), False, True)
    had = _hadamard128(trellis.device)
    w = (had @ t.float().view(k // 128, 128, n)).view(k, n) * suh.float().unsqueeze(1)
    w = (w.view(k, n // 128, 128) @ had).view(k, n) * svh.float().unsqueeze(0)
    return w


def moe_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
                  w_up: torch.Tensor, w_down: torch.Tensor, act_limit: float | None) -> torch.Tensor:
    """fp32 routed-expert sum with (in, out) weights [E, in, out]: what Exl3MoE computes."""
    out = torch.zeros((x.shape[0], w_down.shape[2]), dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in topk_ids.unique().tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        xe = xf[tok]
        a = swiglu(xe @ w_gate[e].float(), xe @ w_up[e].float(), act_limit or 0.0)
        out.index_add_(0, tok, (a @ w_down[e].float()) * topk_weights[tok, slot].float().unsqueeze(1))
    return out
