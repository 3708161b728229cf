"""Assemble the rank simulation's result file from bench/rank_sim.py's records: the issue's fields
(`kv_tokens` vLLM vs plan per variant, `decode_steps_per_s` per cell, `breakdown_us`,
`prefill_ttft_s`, `stock_vllm`, `predicted_node`) beside the measured-run header that
`glmctl plan --predict` reads (`source`, `device`, `rank_sim`: the records themselves, verbatim),
and, when a record has a profiled `prefill` cell, `prefill`: its chunk at the longest context
(`rank_prefill.node_prefill_measurement`), which the node's prefill prediction then scales kind by
kind instead of the measured TTFTs.

    python bench/rank_sim_results.py REC.json [REC.json ...] --out bench/results/rank-sim-h200.json \\
        --source "H200, 2026-12-01 (gpu-results/5, /6)" [--note TEXT ...] [--stock-reason TEXT]

The plan is `glmctl plan` for each record's own settings (its rank-config variant rebuilt here, the
GPU's total memory and utilization from the record, else the H200's 139.8 GiB with the record's
44.4 GiB budget, said so). Every L40 figure in `predicted_node` is the predictor's, labelled.
Runs on CPU (no torch).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rank_prefill import node_prefill_measurement  # noqa: E402

from glmctl.plan import gpu_node, load_model_spec, plan_capacity  # noqa: E402
from glmctl.plan.prediction.node_prediction import load_measured_run, predict_node  # noqa: E402
from glmctl.plan.prediction.node_records import H200_MEASURED_HERE  # noqa: E402
from glmctl.plan.prediction.rank import rank_model_spec, rank_weights  # noqa: E402
from glmctl.plan.presets import GLM53_FLASH  # noqa: E402
from glmctl.plan.serving_setup import ServingSetup, Speculative, WeightFormats  # noqa: E402

GIB = 1 << 30
H200_TOTAL_GIB = 139.8  # CUDA-visible H200 total, as the first run's 0.3176 x total = 44.4 GiB implies
CAPTURE = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48)  # bench/rank_sim_server.compilation's list
STOCK_NOT_RUN = (
    "not run: GPU time went to the plugin's cells. From vLLM 0.30's source, with GLMCTL_PLUGIN=off on the staged "
    "wheel it would stop while building the model: (1) models/glm5next/nvidia/model.py:406 imports "
    "model_executor/kernels/mhc/tilelang_kernels when kernel_config.enable_jit_warmup (default on), whose "
    "vllm/tilelang_utils raises ImportError('tilelang is required for mhc but is not installed') on CUDA; "
    "without the warm-up, MHCPreOp.forward_cuda (model_executor/layers/mhc.py:110) calls "
    "torch.ops.vllm.mhc_pre_tilelang, tilelang again; (2) SparseAttnIndexerKpool.__init__ "
    "(model_executor/layers/sparse_attn_indexer_kpool.py:918) raises 'Sparse Attention Indexer CUDA op "
    "requires DeepGEMM to be installed' because utils/import_utils.has_deep_gemm() trial-imports the vendored "
    "vllm.third_party.deep_gemm, whose extension does not load on torch 2.11 (not stable-ABI, "
    "../shared/tools/gpu-vllm-stage.sh). So no stock decode step or logprobs exist to compare; FlashMLA "
    "sparse itself (_flashmla_C) loads on sm_90.")


def variant_of(record: dict) -> str:
    model = str((record.get("settings") or {}).get("model", ""))
    return Path(model).name.removeprefix("rank-") or "exl3"


def plan_for(record: dict) -> dict:
    """`glmctl plan` for the record's settings, beside what vLLM logged."""
    from glmctl.testing.rank_config import rank_hf_config

    st, server = record.get("settings") or {}, record.get("server") or {}
    variant = variant_of(record)
    rank = rank_model_spec(load_model_spec("glm-5.3-flash"), 8)
    with tempfile.TemporaryDirectory() as tmp:
        config = rank_hf_config(rank, {"stop_token_ids": [0], "pad_token_id": 0}, GLM53_FLASH["indexer_types"],
                                variant)
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        model = load_model_spec(tmp)
    total = server.get("gpu_total_gib") or H200_TOTAL_GIB
    util = server.get("gpu_memory_utilization") or round(min(0.95, st.get("gpu_mem_gib", 44.4) / total), 4)
    mtp = int(st.get("mtp") or 0)
    setup = ServingSetup(
        tensor_parallel_size=1, kv_cache_dtype=st.get("kv", "fp8"),
        weights=WeightFormats.for_checkpoint(model.checkpoint_quant, model.fp8_attention),
        speculative=Speculative(method="mtp", num_tokens=mtp) if mtp else Speculative(),
        max_model_len=st.get("max_model_len", 262_144), max_num_seqs=st.get("max_num_seqs", 8),
        max_num_batched_tokens=st.get("chunk", 2048), gpu_memory_utilization=util, enable_prefix_caching=False,
        enforce_eager=bool(st.get("enforce_eager")),
        cudagraph_capture_sizes=[s for s in CAPTURE if s <= st.get("max_capture", 48)], kernel_block_size=16)
    plan = plan_capacity(model, gpu_node(num_gpus=1, gpu_memory_gib=total), setup)
    weights = sum(m.bytes for m in plan.memory if m.section in ("weights", "drafter") or m.key == "topk_buffers")
    out = {"plan": plan.kv_tokens, "plan_blocks": plan.num_blocks, "blocks_per_request": plan.blocks_per_request,
           "block_size": plan.kv_layout.block_size, "plan_kv_pool_gib": round(plan.kv_pool_bytes / GIB, 3),
           "budget": f"{util} x {total} GiB" + ("" if server.get("gpu_total_gib") else
                                                 " (the H200's total assumed: the record predates its logging)"),
           "plan_reserves_gib": {m.key: round(m.bytes / GIB, 3) for m in plan.memory if m.section == "reserve"},
           "weights_gib": {"plan_rank_model_with_buffers": round(weights / GIB, 3),
                           "plan_node_gpu_tp8": round(rank_weights(variant, 8, mtp=bool(mtp)).node_gpu_bytes / GIB, 3)}}
    if server.get("kv_tokens"):
        vllm = int(server["kv_tokens"])
        out.update(vllm=vllm, plan_over_vllm=round(plan.kv_tokens / vllm, 4),
                   vllm_kv_memory_gib=server.get("kv_memory_gib"),
                   vllm_blocks_derived=round(vllm / setup.max_model_len * plan.blocks_per_request, 2),
                   vllm_block_lines=server.get("block_lines", []))
        out["weights_gib"]["vllm_model_loading"] = server.get("weights_gib")
        split = {k: server[k] for k in ("consumed_gib", "peak_activation_gib", "cudagraph_gib") if k in server}
        out["vllm_memory_split_gib"] = split or "not in the saved log (the record's log kept only its tail)"
    return out


