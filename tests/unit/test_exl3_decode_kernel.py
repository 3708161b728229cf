"""The EXL3 trellis decode and the Triton decode-batch MoE kernels, on CPU.

The torch reference decode is checked against a packer written from exllamav3 1.6.5's
`pack_trellis_kernel` (quant/pack.cu: symbols most significant bit first in 16-bit words, the
halves of each uint32 swapped); the Triton block decode (TRITON_INTERPRET=1: the plain-Triton
form; tests/unit/test_exl3_decode_asm.py checks the inline-PTX form) against the reference on
random words, as raw integers and as fp16 values; the whole MoE kernel pipeline against the
reference layer at tiny shapes, including runs cut from a heavy expert, gate/up and down K
splits, repeated calls on one workspace, and the fp16 range count. Every kernel run here is
bounds-checked (tests/unit/triton_bounds): each load, store and atomic of every active lane must
land inside the tensors the launch was given, which the plain interpreter does not check (it
reads whatever lies at the address)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.unit.interpreted_kernels import interpreted_kernels  # noqa: E402
from tests.unit.triton_bounds import OutOfBounds, bounds_checked  # noqa: E402

_modules, interpreted, test_in_fresh_process, _interpreter = interpreted_kernels(
    __file__, "glmctl.kernels.exl3_trellis", "glmctl.kernels.exl3_moe_rotate",
    "glmctl.kernels.exl3_moe_decode", "glmctl.kernels.exl3_coop_io")
trellis_mod, _, moe_mod, coop_io = _modules or (None, None, None, None)


@pytest.fixture(autouse=True)
def _bounds_checked(_interpreter):
    if _modules is None:
        yield
        return
    with bounds_checked():
        yield


def pack_tile(symbols: list[int], bits: int) -> list[int]:
    """pack_trellis_kernel for one tile: 256 K-bit symbols -> 16K int16 words (as stored)."""
    stream = "".join(format(s, f"0{bits}b") for s in symbols)  # MSB first
    halves = [int(stream[i:i + 16], 2) for i in range(0, len(stream), 16)]
    stored = []
    for w in range(0, len(halves), 2):  # SWAP16: the first half of each pair goes high
        stored += [halves[w + 1], halves[w]]
    return [h - 65536 if h >= 32768 else h for h in stored]


def tile_states(symbols: list[int], bits: int) -> list[int]:
    """The tail-biting 16-bit state of every position: its symbol and the ones before it."""
    n, per = len(symbols), -(-16 // bits)
    out = []
    for p in range(n):
        v = 0
        for j in range(per - 1, -1, -1):
            v = (v << bits) | symbols[(p - j) % n]
        out.append(v & 0xFFFF)
    return out


@interpreted
@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_reference_decode_reads_exllamav3s_packed_stream(bits):
    g = torch.Generator().manual_seed(bits)
    kt, nt = 2, 3
    syms = torch.randint(0, 2**bits, (kt, nt, 256), generator=g).tolist()
    trellis = torch.tensor([[pack_tile(syms[i][j], bits) for j in range(nt)] for i in range(kt)],
                           dtype=torch.int16)
    t = trellis_mod.decode_trellis_ref(trellis, bits)
    assert t.shape == (kt * 16, nt * 16) and t.dtype == torch.float16
    for i in range(kt):
        for j in range(nt):
            values = trellis_mod.mul1_values(torch.tensor(tile_states(syms[i][j], bits)))
            for p in (0, 1, 2, 7, 8, 100, 255):
                r, c = trellis_mod.tensor_core_position(p)
                assert t[i * 16 + r, j * 16 + c] == values[p], (i, j, p)


@interpreted
def test_codebook_values_are_exllamav3s_fp16_hfma():
    """(1024 + bytesum) * fp16(0x1EEE) + fp16(0xC931), rounded once to fp16; spot values by hand."""
    k_inv = torch.tensor([0x1EEE], dtype=torch.int16).view(torch.float16).item()
    k_bias = torch.tensor([0xC931 - 65536], dtype=torch.int16).view(torch.float16).item()
    assert k_inv == trellis_mod.K_INV and k_bias == trellis_mod.K_BIAS
    states = torch.tensor([0, 1, 0x1234, 0xFFFF])
    x = [(s * trellis_mod.MUL1) & 0xFFFFFFFF for s in states.tolist()]
    want = [float(torch.tensor((1024 + sum((v >> sh) & 255 for sh in (0, 8, 16, 24))) * k_inv + k_bias)
                  .half()) for v in x]
    assert trellis_mod.mul1_values(states).tolist() == want
    assert trellis_mod.mul1_values(torch.tensor([0])).item() == pytest.approx(-3.453125)


@interpreted
@pytest.mark.parametrize("bkt", [2, 4])
def test_triton_block_decode_matches_the_reference(bkt):
    """Both forms of the block decode, exllamav3's fp16 values and the raw integers r, in the
    documented operand layout; and r's affine map, rounded once, gives the values."""
    g = torch.Generator().manual_seed(bkt)
    trellis = torch.randint(-2**15, 2**15, (2 * bkt, 16, 64), dtype=torch.int16, generator=g)
    values = trellis_mod.decode_blocks(trellis, bkt, affine=True)
    raw = trellis_mod.decode_blocks(trellis, bkt, affine=False)
    assert torch.equal(values, trellis_mod.decode_blocks_ref(trellis, bkt, affine=True))
    assert torch.equal(raw, trellis_mod.decode_blocks_ref(trellis, bkt, affine=False))
    assert torch.equal(raw, raw.round()) and raw.min() >= 1024 and raw.max() <= 2044
    assert torch.equal((raw.float() * trellis_mod.K_INV + trellis_mod.K_BIAS).half(), values)


