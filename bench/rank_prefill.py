"""A prefill chunk of one TP8 rank, component by component, beside the FLOPs and bytes each
component must do: `bench/results/rank-prefill-h200.json` from bench/rank_sim.py records with a
profiled `prefill` cell (bench/rank_sim_prefill.py).

    python bench/rank_prefill.py REC.json [REC.json ...] --out bench/results/rank-prefill-h200.json \\
        --source "H200, <date> (<run>)" [--peak-tflops F] [--copy-bw B]

`ttft_256k_s` is the record's one 256,000-token prompt on an idle server; `queue_8x227k_last_ttft_s`
the last first token of its 8x227k cell (eight prompts sent together, prefilled one after another).
Per profiled window (a few consecutive chunks of one long prompt) a `chunks` entry: `context`
(tokens cached before the chunk: the mean over the window's complete chunks, read from vLLM's step
annotation), `ms` (the chunk's GPU span, first kernel start to last kernel end), `wall_ms` (one step
annotation to the next: what a chunk adds to a TTFT; the profiler was on), and `components`: kernel
ms per kind (`rank_sim_profile.prefill_kind_of`), each beside `tflop` and `gbytes` from
`chunk_work`, `frac_peak` = FLOP / time / the peak and `frac_copy` = bytes / time / copy bandwidth.
`glue` sums activation, torch_glue, runner, sampler, memcpy and other (`glue_kinds` keeps each);
`gpu_idle` is the span less kernel time (the host's share: syncs, eager launches).

The peak: the record's own bf16 matmul rate (taken before its server started), else --peak-tflops
(default: H200_MEASURED_HERE of glmctl.plan.prediction.node_records); `peak` says which. The FP8
indexer's FLOPs are set against the bf16 peak too (an FP8 MMA could go twice as fast); EXL3's
trellis decoding is the experts' extra work, not counted as FLOPs.

The work model (`chunk_work`) is `glmctl.plan.prediction.prefill_work` (its module doc lists what
each kind is charged; the node prediction's prefill roofline uses the same). Runs on CPU (no torch).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from glmctl.plan import load_model_spec  # noqa: E402
from glmctl.plan.prediction import prefill_work  # noqa: E402
from glmctl.plan.prediction.node_records import H200_MEASURED_HERE  # noqa: E402
from glmctl.plan.prediction.prefill_work import MODELLED  # noqa: E402

TP = 8
TARGETS = {"ttft_256k_s": 10.0, "queue_8x227k_last_ttft_s": 70.0}
GLUE = ("activation", "torch_glue", "runner", "sampler", "memcpy", "other")
SINGLE_PROMPT = 256_000


def chunk_work(context: int, tokens: int = 2048, drafter_passes: int = 1, variant: str = "exl3",
               kv: str = "fp8") -> dict[str, tuple[float, float]]:
    return prefill_work.chunk_work(load_model_spec("glm-5.3-flash"), context, tokens, drafter_passes, variant, kv, TP)


def _complete_chunks(iterations: list[dict]) -> list[dict]:
    return [it for it in iterations if it.get("complete") and it.get("ctx_requests") and it.get("ctx_tokens")]


def chunk_entry(trace: dict, peak: float, copy_bw: float, drafter_passes: int = 1) -> dict | None:
    """One profiled window's complete chunks, averaged, beside the work model at their context."""
    its = _complete_chunks(trace.get("iterations") or [])
    if not its:
        return None
    n = len(its)
    ctx = [it["context"] for it in its if it.get("context") is not None]
    context = round(sum(ctx) / len(ctx)) if ctx else None
    tokens = round(sum(it["ctx_tokens"] for it in its) / n)
    us: dict[str, float] = {}
    for it in its:
        for k, v in it["us_by_kind"].items():
            us[k] = us.get(k, 0.0) + v / n
    span = sum(it["span_us"] for it in its) / n
    walls = [it["wall_us"] for it in its if it.get("wall_us")]
    work = chunk_work(context or 0, tokens, drafter_passes) if context is not None else {}

    def line(name: str, t_us: float, flop: float = 0.0, nbytes: float = 0.0) -> dict:
        floor = max(flop / peak, nbytes / copy_bw) * 1e3 if (flop or nbytes) else None
        return {"name": name, "ms": round(t_us / 1e3, 3), "tflop": round(flop / 1e12, 4),
                "frac_peak": round(flop / (t_us * 1e-6) / peak, 4) if flop and t_us else None,
                "gbytes": round(nbytes / 1e9, 3), "frac_copy": round(nbytes / (t_us * 1e-6) / copy_bw, 4)
                if nbytes and t_us else None, "floor_ms": None if floor is None else round(floor, 3),
                "bound": None if not (flop or nbytes) else ("compute" if flop / peak >= nbytes / copy_bw else "bandwidth")}

    comps = [line(k, us.get(k, 0.0), *work.get(k, (0.0, 0.0))) for k in MODELLED]
    glue = {k: round(us[k] / 1e3, 3) for k in GLUE if us.get(k)}
    comps.append(line("glue", sum(us.get(k, 0.0) for k in GLUE)))
    unknown = {k: v for k, v in us.items() if k not in MODELLED and k not in GLUE}
    for k, v in unknown.items():
        comps.append(line(k, v))
    busy = sum(us.values())
    comps.append(line("gpu_idle", max(0.0, span - busy)))
    flop = sum(f for f, _ in work.values())
    moe_calls = sum(r["calls_per_chunk"] for r in trace.get("kernels_table") or []
                    if r["kind"] == "routed_experts" and "exl3_moe" in r["name"])
    return {"context": context, "context_range": [min(ctx), max(ctx)] if ctx else None, "tokens": tokens,
            "chunks_averaged": n, "ms": round(span / 1e3, 2), "wall_ms": round(sum(walls) / len(walls) / 1e3, 2)
            if walls else None, "busy_ms": round(busy / 1e3, 2), "tflop": round(flop / 1e12, 3),
            "frac_peak": round(flop / (span * 1e-6) / peak, 4) if span else None,
            "floor_ms": round(sum(c["floor_ms"] or 0.0 for c in comps), 2), "components": comps,
            "glue_kinds": glue, "exl3_moe_calls_per_chunk": moe_calls or None, "trace": trace.get("trace"),
            "kernels": trace.get("kernels_table") or []}