def cells_of(record: dict) -> dict:
    keep = ("steps_per_s", "step_ms", "decode_tok_s", "window_s", "measured_tokens_per_step", "accepted_per_step",
            "no_window", "skipped", "error")
    return {c["cell"]: {k: c[k] for k in keep if k in c} for c in record.get("cells", []) if "sessions" in c}


def assemble(records: list[dict], source: str, notes: list[str], stock_reason: str) -> dict:
    doc: dict = {"source": source, "device": H200_MEASURED_HERE.model_dump(), "tp": 8, "rank_sim": records}
    doc["kv_tokens"] = {f"{variant_of(r)}-mtp{(r.get('settings') or {}).get('mtp', 0)}": plan_for(r)
                        for r in records if (r.get("server") or {}).get("kv_tokens")}
    doc["decode_steps_per_s"] = {r["name"]: cells_of(r) for r in records}
    profiled = {f"{r['name']} {c['cell']}": c["breakdown"] for r in records for c in r.get("cells", [])
                if c.get("breakdown")}
    done = {k: v["us_per_iteration"] for k, v in profiled.items() if v.get("us_per_iteration")}
    doc["breakdown_us"] = done or {"absent": "; ".join(f"{k}: {v.get('error', 'no kernels')}" for k, v in profiled.items())
                                   or "no cell was profiled"}
    doc["prefill_ttft_s"] = {r["name"]: {c["cell"]: c.get("ttft_s") for c in r.get("cells", []) if c.get("ttft_s")}
                             | ({"256k": r["prefill_ttft_256k_s"]} if r.get("prefill_ttft_256k_s") else {})
                             for r in records}
    chunk = node_prefill_measurement(records)
    if chunk is not None:
        doc["prefill"] = chunk
    stock = [r for r in records if (r.get("settings") or {}).get("plugin") == "off"]
    doc["stock_vllm"] = {"measured": stock[0]} if stock else {"not_run": stock_reason}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "measured.json"
        path.write_text(json.dumps(doc))
        pred = predict_node(load_measured_run(path))
    doc["predicted_node"] = {
        "label": "predicted, 8x L40 (TP8); from the H200 rank steps above, scaled as each cell's basis says; "
                 "never a measurement",
        "collective_model": pred.collective_model, "acceptance": pred.acceptance,
        "cells": {f"{c.sessions}x{c.context_label} {c.speculative}": {
            "predicted_tok_s": c.predicted_tok_s, "range_tok_s": c.range_tok_s, "range_shares": c.range_shares,
            "report_tok_s": c.report_tok_s, "ratio_to_report": c.ratio_to_report,
            "report_implied_share": c.report_implied_share, "measured_step_ms": round(c.measured_step_us / 1e3, 3),
            "predicted_step_ms": round(c.predicted_step_us / 1e3, 2), "collectives_ms": round(c.collectives_us / 1e3, 2),
            "tokens_per_step": c.tokens_per_step, "dominated_by": c.dominated_by, "basis": c.label}
            for c in pred.cells},
        "prefill": [{"prompt_tokens": p.prompt_tokens, "predicted_ttft_s": p.predicted_ttft_s, "range_s": p.range_s,
                     "collectives_s": p.collectives_s, "report_s": p.report_s, "basis": p.label} for p in pred.prefill],
        "notes": pred.notes,
    }
    doc["notes"] = notes
    return doc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--source", required=True)
    ap.add_argument("--note", action="append", default=[])
    ap.add_argument("--stock-reason", default=STOCK_NOT_RUN)
    args = ap.parse_args()
    records = [json.loads(p.read_text()) for p in args.records]
    doc = assemble(records, args.source, args.note, args.stock_reason)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(args.out)
    for name, kv in doc["kv_tokens"].items():
        print(f"{name}: KV tokens vLLM {kv.get('vllm', '-'):,} plan {kv['plan']:,} ({kv.get('plan_over_vllm')}x); "
              f"weights {kv['weights_gib']}")
    for cell, c in doc["predicted_node"]["cells"].items():
        print(f"{cell}: predicted {c['predicted_tok_s']} tok/s (range {c['range_tok_s']}), report {c['report_tok_s']}")
    for p in doc["predicted_node"]["prefill"]:
        print(f"prefill {p['prompt_tokens']:,} tokens: predicted {p['predicted_ttft_s']} s (collectives "
              f"{p['collectives_s']} s), report {p['report_s']}: {p['basis']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
