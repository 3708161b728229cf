"""The EXL3 MoE runtime's own logic on the CPU, against a stand-in for exllamav3's extension.

`FakeExt` implements the documented contract of the ops the runtime calls (exl3_moe's argument
types, its skip rules for row counts outside [count_lo, count_hi] or above the buffer rows, its
fp32 accumulation; reconstruct / reconstruct_had_slice) with a made-up but consistent trellis
decoding. That checks routing, sorting, the row-tile launches, the heavy-expert path, token
slicing and tensor-parallel slices without CUDA; the gpu lane checks the real kernels.
"""

from __future__ import annotations

import pytest
from glmctl.quantize.exl3_format import tp_slice

import glmctl.plugin.quantization.exl3_experts as rt

BITS = 4


class FakeExt:
    def __init__(self) -> None:
        self.tensors: dict[int, object] = {}
        self.launches: list[tuple[int, int, int, int]] = []  # (count_lo, count_hi, tile, num_active)
        self.processed: list[int] = []
        self.coop_calls = 0

    def register(self, *projections) -> None:
        for p in projections:
            for t in (p.trellis, p.suh, p.svh):
                for e in range(t.shape[0]):
                    self.tensors[t[e].data_ptr()] = t[e]

    def exl3_moe_max_concurrency(self, device: int | None) -> int:
        return 4

    @staticmethod
    def decode(trellis):
        import torch

        kt, nt, words = trellis.shape
        vals = (trellis.float() / 2**15)[..., torch.arange(256) % words]
        return vals.view(kt, nt, 16, 16).permute(0, 2, 1, 3).reshape(kt * 16, nt * 16)

    def reconstruct(self, out, trellis, k, mcg, mul1) -> None:
        assert (mcg, mul1) == (False, True) and k == BITS
        out.copy_(self.decode(trellis).half())

    def reconstruct_had_slice(self, out, trellis, suh, svh, k, mcg, mul1, n_offset) -> None:
        assert n_offset == 0
        out.copy_(rt.dequantize(trellis, suh, svh, int(k)).half())

    def exl3_moe_coop(self, x, sel, rw, min_e, max_e, hi, g_t, g_s, g_v, u_t, u_s, u_v, d_t, d_s, d_v, gb, ub, db,
                      kg, ku, kd, mcg, mul1, act, act_limit, gated, had_g, had_u, gu_g, gu_u, act_out, d_out, ctr,
                      out, sh_out, sh_gate_w) -> None:
        import torch

        assert x.dtype == torch.float16 and sel.dtype == torch.int64 and rw.dtype == torch.float16
        assert sel.is_contiguous() and rw.is_contiguous() and sel.shape == rw.shape == (x.shape[0], sel.shape[1])
        assert (min_e, max_e, hi, mcg, mul1, act, gated) == (-1, -1, x.shape[1], False, True, 0, True)
        assert gb is ub is db is sh_out is sh_gate_w is None and kg == ku == kd == BITS
        slots_max = min(had_g.numel() // hi, d_out.numel() // out.shape[1], gu_g.numel() // gu_g.shape[-1])
        rows_max, inter = out.shape[0], gu_g.shape[-1]
        assert x.shape[0] * sel.shape[1] <= slots_max <= 256 and x.shape[0] <= rows_max
        assert ctr.dtype == torch.int32 and int(ctr.abs().sum()) == 0  # the kernels leave counters at zero
        assert ctr.numel() >= slots_max * (inter // 128) + rows_max * (out.shape[1] // 128) + 2 + slots_max + 1 + slots_max
        assert out.dtype == torch.float32 and d_out.dtype == torch.float32
        self.coop_calls += 1
        out[: x.shape[0]] = float("nan")  # rows past bsz are not the caller's; rows below must be written
        for r in range(x.shape[0]):
            acc = torch.zeros(out.shape[1])
            for k in range(sel.shape[1]):
                e = int(sel[r, k])

                def w(tabs, e=e):
                    trellis, suh, svh = (self.tensors[int(t[e])] for t in tabs)
                    return rt.dequantize(trellis, suh, svh, BITS)

                xr = x[r:r + 1].float()
                a = rt.swiglu(xr @ w((g_t, g_s, g_v)), xr @ w((u_t, u_s, u_v)), act_limit)
                acc += (a @ w((d_t, d_s, d_v)))[0] * float(rw[r, k])
            out[r] = acc

    def exl3_moe(self, hidden, output, counts, token_sorted, weight_sorted, sg, su, ig, iu, act, kg, ku, kd,
                 g_t, g_s, g_v, u_t, u_s, u_v, d_t, d_s, d_v, gm, g1, um, u1, dm, d1, act_limit, num_active,
                 scratch, base, lo, hi, tile) -> None:
        import torch

        assert hidden.dtype == torch.float16 and output.dtype == torch.float32
        assert counts.dtype == token_sorted.dtype == torch.int64 and weight_sorted.dtype == torch.float16
        assert (gm, g1, um, u1, dm, d1) == (False, True) * 3 and act == 0 and kg == ku == kd == BITS
        assert tile in (16, 32, 64) and (tile == 16 or sg.shape[1] >= tile) and 1 <= lo <= hi
        assert counts.shape[0] == g_t.shape[0] + 1 and scratch is None and base is None
        self.launches.append((lo, hi, tile, num_active))
        rows = sg.shape[1]
        start = 0
        for e, c in enumerate(counts[:-1].tolist()):
            if c and c <= rows and lo <= c <= hi:
                tok = token_sorted[start:start + c]
                x = hidden[tok].float()

                def w(tabs, e=e):
                    trellis, suh, svh = (self.tensors[int(t[e])] for t in tabs)
                    return rt.dequantize(trellis, suh, svh, BITS)

                a = rt.swiglu(x @ w((g_t, g_s, g_v)), x @ w((u_t, u_s, u_v)), act_limit)
                output.index_add_(0, tok, (a @ w((d_t, d_s, d_v))) * weight_sorted[start:start + c].float()[:, None])
                self.processed.append(e)
            start += c


@pytest.fixture
def fake(monkeypatch):
    f = FakeExt()
    rt.ext.cache_clear()
    monkeypatch.setattr(rt, "ext", lambda: f)
    rt._buffers.clear()
    rt._coop_buffers.clear()
    yield f
    rt._buffers.clear()
    rt._coop_buffers.clear()


def _layer(fake, experts=6, hidden=256, inter=128, seed=0, decode="fused"):
    import torch

    g = torch.Generator().manual_seed(seed)

    def proj(k, n):
        return rt.Exl3Projection(
            torch.randint(-2**15, 2**15, (experts, k // 16, n // 16, 16 * BITS), dtype=torch.int16, generator=g),
            ((torch.randint(0, 2, (experts, k), generator=g) * 2 - 1) * k ** -0.25).half(),
            ((torch.randint(0, 2, (experts, n), generator=g) * 2 - 1) * k ** -0.25).half())

    projs = proj(hidden, inter), proj(hidden, inter), proj(inter, hidden)
    fake.register(*projs)
    moe = rt.Exl3MoE(*projs, BITS, act_limit=10.0)
    moe.decode_kernel = decode
    return moe


def _reference(moe, x, ids, w):
    import torch

    deq = [torch.stack([rt.dequantize(*p.expert(e), BITS) for e in range(p.experts)]) for p in (moe.gate, moe.up, moe.down)]
    return rt.moe_reference(x, ids, w, *deq, 10.0)


def _routing(tokens, experts, top_k, seed, heavy=False):
    import torch

    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=g)
    if heavy:
        scores[:, 0] += 2
    w, ids = scores.topk(top_k, dim=-1)
    return ids.to(torch.int32), w


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("tokens, tiles", [(1, [16]), (16, [16]), (20, [16, 32]), (40, [16, 32, 64]), (256, [16, 32, 64])])
def test_small_batches_run_every_expert_once_in_the_row_tiles_their_size_needs(fake, tokens, tiles):
    import torch

    moe = _layer(fake)
    x = torch.randn(tokens, 256).bfloat16()
    ids, w = _routing(tokens, 6, 2, tokens)
    y = moe(x, ids, w)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert [t for _, _, t, _ in fake.launches] == tiles
    assert {n for *_, n in fake.launches} == {-1}  # launch size never read back from the device
    assert fake.launches[-1][1] == rt.FUSED_ROWS  # the last tier takes every larger count
    assert sorted(fake.processed) == sorted(ids.unique().tolist())  # each active expert exactly once
    assert _rel(y, _reference(moe, x, ids, w)) < 1e-2


@pytest.mark.parametrize("tokens", [1, 3, 128])
def test_decode_batches_take_the_coop_kernel_with_vllms_routing_as_is(fake, tokens):
    import torch

    moe = _layer(fake, decode="coop")
    x = torch.randn(tokens, 256).bfloat16()
    ids, w = _routing(tokens, 6, 2, tokens)
    y = moe(x, ids, w)
    assert fake.coop_calls == 1 and fake.launches == []  # no sort, no counts, no exl3_moe launch
    assert y.shape == x.shape and _rel(y, _reference(moe, x, ids, w)) < 1e-2
    moe(x[:1], ids[:1], w[:1])  # another batch size reuses the same scratch (row count fixed)
    assert fake.coop_calls == 2


def test_batches_past_one_coop_call_take_two_then_the_fused_kernel(fake):
    import torch

    moe = _layer(fake, decode="coop")
    x = torch.randn(200, 256).bfloat16()  # 200 tokens x top-2 = 400 slots: two calls of 128 + 72 tokens
    ids, w = _routing(200, 6, 2, 9)
    y = moe(x, ids, w)
    assert fake.coop_calls == 2 and not fake.launches and _rel(y, _reference(moe, x, ids, w)) < 1e-2
    x = torch.randn(257, 256).bfloat16()  # past two calls' 256 tokens: exl3_moe
    ids, w = _routing(257, 6, 2, 10)
    y = moe(x, ids, w)
    assert fake.coop_calls == 2 and fake.launches and _rel(y, _reference(moe, x, ids, w)) < 1e-2


@pytest.mark.parametrize("mode", ["recon", "chunk"])
def test_prefill_above_the_buffer_rows_handles_heavy_experts(fake, mode):
    import torch

    moe = _layer(fake)
    moe.prefill_mode = mode
    tokens = 600  # expert 0 is in every token's top-2: 600 rows > 256
    x = torch.randn(tokens, 256).bfloat16()
    ids, w = _routing(tokens, 6, 2, 3, heavy=True)
    y = moe(x, ids, w)
    assert _rel(y, _reference(moe, x, ids, w)) < 1e-2
    if mode == "recon":
        assert 0 not in fake.processed  # the heavy expert went through reconstruction, not the kernel
        assert sorted(fake.processed) == [1, 2, 3, 4, 5]
        assert all(n >= 0 for *_, n in fake.launches)  # counts were read back once: exact launch sizes
    else:
        assert fake.processed.count(0) == 3  # slices of 256, 256, 88 tokens
        assert {n for *_, n in fake.launches} == {-1}


def test_tensor_parallel_slices_add_up_to_the_whole_layer(fake):
    import torch

    moe = _layer(fake, inter=256, decode="coop")
    x = torch.randn(5, 256).bfloat16()
    ids, w = _routing(5, 6, 2, 5)
    whole = moe(x, ids, w).float()
    total = torch.zeros_like(whole)
    for rank in range(2):
        parts = []
        for name, p in (("gate_proj", moe.gate), ("up_proj", moe.up), ("down_proj", moe.down)):
            parts.append(rt.Exl3Projection(*(torch.stack([tp_slice(name, s, t[e], 256, 2, rank).contiguous()
                                                         for e in range(6)])
                                             for s, t in (("trellis", p.trellis), ("suh", p.suh), ("svh", p.svh)))))
        fake.register(*parts)
        total += rt.Exl3MoE(*parts, BITS, 10.0)(x, ids, w).float()  # the default decode kernel
    assert _rel(total, whole) < 1e-2


def test_fp16_range_check_counts_clamped_values(fake):
    import torch

    moe = _layer(fake)
    x = torch.randn(3, 256).bfloat16()
    x[1, :2] = torch.tensor([7e4, float("-inf")])
    ids, w = _routing(3, 6, 2, 1)
    y = moe(x, ids, w)
    assert int(moe.fp16_clamped) == 2 and torch.isfinite(y).all()


def test_pointer_tables_follow_strided_expert_views(fake):
    import torch

    w13 = torch.zeros(3, 2, 16, 8, 64, dtype=torch.int16)  # vLLM's w13: gate and up interleaved per expert
    up = w13[:, 1]
    table = rt._pointer_table(up)
    assert table.tolist() == [w13[e, 1].data_ptr() for e in range(3)]
    with pytest.raises(ValueError, match="contiguous"):
        rt._pointer_table(w13.transpose(2, 3)[:, 0])


@pytest.mark.parametrize("tokens, top_k", [(1, 8), (8, 8), (32, 8), (48, 8), (64, 8), (3, 2)])
def test_auto_picks_coop_lean_at_every_decode_size(tokens, top_k):
    from glmctl.plugin.quantization.exl3_decode import pick_decode_path

    assert pick_decode_path(tokens, top_k, 4.0, triton_ok=True) == "coop_lean"
    assert pick_decode_path(tokens, top_k, 3.0, triton_ok=False) == "coop_lean"


def test_auto_runs_the_coop_kernel_with_inputs_prepared_once_and_exl3_moe_past_it(fake, monkeypatch):
    """The default layer (auto) runs coop_lean: one coop call, inputs from coop_inputs (not the
    torch conversions of `coop`); past two coop calls' tokens it runs exl3_moe."""
    import glmctl.kernels.exl3_coop_io as coop_io
    import torch

    prepared, converted = [], []
    real_inputs, real_fp16 = coop_io.coop_inputs, rt.to_fp16_checked
    monkeypatch.setattr(coop_io, "coop_inputs", lambda *a: prepared.append(a[0].shape[0]) or real_inputs(*a))
    monkeypatch.setattr(rt, "to_fp16_checked", lambda *a: converted.append(a[0].shape[0]) or real_fp16(*a))
    moe = _layer(fake, decode="auto")
    x = torch.randn(5, 256).bfloat16()
    ids, w = _routing(5, 6, 2, 4)
    y = moe(x, ids, w)
    assert prepared == [5] and converted == [] and fake.coop_calls == 1 and not fake.launches
    assert _rel(y, _reference(moe, x, ids, w)) < 1e-2
    x = torch.randn(257, 256).bfloat16()
    ids, w = _routing(257, 6, 2, 6)
    moe(x, ids, w)
    assert prepared == [5] and converted == [257] and fake.coop_calls == 1 and fake.launches


def test_triton_prefill_takes_every_batch_past_the_decode_paths(fake):
    """GLMCTL_EXL3_PREFILL=triton: batches past what the decode path holds (coop: two calls of 256
    slots, 256 tokens at this layer's top-2, 64 at the model's top-8) go to glmctl's Triton prefill (its kernels are checked in tests/unit/test_exl3_decode_kernel.py), never exllamav3's
    exl3_moe; decode batches keep their path; without a Triton path (not 4-bit) exl3_moe runs."""
    import torch

    moe = _layer(fake, decode="coop")
    moe.prefill_mode = "triton"
    calls = []

    class Stub:
        def prefill(self, x, ids, w, clamped):
            calls.append(x.shape[0])
            return torch.zeros_like(x)

    moe._triton = Stub()
    for tokens in (257, 300):
        x = torch.randn(tokens, 256).bfloat16()
        ids, w = _routing(tokens, 6, 2, tokens)
        assert moe(x, ids, w).shape == x.shape
    x = torch.randn(8, 256).bfloat16()
    ids, w = _routing(8, 6, 2, 1)
    moe(x, ids, w)
    assert calls == [257, 300] and fake.coop_calls == 1 and not fake.launches
    moe._triton = None
    x = torch.randn(300, 256).bfloat16()
    ids, w = _routing(300, 6, 2, 2)
    y = moe(x, ids, w)
    assert fake.launches and _rel(y, _reference(moe, x, ids, w)) < 1e-2
