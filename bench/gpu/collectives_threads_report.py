"""Rows, targets and tables of the thread rig's results (pure Python: re-derivable from the JSON
anywhere, and unit-tested on CPU). `collectives_threads.py` measures; this module judges.

Row fields: op, ranks, dtype (bf16 | int8 | fp32; int8 = bf16 messages sent as INT8 payloads),
bytes (nccl-tests' size: all-reduce input, all-gather output), rank_bytes (each rank's input),
graph ("captured" | "eager"), path (the plan's algorithm, `_int8` for INT8 payloads: with variant
"default", the path the auto rule picks), time_us, algbw_GBps (bytes / time), busbw_GBps (algbw *
2(n-1)/n for all-reduce, (n-1)/n for all-gather), wrong (#wrong), rel_err (INT8: the worst relative
RMS error against the exact sum), and how: variant, algorithm, d2h/h2d, serial_copy_eff.

After the rows: the protocol's terms fitted from them (`cost_terms.fit_costs`), and with those
terms the decode step's collectives on the report's node (`decode_step_prediction`, `decode_levers`;
predicted, not measured).

serial_copy_eff = T_serial / time, with T_serial = n * (D2H / B_d2h + H2D / B_h2d): the time the
bytes this implementation moves would take as back-to-back copies at the pinned bandwidth measured
in the same run (D2H, H2D: bytes one rank moves each way, `plan.bytes_moved()`; n ranks, because
here every rank's bytes cross the same link; B: copy-engine bandwidth of 64 MiB copies, one
direction at a time). Above 1 means the directions overlapped.
"""

from __future__ import annotations

from glmctl.collectives import cost_model, cost_terms

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
                       path=r["algorithm"] + ("_int8" if r["dtype"] == "int8" else ""),
                       d2h=r["d2h"], h2d=r["h2d"],
                       payload_bytes_d2h=r["payload_bytes_d2h"],
                       payload_bytes_h2d=r["payload_bytes_h2d"], serial_copy_eff=round(serial / t, 3))
            if r.get("rel_err") is not None:
                row["rel_err"] = round(r["rel_err"], 5)
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


SMALL_VARIANTS = ("memops-sm", "direct-ll", "direct-1s", "direct-2s", "default")


def small_table(rows: list[dict]) -> str:
    """Small all-reduces and gathers, captured: time (us) by path variant, one line per size
    ("default": the auto rule's path)."""
    names = [v for v in SMALL_VARIANTS if any(r["variant"] == v for r in rows)]
    small = [r for r in rows if r["graph"] == "captured" and r["op"] in ("all_reduce", "all_gather")
             and r["variant"] in names and r["dtype"] != "int8" and r["rank_bytes"] <= 512 * KiB]
    lines = ["| ranks | op | size/rank | " + " | ".join(names) + " |", "|" + "---|" * (3 + len(names))]
    keys = sorted({(r["ranks"], r["op"], r["rank_bytes"]) for r in small})
    for n, op, b in keys:
        cells = []
        for v in names:
            hit = [r for r in small if (r["ranks"], r["op"], r["rank_bytes"], r["variant"]) == (n, op, b, v)]
            cells.append(f"{hit[0]['time_us']:.1f}" + ("" if not hit[0]["wrong"] else " WRONG")
                         if hit else "-")
        lines.append(f"| {n} | {op} | {_size(b)} | " + " | ".join(cells) + " |")
    probes = [r for r in rows if r["op"] in ("barrier", "fence", "launch")]
    for r in probes:
        lines.append(f"| {r['ranks']} | {r['op']} alone | - | {r['time_us']:.1f} |"
                     + "  |" * (len(names) - 1))
    return "\n".join(lines)


def target_lines(checks: list[dict]) -> list[str]:
    return [f"- ranks {c['ranks']}: {c['what']}: {c['measured']} vs {c['limit']} -> measured/limit "
            f"{c['ratio']} ({'met' if c['met'] else 'NOT met'})" for c in checks]


