"""Where a decode step goes: vLLM's torch-profiler trace of a few engine iterations, kernel time
grouped by kind (`KINDS`, first match wins) per iteration, and the GPU-idle time inside the span;
where a prefill chunk goes: the same trace split at vLLM's step annotations (`chunk_breakdown`).

Iterations are counted by glmctl's mHC gate kernel (`ITERATION_MARKERS`, the first one present),
which runs twice per target layer per forward (the MTP layer has no mHC); the profiler's own
iteration limit is the fallback. `kernels_table` lists every kernel name above `TABLE_MIN_US` per
iteration with its kind and calls per iteration, so that no share hides in `other`. Only a
trace written after the profile was started is read (`since`), so a trace of an earlier run in the
same folder is never taken for this one.

`chunk_breakdown` splits a trace into engine iterations at vLLM's per-step annotation
(`execute_...`, a record_function range around each `execute_model`): a kernel belongs to the
iteration during whose range (up to the next one's start) its launch was issued, matched through
the profiler's correlation id; with `detailed_trace_annotation` on, the annotation also names the
chunk's context (`sk`, the sequence length after the chunk, less `sq`, its tokens). An iteration is
`complete` when the next one began inside the trace (the profiler may stop while the last one's
kernels run). In a prefill chunk the sort kernels are the MoE routing's (the EXL3 path sorts the
token-expert picks; the sampler sorts nothing there), so they count as routed experts
(`PREFILL_KINDS`).
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
import time
from pathlib import Path

# Kernel name -> kind, first match wins (lower-cased names). The MTP drafter's kernels are the
# same kernels as the target's and count in their kinds.
KINDS = (
    ("mla_attention", r"sparse_mla|_combine_kernel|mla_cache_write|flash_mla|flashmla"),
    ("indexer", r"indexer|kpool|fwht|topk_slices|_kpool_topk"),
    ("kda", r"kda|chunk_|fused_recurrent|gated_delta|causal_conv|fla_|recompute_w_u|solve_tril"
            r"|l2norm|gdn|kimi|wy_fast|cumsum_|chunk_local|norm_gated"
            r"|merge_16x16|_initial_states|_scatter_states|post_conv"),  # the last four: prefill only
    # the router's top-k and the EXL3 path's input staging belong to the experts' share
    ("routed_experts", r"exl3|fused_moe|moe_align|moe_sum|topk_softmax|grouped_topk|moe_|"
                       r"_moe|count_and_sort|expert|_coop_inputs|single_group_topk"),
    ("norms_mhc", r"_mix_partials|_mix_finalize|_mhc|rms_norm|rmsnorm|layernorm|layer_norm|mhc"),
    # block-FP8 linears: vLLM's Marlin W8A16 (what an sm_89 node gets), its Triton w8a8, glmctl's
    ("fp8_linear", r"marlin|w8a8_block|_w8a8|fp8_block|fp8_linear|_fp8_gemv|_fp8_mm"),
    ("dense_gemm", r"gemm|cutlass|cublas|xmma|matmul|gemv|splitk|sm90_|sm80_|ampere_|nvjet|dot_kernel"
                   r"|reduce_1block|_scaled_mm|fp8_quant|per_token_group_quant|quant"),
    ("activation", r"act_and_mul|silu|gelu|swiglu"),
    ("sampler", r"argmax|sampl|softmax|topk|top_k|sort|gumbel|logit|penalt|_rejection|_resample"
                r"|_combine_sampled|_insert_resampled|_get_num_sampled"),
    # vLLM's model-runner bookkeeping kernels (input preparation, slot mappings, draft updates)
    ("runner", r"_prepare_|_compute_slot_mappings|_update_draft|_post_update|_gather_block_tables"
               r"|_expand_idx|_fused_eh_norm|_bias_kernel|prefillchunkmetadata"),
    # torch's own elementwise / copy / index kernels between the ops (glue: casts, adds, cats)
    ("torch_glue", r"at::native|elementwise|copy|catarray|fill|arange|index|gather|scatter|memcpy32"
                   r"|triton_poi_|triton_per_|^kernel$"),
)
_KIND_RE = [(k, re.compile(p)) for k, p in KINDS]
# Kernels launched once per mHC block (2 per target layer per forward), first present wins.
ITERATION_MARKERS = ("_mix_finalize", "_mhc_gates", "_mhc_block")
TABLE_MIN_US = 1.0  # per iteration
# Checked before KINDS for a prefill chunk's kernels (see the module doc).
PREFILL_KINDS = (("routed_experts", r"radixsort|radix_sort|bitonicsort|segmented_sort|sortpairs|sort_pairs|sortkv"),)
_PREFILL_KIND_RE = [(k, re.compile(p)) for k, p in PREFILL_KINDS]
# vLLM's step annotation: detailed ("execute_N_context_R(sqQskS...)_generation_G(sqQ...") or simple
# ("execute_context_R(Q)_generation_G(Q)")
_STEP_DETAILED = re.compile(r"^execute_(\d+)_context_(\d+)\(sq(\d+)sk(\d+)\D.*_generation_(\d+)\(sq(\d+)")
_STEP_SIMPLE = re.compile(r"^execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")
CHUNK_TABLE_MIN_US = 5.0  # per chunk


def kind_of(name: str) -> str:
    if name.startswith(("Memcpy", "Memset")):  # the profiler's names for its copy and set events
        return "memcpy"
    low = name.lower()
    for kind, rx in _KIND_RE:
        if rx.search(low):
            return kind
    return "other"


def prefill_kind_of(name: str) -> str:
    low = name.lower()
    for kind, rx in _PREFILL_KIND_RE:
        if rx.search(low):
            return kind
    return kind_of(name)


def parse_step(name: str) -> dict | None:
    """vLLM's step annotation -> requests and tokens of its context (prefill) and generation parts;
    `ctx_seq` (detailed annotations only): the summed sequence lengths after the step."""
    m = _STEP_DETAILED.match(name)
    if m:
        _, ctx, sq, sk, gen, gen_sq = map(int, m.groups())
        return {"ctx_requests": ctx, "ctx_tokens": sq, "ctx_seq": sk, "gen_requests": gen, "gen_tokens": gen_sq}
    m = _STEP_SIMPLE.match(name)
    if m:
        ctx, sq, gen, gen_sq = map(int, m.groups())
        return {"ctx_requests": ctx, "ctx_tokens": sq, "ctx_seq": None, "gen_requests": gen, "gen_tokens": gen_sq}
    return None


def load_events(trace: Path) -> list[dict]:
    opener = gzip.open if trace.suffix == ".gz" else open
    with opener(trace, "rt") as f:
        return json.load(f).get("traceEvents", [])


def traces_since(profile_dir: Path, since: float) -> list[Path]:
    """Worker traces written after `since` (time.time()), oldest first (capture traces left out)."""
    return sorted((p for p in profile_dir.rglob("*.json*") if "capture" not in p.parts
                   and p.stat().st_mtime > since), key=lambda p: p.stat().st_mtime)


def chunk_breakdown(events: list[dict], layers: int) -> dict:
    """Kernel time per kind per engine iteration of one trace (see the module doc)."""
    steps = sorted((e for e in events if e.get("cat") == "user_annotation" and e.get("ph") == "X"
                    and str(e.get("name", "")).startswith("execute_")), key=lambda e: float(e["ts"]))
    if not steps:
        return {"error": "no step annotations (execute_...) in the trace"}
    launched = {e["args"]["correlation"]: float(e["ts"]) for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in (e.get("args") or {})}
    starts = [float(e["ts"]) for e in steps]
    its = [{"step": parse_step(e["name"]), "kernels": [], "wall_us": None} for e in steps]
    for i in range(len(its) - 1):
        its[i]["wall_us"] = round(starts[i + 1] - starts[i], 1)
    unassigned = 0
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset") or e.get("ph") != "X":
            continue
        t = launched.get((e.get("args") or {}).get("correlation"))
        i = bisect.bisect_right(starts, t) - 1 if t is not None else -1
        if i < 0:
            unassigned += 1
            continue
        its[i]["kernels"].append(e)
    names = {e.get("name", "") for it in its for e in it["kernels"]}
    marker = next((m for m in ITERATION_MARKERS if any(m in n for n in names)), None)
    out, table, complete = [], {}, 0
    for i, it in enumerate(its):
        ks, step = it["kernels"], it["step"] or {}
        by_kind: dict[str, float] = {}
        for e in ks:
            k = prefill_kind_of(e.get("name", "")) if e["cat"] == "kernel" else "memcpy"
            by_kind[k] = by_kind.get(k, 0.0) + float(e.get("dur", 0.0))
        busy = sum(by_kind.values())
        span = (max(float(e["ts"]) + float(e.get("dur", 0.0)) for e in ks) - min(float(e["ts"]) for e in ks)
                if ks else 0.0)
        blocks = sum(1 for e in ks if marker and marker in e.get("name", ""))
        is_complete = i + 1 < len(its) and (marker is None or blocks >= 2 * layers)
        seq, tokens = step.get("ctx_seq"), step.get("ctx_tokens")
        out.append({"annotation": steps[i]["name"][:160], "ctx_requests": step.get("ctx_requests"),
                    "ctx_tokens": tokens, "gen_tokens": step.get("gen_tokens"),
                    "context": None if seq is None or tokens is None else seq - tokens,
                    "complete": is_complete, "kernels": len(ks), "mhc_blocks": blocks,
                    "span_us": round(span, 1), "busy_us": round(busy, 1), "wall_us": it["wall_us"],
                    "us_by_kind": {k: round(v, 1) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}})
        if is_complete:
            complete += 1
            for e in ks:
                name = e.get("name", "")[:120]
                row = table.setdefault(name, {"kind": prefill_kind_of(name) if e["cat"] == "kernel" else "memcpy",
                                              "us": 0.0, "calls": 0})
                row["us"] += float(e.get("dur", 0.0))
                row["calls"] += 1
    rows = [{"name": k, "kind": r["kind"], "calls_per_chunk": round(r["calls"] / complete, 2),
             "us_per_chunk": round(r["us"] / complete, 1)}
            for k, r in sorted(table.items(), key=lambda kv: -kv[1]["us"]) if complete and r["us"] / complete >= CHUNK_TABLE_MIN_US]
    return {"iterations": out, "complete_iterations": complete, "unassigned_kernels": unassigned,
            "kernels_table": rows}


def breakdown(profile_dir: Path, steps: int, layers: int, since: float = 0.0, wait_s: float = 120.0) -> dict:
    """Kernel time per kind per engine iteration from the newest worker trace written after `since`
    (time.time()); see the module doc."""
    deadline = time.monotonic() + wait_s
    trace = None
    while time.monotonic() < deadline:
        files = traces_since(profile_dir, since)
        if files and time.time() - files[-1].stat().st_mtime > 3:  # written out (mtime is wall clock)
            trace = files[-1]
            break
        time.sleep(2)
    if trace is None:
        return {"error": f"no profiler trace under {profile_dir} written after the profile started "
                         f"(waited {wait_s:.0f} s)"}
    events = load_events(trace)
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
               and e.get("ph") == "X"]
    if not kernels:
        return {"error": f"{trace.name}: no kernel events"}
    per_kind: dict[str, float] = {}
    top: dict[str, float] = {}  # by name's first 120 characters
    top90: dict[str, float] = {}  # the summary's 90-character names, summed as before
    calls: dict[str, int] = {}
    kinds: dict[str, str] = {}
    for e in kernels:
        k = kind_of(e.get("name", "")) if e["cat"] == "kernel" else "memcpy"
        per_kind[k] = per_kind.get(k, 0.0) + float(e.get("dur", 0.0))
        name = e.get("name", "")[:120]
        top[name] = top.get(name, 0.0) + float(e.get("dur", 0.0))
        top90[name[:90]] = top90.get(name[:90], 0.0) + float(e.get("dur", 0.0))
        calls[name] = calls.get(name, 0) + 1
        kinds[name] = k
    for marker in ITERATION_MARKERS:
        finals = sum(1 for e in kernels if marker in e.get("name", ""))
        if finals >= 2 * layers:
            steps = finals / (2 * layers)
            break
    start = min(float(e["ts"]) for e in kernels)
    end = max(float(e["ts"]) + float(e.get("dur", 0.0)) for e in kernels)
    busy = sum(per_kind.values())
    span = end - start
    result = {k: round(v / steps, 1) for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1])}
    result["gpu_idle_in_span"] = round(max(0.0, span - busy) / steps, 1)
    return {"trace": trace.name, "iterations": round(steps, 2), "kernels": len(kernels),
            "span_us_per_iteration": round(span / steps, 1), "us_per_iteration": result,
            "top_kernels_us_per_iteration": {k: round(v / steps, 1) for k, v in
                                             sorted(top90.items(), key=lambda kv: -kv[1])[:25]},
            "kernels_table": [{"name": k, "kind": kinds[k], "calls_per_iteration": round(calls[k] / steps, 2),
                               "us_per_iteration": round(v / steps, 1)}
                              for k, v in sorted(top.items(), key=lambda kv: -kv[1]) if v / steps >= TABLE_MIN_US]}