@interpreted
def test_block_reference_places_every_weight_once():
    """The reference operands hold each decoded weight of the matrix exactly once."""
    trellis = torch.randint(-2**15, 2**15, (4, 8, 64), dtype=torch.int16, generator=torch.Generator().manual_seed(1))
    blocks = trellis_mod.decode_blocks_ref(trellis, 2, affine=True)
    full = trellis_mod.decode_trellis_ref(trellis, 4)
    assert blocks.numel() == full.numel()
    assert torch.equal(blocks.float().sum(), full.float().sum()) and torch.equal(
        blocks.flatten().sort().values, full.flatten().sort().values)


@interpreted
def test_operand_layout_maps_are_permutations():
    k = trellis_mod.k_of_kprime(torch.arange(64))
    assert sorted(k.tolist()) == list(range(64)) and torch.equal(k // 16, torch.arange(64) // 16)
    cols = torch.cat([trellis_mod.n_of_half_row(torch.arange(64), h) for h in (0, 1)])
    assert sorted(cols.tolist()) == list(range(128))


def _layer(experts: int, hidden: int, inter: int, seed: int):
    g = torch.Generator().manual_seed(seed)

    def proj(k, n):
        trellis = torch.randint(-2**15, 2**15, (experts, k // 16, n // 16, 64), dtype=torch.int16, generator=g)
        signs = lambda m: (torch.randint(0, 2, (experts, m), generator=g) * 2 - 1).half() * k ** -0.25  # noqa: E731
        return trellis, signs(k), signs(n)

    return proj(hidden, inter), proj(hidden, inter), proj(inter, hidden)


def _routing(tokens, experts, top_k, seed, heavy=False):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=g)
    if heavy:
        scores[:, 0] += 2.0  # expert 0 in every token's top-k: more than one run
    w, ids = scores.topk(top_k, dim=-1)
    return ids.to(torch.int32), (w / w.sum(-1, keepdim=True)).float()


def _config(name: str):
    """Shipped configs by name; t_<split>_<down split>: small-shape splits (hidden 256, 128
    intermediate channels hold 4 gate/up and 2 down splits of 64 rows)."""
    if name.startswith("t_"):
        split, down = (int(v) for v in name[2:].split("_"))
        return moe_mod.DecodeConfig(name, split, down_split=down)
    return moe_mod.DECODE_CONFIGS[name]


@interpreted
@pytest.mark.parametrize("tokens, config, heavy", [(1, "t_4_2", False), (3, "split2", False),
                                                   (17, "split2", True), (5, "t_1_1", False)])
def test_moe_decode_matches_the_reference_layer(tokens, config, heavy):
    experts, hidden, inter, top_k = 6, 256, 128, 2
    gate, up, down = _layer(experts, hidden, inter, seed=tokens)
    ids, w = _routing(tokens, experts, top_k, seed=tokens + 1, heavy=heavy)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(3)).bfloat16()
    ws = moe_mod.DecodeWorkspace("cpu", hidden, inter, top_k, experts, max_tokens=32)
    clamped = torch.zeros((), dtype=torch.int64)
    ref = moe_mod.exl3_moe_decode_ref(x, ids, w, gate, up, down, 10.0)
    for call in range(2):  # nothing carries over from one call to the next
        y = moe_mod.exl3_moe_decode(x, ids, w, gate, up, down, 10.0, clamped, ws, _config(config))
        assert y.dtype == torch.bfloat16 and y.shape == x.shape
        err = float((y.float() - ref).norm() / ref.norm())
        assert err < 1e-2, (call, err)
    if heavy:
        assert int(ws.meta[0]) > len(ids.unique())  # expert 0's 17 slots took two runs
    assert int(clamped) == 0


@interpreted
def test_config_checks_name_what_does_not_fit():
    ws = moe_mod.DecodeWorkspace("cpu", 256, 128, 2, 6, max_tokens=4)
    with pytest.raises(ValueError, match="split_k partials beyond the workspace"):
        moe_mod.check_config(moe_mod.DECODE_CONFIGS["split4"], 4, 2, 256, 128, ws)  # 4 x 8 slots > 16 rows
    with pytest.raises(ValueError, match="split_k must divide"):
        moe_mod.check_config(moe_mod.DECODE_CONFIGS["split8"], 1, 2, 256, 128, ws)
    moe_mod.check_config(_config("t_4_2"), 1, 2, 256, 128, ws)


def test_default_configs_fit_the_tp8_shape_at_every_size():
    """GLM-5.3-Flash at TP8 (hidden 4096, 256 channels, top-8): every size up to MAX_TOKENS has a
    config that its workspace holds."""
    if _modules is None:
        pytest.skip("re-run by test_in_fresh_process")
    ws = moe_mod.DecodeWorkspace("meta", 4096, 256, 8, 288)
    for tokens in range(1, moe_mod.MAX_TOKENS + 1):
        moe_mod.check_config(moe_mod.default_config(tokens), tokens, 8, 4096, 256, ws)


@interpreted
def test_moe_decode_counts_and_clamps_out_of_range_inputs():
    experts, hidden, inter, top_k = 4, 256, 128, 2
    gate, up, down = _layer(experts, hidden, inter, seed=9)
    ids, w = _routing(2, experts, top_k, seed=10)
    x = torch.randn(2, hidden).bfloat16()
    x[0, :3] = torch.tensor([1e6, -3e5, float("inf")])
    ws = moe_mod.DecodeWorkspace("cpu", hidden, inter, top_k, experts, max_tokens=8)
    clamped = torch.zeros((), dtype=torch.int64)
    y = moe_mod.exl3_moe_decode(x, ids, w, gate, up, down, 10.0, clamped, ws, _config("t_4_2"))
    assert int(clamped) == 3
    assert torch.isfinite(y[1:].float()).all()


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_coop_inputs_match_the_torch_conversions(dtype):
    x = (torch.randn(3, 256) * 100).to(dtype)
    if dtype == torch.bfloat16:
        x[1, :2] = torch.tensor([1e6, float("nan")])
    ids = torch.randint(0, 9, (3, 8), dtype=torch.int32)
    w = torch.rand(3, 8)
    got_n, want_n = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    got = coop_io.coop_inputs(x, ids, w, got_n)
    want = coop_io.coop_inputs_ref(x, ids, w, want_n)
    for g, r in zip(got, want, strict=True):
        assert g.dtype == r.dtype and torch.equal(g[~g.isnan()] if g.is_floating_point() else g,
                                                  r[~r.isnan()] if r.is_floating_point() else r)
    assert int(got_n) == int(want_n) == (2 if dtype == torch.bfloat16 else 0)


@interpreted
@pytest.mark.slow
def test_moe_decode_at_the_tp8_slice_shape_stays_inside_its_buffers():
    """The TP8 slice shape (T=1, top-2 over 8 experts, hidden 4096, 256 channels, the T=1 default
    with 16 gate/up and 4 down splits) under the bounds-checked interpreter: every access lands
    inside its tensors."""
    experts, hidden, inter, top_k, tokens = 8, 4096, 256, 2, 1
    gate, up, down = _layer(experts, hidden, inter, seed=21)
    ids, w = _routing(tokens, experts, top_k, seed=22)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(23)).bfloat16()
    ws = moe_mod.DecodeWorkspace("cpu", hidden, inter, top_k, experts)
    clamped = torch.zeros((), dtype=torch.int64)
    y = moe_mod.exl3_moe_decode(x, ids, w, gate, up, down, 10.0, clamped, ws)
    ref = moe_mod.exl3_moe_decode_ref(x, ids, w, gate, up, down, 10.0)
    assert float((y.float() - ref).norm() / ref.norm()) < 1e-2