def fitted_costs(doc: dict) -> cost_terms.ProtocolCosts | None:
    """This run's protocol terms (`cost_terms.record_costs`), over the module's for paths it
    lacks; None when it has no barrier rows to fit the memop cost from."""
    if not any(r["op"] == "barrier" for r in doc.get("rows", [])):
        return None
    fit = cost_terms.record_costs(doc)
    return cost_terms.ProtocolCosts(source=fit.source, per_memop_us=fit.per_memop_us,
                                    rig_ceiling_gbps=fit.rig_ceiling_gbps,
                                    paths={**cost_model.PROTOCOL_COSTS.paths, **fit.paths})


def decode_prediction(doc: dict) -> dict:
    """The decode step's collectives on the report's node with this run's terms (predicted; the
    module's terms when the run has no barrier rows to fit), the levers, and the terms."""
    costs = fitted_costs(doc) or cost_model.PROTOCOL_COSTS
    try:
        from glmctl.plan.prediction.decode_collectives import decode_levers, decode_step_prediction
    except ImportError as exc:  # the planner needs pydantic
        return {"decode_step_prediction_error": f"{exc!r}"}

    int8 = [r for r in doc["rows"] if r.get("rel_err") is not None and r["ranks"] == 8
            and r["label"].startswith("decode")]
    err = (f"relative RMS {100 * max(r['rel_err'] for r in int8):.2f}% at worst over the rig's "
           f"8-rank decode sizes ({', '.join(r['path'] for r in int8[:1])})") if int8 else ""
    return {"protocol_costs": {"source": costs.source, "per_memop_us": costs.per_memop_us,
                               "rig_ceiling_gbps": costs.rig_ceiling_gbps,
                               "paths": {p: vars(t) for p, t in costs.paths.items()}},
            "decode_step_prediction": decode_step_prediction(costs=costs),
            "decode_step_prediction_int8": decode_step_prediction(costs=costs, int8_all_reduce=True),
            "decode_levers": decode_levers(costs=costs, int8_rel_err=err)}


def decode_lines(doc: dict) -> list[str]:
    """The decode-step prediction as the table printed last."""
    rows = doc.get("decode_step_prediction") or []
    if not rows:
        return []
    out = ["decode step's collectives on 8x L40, PREDICTED from this run's fitted terms "
           f"(links 25 GB/s, host memory {cost_model.L40_NODE.host_gbps:g} GB/s: stated inputs):",
           "| cell | calls | ms | bound | latency ms | data ms | ms if host caches hold it | paths |",
           "|---|---|---|---|---|---|---|---|"]
    int8 = [r | {"cell": r["cell"] + " INT8=all"} for r in doc.get("decode_step_prediction_int8")
            or []]
    for r in rows + int8:
        paths = ", ".join(f"{p} x{n}" for p, n in r["paths"].items())
        out.append(f"| {r['cell']} | {r['calls']} | {r['ms']:.2f} | {r['bound']} | "
                   f"{r['latency_ms']:.2f} | {r['data_ms']:.2f} | "
                   f"{r['ms_if_host_caches_hold_it']:.2f} | {paths} |")
    levers = doc.get("decode_levers") or []
    if levers:
        out += ["", "| lever | cell | ms | saved ms |", "|---|---|---|---|"]
        out += [f"| {lv['lever']} | {lv['cell']} | {lv['ms']:.2f} | {lv['saved_ms']:.2f} |"
                for lv in levers]
    return out


def model_lines(doc: dict) -> list[str]:
    """The protocol terms this run measured, and the model's prefill predictions for the report's
    node with them (labelled predicted)."""
    costs = fitted_costs(doc)
    if costs is None:
        return []
    terms = ", ".join(f"{p} {t.fixed_us:g}+{t.per_poll_us:g}/poll @{t.rate_gbps:g} GB/s"
                      for p, t in costs.paths.items())
    return [f"protocol terms fitted from this run: {costs.per_memop_us:g} us per memop; {terms}",
            "predicted for the report's node with them:", *cost_model.report_lines(costs=costs)]


