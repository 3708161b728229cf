"""The packed-counter top-k (every configuration the bench sweeps) and its decode entry under
TRITON_INTERPRET=1 against the torch reference, bit for bit: random rows (the candidate path),
ties that overflow the candidate capacity (the radix fallback), -inf, negative and signed-zero
logits, coarse values, rows longer than one tile pass, short rows, prefill row offsets; decode
rows whose lengths come from int64 positions and pool-granular context lengths (capped by the
context), CUDA-graph padding rows written -1, and the previous kernels selectable by name."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.unit.interpreted_kernels import interpreted_kernels  # noqa: E402

_modules, interpreted, test_in_fresh_process, _interpreter = interpreted_kernels(
    __file__, "glmctl.kernels.kpool_topk", "glmctl.kernels.kpool_topk_packed")
pytestmark = pytest.mark.slow
topk, packed = _modules or (None, None)


KPOOL, SELECT, WIDTH = 16, 128, 2176


def _rows(gen):
    n = 3000
    logits = torch.randn(10, n, generator=gen)
    logits[1] = torch.randint(0, 3, (n,), generator=gen).float()  # ties overflow: fallback
    logits[2] = float("-inf")
    logits[3] = -torch.rand(n, generator=gen)  # all negative
    logits[4, :600] = torch.randn(600, generator=gen).to(torch.float8_e4m3fn).float()  # coarse
    logits[5] = torch.arange(n).float()  # monotone: the best pools are the last ones
    logits[6, ::256] = 50.0  # outliers crowding one column of the bound
    logits[7] = torch.where(torch.rand(n, generator=gen) < 0.98, -0.0, 0.0)  # signed zeros tie
    logits[7, 1000:1100] = 1.0
    logits[8] = torch.randn(n, generator=gen).exp()  # positive, wide range
    seq = torch.tensor([n * KPOOL + 7, 2900 * KPOOL, 2000 * KPOOL + 15, 2600 * KPOOL,
                        600 * KPOOL + 3, n * KPOOL, 2999 * KPOOL + 1, 2900 * KPOOL + 2,
                        SELECT * KPOOL + 5, (SELECT + 1) * KPOOL], dtype=torch.int32)
    starts = torch.tensor([0, 0, 0, 0, 0, 0, 1, 0, 0, 3], dtype=torch.int32)
    return logits, seq, starts


def _reference(logits, seq, starts=None, width=WIDTH, kpool=KPOOL, select=SELECT):
    want = torch.full((logits.shape[0], width), 777, dtype=torch.int32)
    return topk.kpool_topk_ref(logits, seq, want, kpool=kpool, select_pools=select,
                               row_starts=starts)


CONFIGS = packed.PACKED_CANDIDATES if packed else []


@interpreted
@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.name for c in CONFIGS])
def test_packed_topk_config_is_exact(cfg):
    logits, seq, starts = _rows(torch.Generator().manual_seed(11))
    want = _reference(logits, seq, starts)
    got = torch.full_like(want, 12345)
    topk.kpool_topk(logits, seq, got, kpool=KPOOL, select_pools=SELECT, row_starts=starts,
                    config=cfg)
    assert torch.equal(got, want)


@interpreted
def test_packed_topk_is_the_default_and_short_rows_fill_causally():
    assert topk.DEFAULT_CONFIG is packed.PACKED_CONFIG
    logits = torch.randn(4, 300)
    seq = torch.tensor([0, 5, SELECT * KPOOL, SELECT * KPOOL + 20], dtype=torch.int32)
    want = _reference(logits, seq)
    got = torch.full_like(want, 3)
    topk.kpool_topk(logits, seq, got, kpool=KPOOL, select_pools=SELECT)
    assert torch.equal(got, want)
    assert got[0].eq(-1).all()
    assert got[1, SELECT * KPOOL: SELECT * KPOOL + 6].tolist() == [0, 1, 2, 3, 4, -1]


@interpreted
@pytest.mark.parametrize("seed", range(3))
def test_packed_topk_random_small_selections(seed):
    """Small selections (kpool 4, 16 pools) on many short rows with few distinct values, so
    the threshold's ties, the candidate capacity and single-tile rows are all hit."""
    gen = torch.Generator().manual_seed(100 + seed)
    kpool, select, rows, pools = 4, 16, 12, 600
    values = torch.randint(0, 2 + 6 * seed, (rows, pools), generator=gen).float() - 3
    logits = torch.where(torch.rand(rows, pools, generator=gen) < 0.5, values,
                         torch.randn(rows, pools, generator=gen))
    seq = torch.randint(0, pools * kpool, (rows,), generator=gen, dtype=torch.int32)
    width = select * kpool + kpool - 1 + 5
    want = _reference(logits, seq, width=width, kpool=kpool, select=select)
    cfg = packed.PackedTopkConfig("tiny", rows=4, cols=32, cap=32, num_warps=2)
    for config in (cfg, None) if seed == 0 else (cfg,):
        got = torch.full_like(want, 5)
        topk.kpool_topk(logits, seq, got, kpool=kpool, select_pools=select, config=config)
        assert torch.equal(got, want), config


