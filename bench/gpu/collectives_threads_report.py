"""Rows, targets and tables of the thread rig's results (pure Python: re-derivable from the JSON
anywhere, and unit-tested on CPU). `collectives_threads.py` measures; this module judges.

Row fields: op, ranks, dtype (bf16 | int8 | fp32; int8 = bf16 messages sent as INT8 payloads),
bytes (nccl-tests' size: all-reduce input, all-gather output), rank_bytes (each rank's input),
graph ("captured" | "eager"), time_us, algbw_GBps (bytes / time), busbw_GBps (algbw * 2(n-1)/n for
all-reduce, (n-1)/n for all-gather), wrong (#wrong), and how: variant, algorithm, d2h/h2d,
serial_copy_eff.

serial_copy_eff = T_serial / time, with T_serial = n * (D2H / B_d2h + H2D / B_h2d): the time the
bytes this implementation moves would take as back-to-back copies at the pinned bandwidth measured
in the same run (D2H, H2D: bytes one rank moves each way, `plan.bytes_moved()`; n ranks, because
here every rank's bytes cross the same link; B: copy-engine bandwidth of 64 MiB copies, one
direction at a time). Above 1 means the directions overlapped.
"""

from __future__ import annotations

from glmctl.collectives import cost_model

KiB, MiB = 1 << 10, 1 << 20
LATENCY_LIMIT_US, SERIAL_EFF_TARGET, INT8_SPEEDUP_TARGET = 25.0, 0.8, 1.7


def derive(raw: list[dict], ceil: dict) -> list[dict]:
    rows = []
    for r in raw:
        n, t = r["world"], r["us"] * 1e-6
        row = {"op": r["op"], "ranks": n, "dtype": r["dtype"], "graph": "captured" if r["graph"]
               else "eager", "variant": r["variant"], "label": r.get("label", ""),
               "time_us": round(r["us"], 2), "wrong": r["wrong"]}
        if r["op"] in ("all_reduce", "all_gather"):
            rank_bytes = r["rank_bytes"]
            size = rank_bytes * (n if r["op"] == "all_gather" else 1)
            factor = 2 * (n - 1) / n if r["op"] == "all_reduce" else (n - 1) / n
            algbw = size / t / 1e9
            serial = n * (r["payload_bytes_d2h"] / (ceil["d2h"] * 1e9)
                          + r["payload_bytes_h2d"] / (ceil["h2d"] * 1e9))
            row.update(bytes=size, rank_bytes=rank_bytes, algbw_GBps=round(algbw, 3),
                       busbw_GBps=round(algbw * factor, 3), algorithm=r["algorithm"],
                       d2h=r["d2h"], h2d=r["h2d"],
                       payload_bytes_d2h=r["payload_bytes_d2h"],
                       payload_bytes_h2d=r["payload_bytes_h2d"], serial_copy_eff=round(serial / t, 3))
        else:
            row.update(bytes=0, rank_bytes=0)
        rows.append(row)
    return rows


def _pick(rows, **want):
    return [r for r in rows if all(r.get(k) == v for k, v in want.items())]