def markdown(doc: dict) -> str:
    meta, ceil = doc["meta"], doc["ceiling"]
    rows = doc.get("rows", [])
    md = [f"# Host-staged collectives — {meta['label']}", "",
          f"GPU {meta['gpu']}, torch {meta['torch']}, triton {meta.get('triton')}, "
          f"{meta['measured_at']}. Pinned copies (64 MiB, copy engine): D2H {ceil['d2h']:.1f} GB/s, "
          f"H2D {ceil['h2d']:.1f} GB/s, both at once {ceil['bidir_each']:.1f} GB/s each.", "",
          "Small messages by path (captured graphs, time per call in us):", "", small_table(rows), "",
          *target_lines(doc.get("targets", [])), "", *model_lines(doc), "", sweep_table(rows), "",
          *decode_lines(doc), ""]
    if doc.get("skipped"):
        md += ["Skipped for time: " + "; ".join(doc["skipped"]), ""]
    if doc.get("errors"):
        md += ["Errors: " + "; ".join(doc["errors"]), ""]
    return "\n".join(md)


def auto_table(rows: list[dict]) -> str:
    """The default (auto) path's captured rows at the decode sizes: the issue's record."""
    auto = sorted((r for r in rows if r["variant"] == "default" and r["graph"] == "captured"
                   and r["op"] in ("all_reduce", "all_gather") and r["rank_bytes"] <= 2 * MiB),
                  key=lambda r: (r["ranks"], r["op"], r["dtype"], r["bytes"]))
    lines = ["| ranks | op | dtype | size | path | us | #wrong | INT8 rel err | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in auto:
        rel = f"{100 * r['rel_err']:.2f}%" if r.get("rel_err") is not None else ""
        lines.append(f"| {r['ranks']} | {r['op']} | {r['dtype']} | {_size(r['bytes'])} | "
                     f"{r['path']} | {r['time_us']:.1f} | {r['wrong']} | {rel} | {r['label']} |")
    return "\n".join(lines)


def compact_table(doc: dict) -> str:
    """What the stage prints: small-message paths, the auto path at the decode sizes, the sweep
    (if run), the targets, the fitted terms; last, the decode step's collectives predicted."""
    rows = doc.get("rows", [])
    out = ["small messages, captured, us per call:", small_table(rows), "",
           "auto path (variant default) at the decode sizes, captured:", auto_table(rows), ""]
    main = [r for r in rows if r["variant"] == "default" and r["graph"] == "captured" and not
            r["label"].startswith(("decode", "logits")) and r["bytes"] >= 4 * MiB]
    if main:
        cols = [("all_reduce", "bf16"), ("all_reduce", "int8"), ("all_gather", "bf16")]
        out.append("sweep >= 4 MiB, captured, default paths: us (serial-copy eff) [#wrong if any]")
        out.append("ranks size      " + "".join(f"{o[4:]}/{d:<14}" for o, d in cols))
        for n, b in sorted({(r["ranks"], r["bytes"]) for r in main}):
            cells = []
            for op, d in cols:
                hit = _pick(main, ranks=n, bytes=b, op=op, dtype=d)
                cells.append(f"{hit[0]['time_us']:.0f} ({hit[0]['serial_copy_eff']:.2f})"
                             + (f" [{hit[0]['wrong']}]" if hit[0]["wrong"] else "") if hit else "-")
            out.append(f"{n:<5} {_size(b):<9} " + "".join(f"{c:<22}" for c in cells))
    checks = [c for c in doc.get("targets", []) if "max time" not in c["what"] or "default" in c["what"]]
    wrong = sum(r["wrong"] for r in rows)
    out += ["", *model_lines(doc), "", *target_lines(checks), f"#wrong over every row: {wrong}"]
    if doc.get("skipped"):
        out.append("skipped for time: " + "; ".join(doc["skipped"]))
    if doc.get("errors"):
        out.append("errors: " + "; ".join(e[:300] for e in doc["errors"]))
    return "\n".join([*out, "", *decode_lines(doc)])