def ttft_from_chunks(chunks: list[dict], prompt: int, chunk: int, fixed_s: float) -> float | None:
    """A prompt's TTFT from the measured chunks: each chunk's wall time linear in context between
    the windows (flat beyond them), plus the prompt's fixed time (admission + finish)."""
    pts = sorted((c["context"], c["wall_ms"] or c["ms"]) for c in chunks if c.get("context") is not None)
    if not pts:
        return None

    def at(x: float) -> float:
        if x <= pts[0][0]:
            return pts[0][1]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
            if x <= x1:
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        return pts[-1][1]

    return round(sum(at(s) for s in range(0, prompt, chunk)) / 1e3 + fixed_s, 2)


def prefill_doc(records: list[dict], source: str, peak_tflops: float | None = None,
                copy_bw: float = H200_MEASURED_HERE.memory_bandwidth_gbps * 1e9, notes: list[str] | None = None) -> dict:
    head = next(({k: r.get(k) for k in ("device", "vllm_version", "torch_version")} for r in records), {})
    measured = next((r["bf16_matmul"] for r in records if (r.get("bf16_matmul") or {}).get("bf16_tflops")), None)
    if measured:
        peak = {"bf16_tflops": measured["bf16_tflops"], "source": f"measured in the same run before the server: "
                f"{measured.get('how', '')}"}
    else:
        peak = {"bf16_tflops": peak_tflops or H200_MEASURED_HERE.bf16_tflops,
                "source": "--peak-tflops" if peak_tflops else H200_MEASURED_HERE.source}
    ttft = next((r["prefill_ttft_256k_s"] for r in records if r.get("prefill_ttft_256k_s")), None)
    queue = next((c for r in records for c in r.get("cells", []) if c.get("cell") == "8x227k" and c.get("ttft_s")), None)
    cell = next((c for r in records for c in r.get("cells", []) if c.get("cell") == "prefill"), None)
    mtp = next((int((r.get("settings") or {}).get("mtp") or 0) for r in records), 0)
    chunk = next((int((r.get("settings") or {}).get("chunk") or 2048) for r in records), 2048)
    chunks = [e for tr in (cell or {}).get("traces", [])
              if (e := chunk_entry(tr, peak["bf16_tflops"] * 1e12, copy_bw, 1 if mtp else 0))]
    doc = {**head, "source": source, "peak": peak, "copy_bw_bytes_per_s": copy_bw, "chunk_tokens": chunk,
           "ttft_256k_s": ttft,
           "queue_8x227k_last_ttft_s": None if not queue or None in queue["ttft_s"] else max(queue["ttft_s"]),
           "targets": TARGETS, "how": __doc__.split("\n\n")[1].strip(), "chunks": chunks}
    if queue and None in queue["ttft_s"]:
        doc["queue_note"] = f"a session of the 8x227k cell got no first token: {queue.get('no_window') or queue.get('errors')}"
    if cell:
        fixed = (cell.get("admission_s") or 0.0) + (cell.get("finish_s") or 0.0)
        doc["prefill_cell"] = {k: cell.get(k) for k in ("prompt_tokens", "profiled_ttft_s", "admission_s", "finish_s",
                                                        "windows", "skipped", "error")}
        doc["ttft_256k_from_chunks_s"] = ttft_from_chunks(chunks, SINGLE_PROMPT, chunk, fixed)
        doc["ttft_256k_from_chunks_basis"] = (
            "predicted from the profiled chunks' wall time (profiler on), linear in context between windows, "
            "+ the prefill cell's admission and finish time; beside ttft_256k_s as a check")
    else:
        doc["prefill_cell"] = {"absent": "no record has a 'prefill' cell (bench/rank_sim.py --cells ...,prefill)"}
    doc["notes"] = notes or []
    return doc


