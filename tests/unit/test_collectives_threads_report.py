"""The thread rig's judge (bench/gpu/collectives_threads_report.py) on synthetic rows: nccl-tests'
columns, the serial-copy efficiency, the three targets as measured/limit ratios, the tables."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench" / "gpu"))
import collectives_threads_report as rep  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
CEIL = {"d2h": 50.0, "h2d": 50.0, "bidir_each": 45.0}


def raw(op, world, rank_bytes, us, *, dtype="bf16", variant="default", graph=True, wrong=0,
        algorithm="one_shot", d2h=None, h2d=None):
    d2h = rank_bytes if d2h is None else d2h
    h2d = (world - 1) * rank_bytes if h2d is None else h2d
    return {"phase": "t", "world": world, "op": op, "dtype": dtype, "rank_numel": rank_bytes // 2,
            "variant": variant, "graph": graph, "label": "", "rank_bytes": rank_bytes, "us": us,
            "wrong": wrong, "calls": 20, "replays": 5, "algorithm": algorithm, "d2h": "sm",
            "h2d": "sm", "payload_bytes_d2h": d2h, "payload_bytes_h2d": h2d}


def doc(rows):
    d = {"meta": {"label": "test", "gpu": "X", "torch": "t", "triton": "3", "measured_at": "now"},
         "ceiling": CEIL, "raw": rows, "skipped": [], "errors": []}
    d["rows"] = rep.derive(rows, CEIL)
    d["targets"] = rep.targets(d["rows"])
    return d


def test_nccl_columns_and_serial_copy_efficiency():
    r = rep.derive([raw("all_reduce", 4, 8 * MiB, 2000.0), raw("all_gather", 4, MiB, 500.0,
                                                               algorithm="gather")], CEIL)
    ar, ag = r
    assert ar["bytes"] == 8 * MiB and ar["algbw_GBps"] == pytest.approx(8 * MiB / 2e-3 / 1e9, rel=1e-3)
    assert ar["busbw_GBps"] == pytest.approx(ar["algbw_GBps"] * 1.5, rel=1e-3)
    # 4 ranks x (8 MiB out + 24 MiB in) at 50 GB/s, over 2 ms
    assert ar["serial_copy_eff"] == pytest.approx(4 * 32 * MiB / 50e9 / 2e-3, rel=1e-3)
    assert ag["bytes"] == 4 * MiB and ag["busbw_GBps"] == pytest.approx(ag["algbw_GBps"] * 0.75, rel=1e-3)
    assert ar["graph"] == "captured" and ar["wrong"] == 0


def test_targets_are_ratios_per_rank_count_and_variant():
    rows = [raw("all_reduce", 2, s, us, variant=v) for v, us in (("memops-sm", 30.0), ("direct-ll", 12.0))
            for s in (4 * KiB, 16 * KiB, 64 * KiB)]
    rows += [raw("all_reduce", 2, 8 * MiB, 800.0), raw("all_reduce", 2, 8 * MiB, 400.0, dtype="int8",
                                                        d2h=4 * MiB, h2d=4 * MiB),
             raw("all_gather", 2, 4 * MiB, 700.0, algorithm="gather")]
    t = {c["what"]: c for c in doc(rows)["targets"]}
    lat = t["all_reduce bf16 <= 64 KiB, captured, direct-ll: max time (us)"]
    assert (lat["ratio"], lat["met"]) == (pytest.approx(12 / 25, abs=1e-3), True)
    assert not t["all_reduce bf16 <= 64 KiB, captured, memops-sm: max time (us)"]["met"]
    assert t["INT8 / bf16 all_reduce busbw >= 8 MiB, captured: min"]["measured"] == pytest.approx(2.0)
    eff = t["all_reduce bf16 >= 8 MiB, captured: min serial-copy efficiency"]
    assert eff["measured"] == pytest.approx(2 * 16 * MiB / 50e9 / 800e-6, abs=1e-3)


def probe(op, world, us):
    return {"phase": "t", "world": world, "op": op, "dtype": "bf16", "rank_numel": 0,
            "variant": "memops-sm", "graph": True, "label": "", "rank_bytes": 0, "us": us,
            "wrong": 0, "calls": 20, "replays": 5}


def test_tables_show_wrong_results_and_the_models_prediction():
    rows = [raw("all_reduce", 2, 4 * KiB, 20.0, variant="memops-sm", wrong=7),
            raw("all_reduce", 4, 4 * KiB, 25.0, variant="memops-sm"),
            raw("all_reduce", 2, 16 * MiB, 900.0, algorithm="one_shot")]
    d = doc(rows)
    text = rep.compact_table(d)
    assert "20.0 WRONG" in text and "16 MiB" in text and "#wrong over every row: 7" in text
    md = rep.markdown(d)
    assert "| 2 | all_reduce | bf16 | 16 MiB | captured | default |" in md


def test_the_fitted_terms_predict_the_decode_step_and_print_it_last():
    rows = [probe("barrier", n, 0.6 * n * 2 * (3 * (n - 1) + 2)) for n in (2, 4, 8)]
    rows += [probe("launch", n, 1.2) for n in (2, 4, 8)]
    for n in (2, 4, 8):  # LL: 1 us + one 3 us poll round + every rank's bytes at 50 GB/s
        for b in (4 * KiB, 16 * KiB, 64 * KiB):
            d2h, h2d = 2 * b, 2 * b * (n - 1)
            rows.append(raw("all_reduce", n, b, 4.0 + n * (d2h + h2d) / 50e3, variant="direct-ll",
                            algorithm="direct_ll", d2h=d2h, h2d=h2d))
    rows.append(raw("all_reduce", 8, 256 * KiB, 300.0, dtype="int8", d2h=135168, h2d=946176)
                | {"rel_err": 0.0071, "label": "decode x32 tokens, INT8 requested"})
    d = doc(rows)
    d["meta"]["direct_polls"] = "per round"
    d.update(rep.decode_prediction(d))
    terms = d["protocol_costs"]
    assert terms["per_memop_us"] == pytest.approx(0.6, rel=1e-3)
    ll = terms["paths"]["direct_ll"]
    assert ll["fixed_us"] + ll["per_poll_us"] == pytest.approx(4.0, abs=0.05)
    assert ll["rate_gbps"] == pytest.approx(50.0, rel=0.01)
    cells = {r["cell"]: r for r in d["decode_step_prediction"]}
    assert set(cells) == {"8x22k", "1x64k"} and cells["8x22k"]["calls"] == 104
    assert all({"cell", "calls", "ms", "bound"} <= set(r) for r in cells.values())
    assert cells["8x22k"]["ms"] > cells["1x64k"]["ms"] > 0
    int8 = next(lv for lv in d["decode_levers"] if lv["lever"] == "INT8 decode all-reduce")
    assert "0.71%" in int8["note"]
    text = rep.compact_table(d)
    assert text.rstrip().splitlines()[-1].startswith("| ")  # a table ends the output
    assert text.index("decode step's collectives") > text.index("#wrong over every row")