@interpreted
def test_capacity_rules():
    cfg = packed.PACKED_CONFIG
    assert packed.packed_capacity(cfg, 128, 16) == cfg.cap
    assert packed.packed_capacity(cfg, 16, 4) == 32
    assert packed.packed_capacity(cfg, 16, 1) == 0  # no scratch room: another kernel runs
    assert packed.packed_capacity(packed.PackedTopkConfig("narrow", cols=64), 128, 16) == 0


def _decode_batch(gen, batch=3, next_n=4, kpool=KPOOL, pools=900):
    """vLLM's decode metadata for MTP rows: int64 positions (token order), the [B, next_n]
    int32 pool-granular context lengths, and logits written up to each row's context."""
    last = torch.tensor([pools * kpool - 1, 400 * kpool + 7, 150 * kpool + 2])[:batch]
    positions = (last[:, None] - (next_n - 1) + torch.arange(next_n)[None, :]).reshape(-1)
    context = ((positions + 1) // kpool).to(torch.int32).reshape(batch, next_n)
    logits = torch.randn(batch * next_n, pools, generator=gen)
    return positions, context, logits


@interpreted
def test_decode_rows_from_positions_and_context_with_padding_rows():
    gen = torch.Generator().manual_seed(5)
    positions, context, logits = _decode_batch(gen)
    rows = positions.numel()
    padded = rows + 3  # CUDA-graph padding rows after the batch
    context = context.clone()
    context[1, 2] -= 1  # vLLM's context below the position: the row is capped by it
    seq = topk.decode_seq_lens(positions, context.reshape(-1), KPOOL)
    assert seq[6] == (context[1, 2] + 1) * KPOOL - 1 and seq[0] == positions[0] + 1
    want = torch.full((padded, WIDTH), 777, dtype=torch.int32)
    topk.kpool_topk_decode_ref(logits, positions, context, want, kpool=KPOOL,
                               select_pools=SELECT, valid_rows=rows)
    assert want[rows:].eq(-1).all()
    ref_rows = torch.full((rows, WIDTH), 1, dtype=torch.int32)
    topk.kpool_topk_ref(logits, seq, ref_rows, kpool=KPOOL, select_pools=SELECT)
    assert torch.equal(want[:rows], ref_rows)
    got = torch.full_like(want, 4321)
    topk.kpool_topk_decode(logits, positions, context, got, kpool=KPOOL, select_pools=SELECT,
                           valid_rows=rows)
    assert torch.equal(got, want)
    # The previous kernel by name (torch lengths, padding filled), on two rows and two pads;
    # int32 positions (the previous call's dtype) give the same rows.
    few = torch.full((4, WIDTH), 9, dtype=torch.int32)
    topk.kpool_topk_decode(logits[6:8], positions[6:8].int(), context.reshape(-1)[6:8], few,
                           kpool=KPOOL, select_pools=SELECT, valid_rows=2,
                           config=topk.THRESHOLD_CONFIG)
    assert torch.equal(few[:2], want[6:8]) and few[2:].eq(-1).all()