def node_prefill_measurement(records: list[dict]) -> dict | None:
    """The record's profiled chunk at the longest context as glmctl's `PrefillMeasurement` (one
    chunk's breakdown: what `glmctl plan --predict` scales to the node, the indexer with context):
    kernel us per kind, `gpu_idle_in_span` (span less kernel time) and `host_between_steps` (wall
    less span), neither of which the prediction scales."""
    best = None
    for r in records:
        chunk = int((r.get("settings") or {}).get("chunk") or 2048)
        for c in r.get("cells", []):
            for tr in c.get("traces", []) if c.get("cell") == "prefill" else []:
                its = [it for it in _complete_chunks(tr.get("iterations") or []) if it.get("context") is not None]
                if its and (best is None or min(it["context"] for it in its) > best[0]):
                    best = (min(it["context"] for it in its), its, chunk)
    if best is None:
        return None
    _, its, chunk = best
    n = len(its)
    us: dict[str, float] = {}
    for it in its:
        for k, v in it["us_by_kind"].items():
            us[k] = us.get(k, 0.0) + v / n
    span = sum(it["span_us"] for it in its) / n
    us["gpu_idle_in_span"] = max(0.0, span - sum(us.values()))
    walls = [it["wall_us"] for it in its if it.get("wall_us")]
    if walls:
        us["host_between_steps"] = max(0.0, sum(walls) / len(walls) - span)
    return {"chunk_tokens": chunk, "context_tokens": round(sum(it["context"] for it in its) / n),
            "breakdown_us": {k: round(v, 1) for k, v in us.items()}, "allreduce_dtype": "int8"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--source", required=True)
    ap.add_argument("--peak-tflops", type=float, default=None, help="when the record has no bf16 rate of its own")
    ap.add_argument("--copy-bw", type=float, default=H200_MEASURED_HERE.memory_bandwidth_gbps * 1e9)
    ap.add_argument("--note", action="append", default=[])
    args = ap.parse_args()
    doc = prefill_doc([json.loads(p.read_text()) for p in args.records], args.source, args.peak_tflops,
                      args.copy_bw, args.note)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(args.out)
    print(f"peak {doc['peak']['bf16_tflops']} TFLOP/s bf16; 256k TTFT {doc['ttft_256k_s']} s (target "
          f"{TARGETS['ttft_256k_s']}), from chunks {doc.get('ttft_256k_from_chunks_s')} s; last of 8x227k "
          f"{doc['queue_8x227k_last_ttft_s']} s (target {TARGETS['queue_8x227k_last_ttft_s']})")
    print(f"{'context':>8} {'ms':>7} {'wall ms':>7} {'TFLOP':>6} {'of peak':>7}  top components (ms, frac_peak)")
    for c in doc["chunks"]:
        top = sorted(c["components"], key=lambda x: -x["ms"])[:5]
        print(f"{c['context']!s:>8} {c['ms']:>7} {c['wall_ms']!s:>7} {c['tflop']:>6} {c['frac_peak']!s:>7}  "
              + ", ".join(f"{x['name']} {x['ms']:.1f} ({x['frac_peak']})" for x in top))
    if not doc["chunks"]:
        print("no profiled prefill chunk in the records")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
