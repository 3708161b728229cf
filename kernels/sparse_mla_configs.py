"""Named launch configurations of the sparse-MLA attention kernels.

Two kernels compute the same attention (see :mod:`.sparse_mla_prefill`):

* ``LAYOUT_HEADS_M`` (:mod:`.sparse_mla_prefill`): the heads are the M side of the products, in
  blocks of ``block_h`` = 16; any head count;
* ``LAYOUT_HEADS_N`` (:mod:`.sparse_mla_heads_n`): the heads are the N side (a native N of 8
  for TP8's 8 heads: no padded rows); at most 16 heads per rank.

``prefetch`` (heads-as-M only) double-buffers the row gathers in registers; ``reload`` gives the
value product its own load of the tile, so that Triton's pipeliner stages the gathers through
shared memory (``num_stages`` > 1); ``programs_per_sm`` is the occupancy the split-K planner
fills. Every entry of ``PREFILL_CONFIGS``, ``DECODE_CONFIGS``, ``DECODE_WIDE_CONFIGS`` and
``DECODE_CANDIDATES`` is compiled for sm_89 by ``tests/unit/test_kernels_sm89.py`` (shared memory <= 99 KB, no spills);
the candidates are what ``bench/kernels.py`` sweeps to choose the shipped decode entries.
"""

from __future__ import annotations

from dataclasses import dataclass

from .layouts import KV_BF16, KV_FP8, KV_FP8_DS_MLA

LAYOUT_HEADS_M = "hm"
LAYOUT_HEADS_N = "hn"


@dataclass(frozen=True)
class MLATileConfig:
    """One launch configuration of a sparse-MLA attention kernel."""

    name: str
    block_n: int
    num_warps: int
    num_stages: int
    layout: str = LAYOUT_HEADS_M
    block_h: int = 16
    prefetch: bool = False
    reload: bool = False
    programs_per_sm: int = 2


def _cfg(layout: str, block_n: int, warps: int, stages: int, *, prefetch: bool = False,
         reload: bool = False, block_h: int = 16, per_sm: int = 2) -> MLATileConfig:
    name = (f"{layout}-n{block_n}-w{warps}-s{stages}{'-prefetch' if prefetch else ''}"
            f"{'-reload' if reload else ''}{f'-h{block_h}' if block_h != 16 else ''}"
            f"{f'-x{per_sm}' if per_sm != 2 else ''}")
    return MLATileConfig(name, block_n, warps, stages, layout, block_h, prefetch, reload, per_sm)


HM, HN = LAYOUT_HEADS_M, LAYOUT_HEADS_N

# Prefill: many query tokens, no split-K; keeps the loop that skips tiles with no valid index
# (prefetch off), as measured in bench/results/kernels-h200.md.
PREFILL_CONFIGS = {
    (KV_FP8, 16): _cfg(HM, 32, 4, 1),
    (KV_FP8, 64): _cfg(HM, 32, 8, 1, block_h=32),
    (KV_FP8_DS_MLA, 16): _cfg(HM, 32, 4, 1),
    (KV_FP8_DS_MLA, 64): _cfg(HM, 32, 8, 1, block_h=32),
    (KV_BF16, 16): _cfg(HM, 64, 4, 2),
    (KV_BF16, 64): _cfg(HM, 32, 8, 2, block_h=32),
}

# Decode (split-K), by (cache format, up to this many heads per rank).
DECODE_CONFIGS = {
    (KV_FP8, 16): _cfg(HM, 32, 4, 1, prefetch=True),
    (KV_FP8, 64): _cfg(HM, 32, 8, 1, prefetch=True, block_h=32),
    (KV_FP8_DS_MLA, 16): _cfg(HM, 32, 4, 1, prefetch=True),
    (KV_FP8_DS_MLA, 64): _cfg(HM, 32, 8, 1, prefetch=True, block_h=32),
    (KV_BF16, 16): _cfg(HM, 64, 4, 2),
    (KV_BF16, 64): _cfg(HM, 32, 8, 2, block_h=32),
}
# Replaces a DECODE_CONFIGS entry for plans of at least WIDE_DECODE_ROWS query rows. Measured
# with Ada's instructions on the H200 (bench/results/kernels-h200.md): at 128 rows the heads-as-N
# kernel takes 97.3 / 122.8 us (fp8 / fp8_ds_mla) against 101.5 / 141.6 us; at 8 and 32 rows
# the heads-as-M one is as fast or faster (fp8 32 rows: 31.8 against 34.1 us). Rows in between
# were not measured. The plan fixes the choice per captured batch size.
WIDE_DECODE_ROWS = 128
DECODE_WIDE_CONFIGS = {
    (KV_FP8, 16): _cfg(HN, 64, 4, 1),
    (KV_FP8_DS_MLA, 16): _cfg(HN, 64, 4, 1),
}

# What the bench sweeps at TP8 (8 heads), per format. fp8 and fp8_ds_mla share the fp8
# operand path; bf16 tiles are twice the bytes, so fewer rows per tile fit.
_FP8_CANDIDATES = [
    _cfg(HM, 32, 4, 1, prefetch=True),
    _cfg(HM, 16, 4, 3, reload=True, per_sm=3),
    _cfg(HM, 16, 4, 4, reload=True, per_sm=3),
    _cfg(HM, 32, 8, 3, reload=True),
    _cfg(HM, 64, 8, 2, reload=True),
    _cfg(HN, 32, 4, 1, per_sm=3),
    _cfg(HN, 64, 4, 1),
    _cfg(HN, 32, 4, 2, reload=True),
    _cfg(HN, 32, 4, 3, reload=True),
    _cfg(HN, 64, 8, 3, reload=True),
]
DECODE_CANDIDATES = {
    KV_FP8: _FP8_CANDIDATES,
    KV_FP8_DS_MLA: _FP8_CANDIDATES,
    KV_BF16: [
        _cfg(HM, 64, 4, 2),
        _cfg(HM, 32, 4, 2, per_sm=3),
        _cfg(HN, 32, 4, 2, reload=True),
        _cfg(HN, 64, 4, 2),
        _cfg(HN, 32, 4, 1, per_sm=3),
    ],
}


def pick_decode_config(kv_format: str, num_heads: int, num_tokens: int) -> MLATileConfig:
    """The shipped decode entry for a plan of ``num_tokens`` query rows."""
    if num_tokens >= WIDE_DECODE_ROWS:
        fitting = sorted(h for f, h in DECODE_WIDE_CONFIGS if f == kv_format and h >= num_heads)
        if fitting:
            return DECODE_WIDE_CONFIGS[(kv_format, fitting[0])]
    return pick_config(DECODE_CONFIGS, kv_format, num_heads)


def pick_config(table: dict, kv_format: str, num_heads: int) -> MLATileConfig:
    """The entry of ``table`` for this cache format with the fewest heads >= ``num_heads``."""
    fitting = sorted(h for f, h in table if f == kv_format and h >= num_heads)
    if not fitting:
        raise ValueError(f"no {kv_format} sparse-MLA config for {num_heads} heads per rank")
    return table[(kv_format, fitting[0])]