@interpreted
def test_bounds_checker_catches_an_access_past_a_view():
    """The checker itself: one element past a view of a larger storage is caught (the plain
    interpreter would read the storage's next element)."""
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterError

    @triton.jit
    def shifted_copy(src, dst, SHIFT: tl.constexpr):
        i = tl.arange(0, 8)
        tl.store(dst + i, tl.load(src + i + SHIFT))

    base, out = torch.arange(16.0), torch.zeros(8)
    shifted_copy[(1,)](base[:8], out, SHIFT=0)
    with pytest.raises((OutOfBounds, InterpreterError), match="load at byte \\+32 of argument 'src'"):
        shifted_copy[(1,)](base[:8], out, SHIFT=1)


@interpreted
@pytest.mark.slow
def test_moe_decode_at_the_bench_routing_stays_inside_its_buffers():
    """The bench's routing (288 experts, top-8) at a small hidden size, bounds-checked: 9 tokens
    (72 slots, not a multiple of the 16-slot runs), the last expert in every token's top-8 (its
    9 slots in one run at the end of the table), experts with no tokens, split4's partials."""
    experts, hidden, inter, top_k, tokens = 288, 256, 128, 8, 9
    gate, up, down = _layer(experts, hidden, inter, seed=31)
    g = torch.Generator().manual_seed(32)
    scores = torch.rand(tokens, experts, generator=g)
    scores[:, experts - 1] += 2.0
    w, ids = scores.topk(top_k, dim=-1)
    ids, w = ids.to(torch.int32), (w / w.sum(-1, keepdim=True)).float()
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    ws = moe_mod.DecodeWorkspace("cpu", hidden, inter, top_k, experts)
    clamped = torch.zeros((), dtype=torch.int64)
    y = moe_mod.exl3_moe_decode(x, ids, w, gate, up, down, 10.0, clamped, ws, moe_mod.DECODE_CONFIGS["split4"])
    ref = moe_mod.exl3_moe_decode_ref(x, ids, w, gate, up, down, 10.0)
    assert float((y.float() - ref).norm() / ref.norm()) < 1e-2
    assert int(ws.meta[0]) == len(ids.unique())  # one run per touched expert at 9 tokens
    assert int(ws.run_e[int(ws.meta[0]) - 1]) == experts - 1 and int(ws.run_n[int(ws.meta[0]) - 1]) == tokens


