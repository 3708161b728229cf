"""The threshold top-k (every configuration the bench sweeps) under TRITON_INTERPRET=1 against the
torch reference, bit for bit, at GLM-5.3-Flash's selection (128 pools of 16 tokens): random rows
(the candidate path), rows whose ties overflow the candidate capacity (the radix fallback), rows
longer than one tile pass, -inf and negative logits, short rows, prefill row offsets; and the
radix kernels still selectable by name."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.unit.interpreted_kernels import interpreted_kernels  # noqa: E402

_modules, interpreted, test_in_fresh_process, _interpreter = interpreted_kernels(
    __file__, "glmctl.kernels.kpool_topk", "glmctl.kernels.kpool_topk_threshold")
topk, threshold = _modules or (None, None)


KPOOL, SELECT, WIDTH = 16, 128, 2176


def _rows():
    n = 5000
    logits = torch.randn(9, n)
    logits[1] = torch.randint(0, 3, (n,)).float()  # ties overflow any capacity: fallback
    logits[2] = float("-inf")
    logits[3] = -torch.rand(n)  # all negative
    logits[4, : 600] = torch.randn(600).to(torch.float8_e4m3fn).float()  # coarse, many ties
    logits[5] = torch.arange(n).float()  # monotone: the best pools are the last ones
    logits[6, ::512] = 50.0  # a few outliers in one column
    seq = torch.tensor([n * KPOOL + 7, 4500 * KPOOL, 3000 * KPOOL + 15, 4100 * KPOOL,
                        600 * KPOOL + 3, n * KPOOL, 4999 * KPOOL + 1, SELECT * KPOOL + 5,
                        (SELECT + 1) * KPOOL], dtype=torch.int32)
    starts = torch.tensor([0, 0, 0, 0, 0, 0, 1, 0, 3], dtype=torch.int32)
    return logits, seq, starts


def _reference(logits, seq, starts):
    want = torch.full((logits.shape[0], WIDTH), 777, dtype=torch.int32)
    return topk.kpool_topk_ref(logits, seq, want, kpool=KPOOL, select_pools=SELECT,
                               row_starts=starts)


CONFIGS = topk.TOPK_CANDIDATES if topk else []


@interpreted
@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.name for c in CONFIGS])
def test_threshold_topk_config_is_exact(cfg):
    logits, seq, starts = _rows()
    want = _reference(logits, seq, starts)
    got = torch.full_like(want, 12345)
    topk.kpool_topk(logits, seq, got, kpool=KPOOL, select_pools=SELECT, row_starts=starts,
                    config=cfg)
    assert torch.equal(got, want)


@interpreted
def test_threshold_topk_small_selection_and_radix_by_name():
    kpool, select = 4, 16
    logits = torch.randn(5, 700)
    logits[1] = torch.randint(0, 4, (700,)).float()
    seq = torch.tensor([0, 690 * kpool + 2, 17 * kpool, select * kpool, 5], dtype=torch.int32)
    want = torch.full((5, select * kpool + kpool - 1 + 5), 777, dtype=torch.int32)
    topk.kpool_topk_ref(logits, seq, want, kpool=kpool, select_pools=select)
    for cfg in (None, topk.THRESHOLD_CONFIG, topk.RADIX,
                threshold.ThresholdTopkConfig("tiny", rows=4, cols=32, cap=32, num_warps=4)):
        got = torch.full_like(want, 5)
        topk.kpool_topk(logits, seq, got, kpool=kpool, select_pools=select, config=cfg)
        assert torch.equal(got, want), cfg


@interpreted
def test_capacity_fits_the_history_columns():
    cfg = topk.THRESHOLD_CONFIG
    assert threshold.threshold_capacity(cfg, 128, 16) == min(cfg.cap, 1024)
    assert threshold.threshold_capacity(cfg, 16, 4) == 32
    assert threshold.threshold_capacity(cfg, 16, 1) == 0  # no room: the radix kernel runs


@interpreted
@pytest.mark.parametrize("path", ["packed", "threshold", "radix", "radix+workspace"])
def test_signed_zero_logits_tie_and_the_lower_pool_wins(path):
    """A ReLU'd indexer logit is -0.0 or +0.0 by summation order (the batch, the GPU and the
    kernel change it); they are equal, so the lower pool must win as in the reference. The
    order key once put +0.0 above -0.0: on the H200 inside vLLM 14 of 1,665 prefill rows of the
    repetitive English prompt chose later pools, and the prompt's log p left transformers'."""
    torch.manual_seed(3)
    rows, kpool, select, pools = 48, 16, 8, 41
    logits = torch.where(torch.rand(rows, pools) < 0.7, 0.0, torch.rand(rows, pools))
    logits = torch.where((logits == 0) & (torch.rand(rows, pools) < 0.5), -0.0, logits)
    assert (torch.signbit(logits) & (logits == 0)).sum() > 100
    seq = torch.randint((select + 1) * kpool, pools * kpool, (rows,), dtype=torch.int32)
    starts = torch.zeros(rows, dtype=torch.int32)
    want = torch.full((rows, 256), 777, dtype=torch.int32)
    topk.kpool_topk_ref(logits.clone(), seq, want, kpool=kpool, select_pools=select, row_starts=starts)
    got = torch.full_like(want, 5)
    if path in ("packed", "threshold"):
        config = topk.PACKED_CONFIG if path == "packed" else topk.THRESHOLD_CONFIG
        topk.kpool_topk(logits, seq, got, kpool=kpool, select_pools=select, row_starts=starts,
                        config=config)
    elif path == "radix":
        topk.kpool_topk(logits, seq, got, kpool=kpool, select_pools=select, row_starts=starts, config=topk.RADIX)
    else:  # decode's two stages, every row split into slices
        ws = topk.kpool_topk_workspace(rows, select, num_sms=1, device="cpu", slices=4)
        topk.kpool_topk(logits, seq, got, kpool=kpool, select_pools=select, workspace=ws, direct_max=select,
                        config=topk.RADIX)
    assert torch.equal(got, want)