def targets(rows: list[dict]) -> list[dict]:
    """The issue's three targets, per rank count, as measured/limit ratios (with the variant)."""
    out = []
    for n in sorted({r["ranks"] for r in rows}):
        ar = [r for r in _pick(rows, op="all_reduce", ranks=n, dtype="bf16", graph="captured")
              if r["bytes"] <= 64 * KiB]
        for v in sorted({r["variant"] for r in ar}):
            mine = [r for r in ar if r["variant"] == v]
            if {4 * KiB, 16 * KiB, 64 * KiB} <= {r["bytes"] for r in mine}:
                worst = max(mine, key=lambda r: r["time_us"])
                out.append(_check(n, f"all_reduce bf16 <= 64 KiB, captured, {v}: max time (us)",
                                  worst["time_us"], LATENCY_LIMIT_US, higher_is_better=False))
        for op in ("all_reduce", "all_gather"):
            big = [r for r in _pick(rows, op=op, ranks=n, dtype="bf16", graph="captured",
                                    variant="default") if r["bytes"] >= 8 * MiB]
            if big:
                worst = min(big, key=lambda r: r["serial_copy_eff"])
                out.append(_check(n, f"{op} bf16 >= 8 MiB, captured: min serial-copy efficiency",
                                  worst["serial_copy_eff"], SERIAL_EFF_TARGET))
        q = [r for r in _pick(rows, op="all_reduce", ranks=n, dtype="int8", graph="captured",
                              variant="default") if r["bytes"] >= 8 * MiB]
        ratios = []
        for r in q:
            twin = _pick(rows, op="all_reduce", ranks=n, dtype="bf16", graph="captured",
                         variant="default", bytes=r["bytes"])
            if twin:
                ratios.append(r["busbw_GBps"] / twin[0]["busbw_GBps"])
        if ratios:
            out.append(_check(n, "INT8 / bf16 all_reduce busbw >= 8 MiB, captured: min",
                              min(ratios), INT8_SPEEDUP_TARGET))
    return out


def _check(n, what, measured, limit, higher_is_better=True):
    ratio = measured / limit
    return {"ranks": n, "what": what, "measured": round(measured, 3), "limit": limit,
            "ratio": round(ratio, 3), "met": ratio >= 1 if higher_is_better else ratio <= 1}


def _size(n: int) -> str:
    if n >= MiB and n % MiB == 0:
        return f"{n // MiB} MiB"
    return f"{n // KiB} KiB" if n % KiB == 0 else f"{n} B"


def sweep_table(rows: list[dict]) -> str:
    head = ("| ranks | op | dtype | size | graph | variant | algorithm | d2h/h2d | time us "
            "| algbw GB/s | busbw GB/s | serial eff | #wrong | note |")
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        if r["op"] not in ("all_reduce", "all_gather"):
            continue
        lines.append(f"| {r['ranks']} | {r['op']} | {r['dtype']} | {_size(r['bytes'])} | {r['graph']} "
                     f"| {r['variant']} | {r['algorithm']} | {r['d2h']}/{r['h2d']} "
                     f"| {r['time_us']:.1f} | {r['algbw_GBps']:.2f} | {r['busbw_GBps']:.2f} "
                     f"| {r['serial_copy_eff']:.2f} | {r['wrong']} | {r['label']} |")
    return "\n".join(lines)


def small_table(rows: list[dict]) -> str:
    """Small all-reduces and gathers, captured: time (us) by path variant, one line per size."""
    small = [r for r in rows if r["graph"] == "captured" and r["op"] in ("all_reduce", "all_gather")
             and r["variant"] in ("memops-sm", "memops-ce", "direct-ll", "direct-flag")]
    names = ["memops-sm", "memops-ce", "direct-ll", "direct-flag"]
    lines = ["| ranks | op | size/rank | " + " | ".join(names) + " |", "|" + "---|" * (3 + len(names))]
    keys = sorted({(r["ranks"], r["op"], r["rank_bytes"]) for r in small})
    for n, op, b in keys:
        cells = []
        for v in names:
            hit = [r for r in small if (r["ranks"], r["op"], r["rank_bytes"], r["variant"]) == (n, op, b, v)]
            cells.append(f"{hit[0]['time_us']:.1f}" + ("" if not hit[0]["wrong"] else " WRONG")
                         if hit else "-")
        lines.append(f"| {n} | {op} | {_size(b)} | " + " | ".join(cells) + " |")
    probes = [r for r in rows if r["op"] in ("barrier", "launch")]
    for r in probes:
        lines.append(f"| {r['ranks']} | {r['op']} alone | - | {r['time_us']:.1f} |  |  |  |")
    return "\n".join(lines)


def target_lines(checks: list[dict]) -> list[str]:
    return [f"- ranks {c['ranks']}: {c['what']}: {c['measured']} vs {c['limit']} -> measured/limit "
            f"{c['ratio']} ({'met' if c['met'] else 'NOT met'})" for c in checks]