@interpreted
@pytest.mark.parametrize("config, slice_tokens, torch_sorted", [
    ("prefill_r64", 96, False), ("prefill_r32", 40, True), ("prefill_r64", 24, True),
    ("prefill_r64_combine", 96, True), ("prefill_r64", 96, True)])
def test_moe_prefill_matches_the_reference_layer(config, slice_tokens, torch_sorted, monkeypatch):
    """Prefill sizes (more tokens than the decode path holds) through 32- and 64-slot runs: expert 0
    in every token's top-k (96 slots: two 64-slot runs, three 32-slot runs), the call cut into
    slices of the workspace's tokens (96: one slice; 40: three, the last short; 24: four), the
    slices' outputs in order; the run table sorted in the kernel or by torch first (the threshold
    lowered so these sizes take it), the output rotation in the down kernel or the combine."""
    from glmctl.kernels import exl3_moe_rotate
    from glmctl.kernels.exl3_moe_prefill import exl3_moe_prefill, prefill_workspace

    monkeypatch.setattr(exl3_moe_rotate, "SORT_IN_KERNEL", 16 if torch_sorted else 4096)

    experts, hidden, inter, top_k, tokens = 6, 256, 128, 2, 96
    gate, up, down = _layer(experts, hidden, inter, seed=41)
    ids, w = _routing(tokens, experts, top_k, seed=42, heavy=True)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(43)).bfloat16()
    ws = prefill_workspace("cpu", hidden, inter, top_k, experts, slice_tokens=slice_tokens)
    clamped = torch.zeros((), dtype=torch.int64)
    y = exl3_moe_prefill(x, ids, w, gate, up, down, 10.0, clamped, ws, moe_mod.DECODE_CONFIGS[config])
    ref = moe_mod.exl3_moe_decode_ref(x, ids, w, gate, up, down, 10.0)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    rows = [float((y[t].float() - ref[t]).norm() / ref[t].norm()) for t in range(tokens)]
    assert max(rows) < 2e-2, max(rows)  # every token, so a misplaced slice cannot hide in the mean
    if slice_tokens >= tokens:
        runs = len(ids.unique()) - 1 + -(-int((ids == 0).sum()) // moe_mod.DECODE_CONFIGS[config].rows)
        assert int(ws.meta[0]) == runs


def test_prefill_workspace_holds_the_tp8_chunk():
    """GLM-5.3-Flash at TP8: a 2,048-token slice fits every prefill config, and a decode config's
    K splits do not (the prefill workspace keeps one split)."""
    if _modules is None:
        pytest.skip("re-run by test_in_fresh_process")
    from glmctl.kernels.exl3_moe_prefill import PREFILL_CONFIGS, PREFILL_TOKENS, prefill_workspace

    ws = prefill_workspace("meta", 4096, 256, 8, 288)
    assert PREFILL_CONFIGS
    for name in PREFILL_CONFIGS:
        moe_mod.check_config(moe_mod.DECODE_CONFIGS[name], PREFILL_TOKENS, 8, 4096, 256, ws)
    with pytest.raises(ValueError, match="split_k partials"):
        moe_mod.check_config(moe_mod.DECODE_CONFIGS["split2"], PREFILL_TOKENS, 8, 4096, 256, ws)