def model_lines(doc: dict) -> list[str]:
    """The protocol costs this run measured, and the model's predictions for the report's node
    with them (labelled predicted)."""
    rows = doc.get("rows", [])
    if not rows:
        return []
    costs = cost_model.costs_from_rows(rows, doc["ceiling"], source=f"fitted from this run "
                                       f"({doc['meta']['measured_at']})")
    if not costs.paths:
        return []
    merged = cost_model.ProtocolCosts(  # paths this run did not measure keep the module's costs
        source=costs.source, paths={**cost_model.PROTOCOL_COSTS.paths, **costs.paths})
    return ["protocol costs fitted from this run (us, base + per_peer * (ranks - 1)): "
            + ", ".join(f"{p} {b:g}+{k:g}" for p, (b, k) in costs.paths.items()),
            "predicted for the report's node with them:", *cost_model.report_lines(costs=merged)]


def markdown(doc: dict) -> str:
    meta, ceil = doc["meta"], doc["ceiling"]
    rows = doc.get("rows", [])
    md = [f"# Host-staged collectives — {meta['label']}", "",
          f"GPU {meta['gpu']}, torch {meta['torch']}, triton {meta.get('triton')}, "
          f"{meta['measured_at']}. Pinned copies (64 MiB, copy engine): D2H {ceil['d2h']:.1f} GB/s, "
          f"H2D {ceil['h2d']:.1f} GB/s, both at once {ceil['bidir_each']:.1f} GB/s each.", "",
          "Small messages by path (captured graphs, time per call in us):", "", small_table(rows), "",
          *target_lines(doc.get("targets", [])), "", *model_lines(doc), "", sweep_table(rows), ""]
    if doc.get("skipped"):
        md += ["Skipped for time: " + "; ".join(doc["skipped"]), ""]
    if doc.get("errors"):
        md += ["Errors: " + "; ".join(doc["errors"]), ""]
    return "\n".join(md)


def compact_table(doc: dict) -> str:
    """What the stage prints last: small-message paths, targets, and the captured bf16 / INT8
    all-reduce and bf16 all-gather times by size."""
    rows = doc.get("rows", [])
    out = ["small messages, captured, us per call:", small_table(rows), ""]
    main = [r for r in rows if r["variant"] == "default" and r["graph"] == "captured" and not
            r["label"].startswith(("decode", "logits")) and r["bytes"] >= 256 * KiB]
    cols = [("all_reduce", "bf16"), ("all_reduce", "int8"), ("all_gather", "bf16")]
    out.append("sweep >= 256 KiB, captured, default paths: us (serial-copy eff) [#wrong if any]")
    out.append("ranks size      " + "".join(f"{o[4:]}/{d:<14}" for o, d in cols))
    for n, b in sorted({(r["ranks"], r["bytes"]) for r in main}):
        cells = []
        for op, d in cols:
            hit = _pick(main, ranks=n, bytes=b, op=op, dtype=d)
            cells.append(f"{hit[0]['time_us']:.0f} ({hit[0]['serial_copy_eff']:.2f})"
                         + (f" [{hit[0]['wrong']}]" if hit[0]["wrong"] else "") if hit else "-")
        out.append(f"{n:<5} {_size(b):<9} " + "".join(f"{c:<22}" for c in cells))
    checks = doc.get("targets", [])
    best: dict = {}  # the latency target: the fastest path per rank count only
    for c in checks:
        if "max time" in c["what"] and (c["ranks"] not in best or c["ratio"] < best[c["ranks"]]["ratio"]):
            best[c["ranks"]] = c
    checks = [c for c in checks if "max time" not in c["what"] or best[c["ranks"]] is c]
    out += ["", *model_lines(doc), "", *target_lines(checks)]
    if doc.get("skipped"):
        out.append("skipped for time: " + "; ".join(doc["skipped"]))
    if doc.get("errors"):
        out.append("errors: " + "; ".join(e[:300] for e in doc["errors"]))
    return "\n".join(out)
