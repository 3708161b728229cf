"""The gpu lane's verdicts: one `Case` (name, passed, detail, data) per line of the lane's record.

Pure judgement over what `vllm_lane_runs.run_lane` collected (numpy and the planner, no GPU), by
the lanes' noise-floor rule (tests/vllm/noise_floor.py) and the CPU lane's other bounds:

- bf16 runs (eager, graphs_full, graphs_piecewise) against transformers fp32 on the same GPU
  within transformers' bf16-vs-fp32 spread, greedy equal where the reference is decisive, against
  the CPU lane's fixture within the floor counted once per side;
- CUDA graphs against eager, each prompt alone and the issue's pair batched, and graphs alone
  against graphs batched: where two greedy runs part, a near-tie (the reference ranks exactly the
  two tokens first with a margin at or below the floor, and log p agreed within the floor before)
  or a defect; a defect fails the case;
- fp8 / fp8_ds_mla KV against bf16 KV (the GPU's eager run) and against the CPU lane's run of the
  same layout, within the CPU lane's FP8 bounds;
- MTP-3 against plain decoding of four copies (its verify shape), natural and steered drafts: the
  same tokens, or a near-tie reproduced by plain decoding alone or by the noise-floor rule;
- FP8 attention: the CPU lane's bounds on its text (the stdlib text's first 384 tokens: mean |d|
  vs BF16 <= 0.40 nats, perplexity within 5 %, closer to the exactly dequantised twin than to the
  original), run by vLLM's Fp8LinearMethod;
- EXL3 experts: served by the plugin's EXL3 MoE method, within the floor (x2) of transformers on the
  dequantised twin, no further from BF16 than 1.5x the quantisation's own effect plus twice the
  BF16 serving noise; graphed within the floor of eager;
- the OpenAI server and the planner: serve, bench and perplexity through glmctl's CLI; every KV
  capacity vLLM logged equals `glmctl plan`'s prediction for that GPU and setup.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from tests.gpu.vllm_lane_divergence import (
    NotRun,
    classify,
    divergence_text,
    engine,
    floor,
    margins,
    reference,
    steps_tokens,
)
from tests.gpu.vllm_lane_runs import (
    ENGINE_SETTINGS,
    GREEDY_TOKENS,
    KV_BYTES,
    STDLIB,
    LaneRun,
    engine_specs,
)
from tests.vllm import noise_floor as nf

GIB = 1 << 30
FP8_ATTN_MEAN, FP8_ATTN_PPL = 0.40, 0.05  # tests/vllm/test_plugin_fp8_attention.py


@dataclass
class Case:
    name: str
    passed: bool
    detail: str
    data: dict = field(default_factory=dict)


def _pooled(a: dict, b: dict) -> tuple[np.ndarray, np.ndarray]:
    names = [n for n in b if n in a and len(a[n]) == len(b[n])]
    return (np.concatenate([np.asarray(a[n], dtype=np.float64) for n in names]),
            np.concatenate([np.asarray(b[n], dtype=np.float64) for n in names]))


def mean_abs(a: dict, b: dict) -> float:
    x, y = _pooled(a, b)
    return float(np.abs(x - y).mean())


def ppl_change(quantised: dict, baseline: dict) -> float:
    q, b = _pooled(quantised, baseline)
    return math.exp(float(b.mean() - q.mean())) - 1


# -- the cases ------------------------------------------------------------------------------


def _vs_fixture(run: LaneRun, served: dict, dtype: str, fp8: bool = False) -> tuple[bool, str, dict]:
    if run.fixture is None:
        return False, f"no CPU-lane comparison: {run.fixture_note}", {}
    cpu = run.fixture["vllm_cpu"][dtype]
    ref = reference(run)
    if fp8:
        check = nf.fp8_kv_parity({n: served[n] for n in cpu}, cpu)
        return check.passed, f"vs CPU lane {dtype}: {check.summary()}", check.as_data()
    check = nf.logprob_parity(served, cpu, ref["float32"], ref["bfloat16"], sides=2,
                              routing_gaps=ref.get("routing_gap"))
    tf_moved = max(float(np.abs(np.asarray(ref["float32"][n]) - np.asarray(v)).max())
                   for n, v in run.fixture["transformers"]["float32"].items())
    ok = check.passed and tf_moved <= 1e-2
    text = (f"vs CPU lane: {check.summary()}; transformers fp32 GPU vs CPU max |d| {tf_moved:.1e} (limit 1e-2)"
            + ("" if check.passed else f" FAILED {check.failures}"))
    return ok, text, {**check.as_data(), "transformers_fp32_gpu_vs_cpu_max": tf_moved}


def _bf16_run(run: LaneRun, label: str) -> tuple[bool, list[str], dict]:
    e, ref = engine(run, label), reference(run)
    pl = e["prompt_logprobs"]
    tf = nf.logprob_parity(pl, ref["float32"], ref["float32"], ref["bfloat16"],
                           routing_gaps=ref.get("routing_gap"))
    greedy = nf.greedy_parity({n: steps_tokens(s) for n, s in e["greedy"]["alone"].items()},
                              {n: margins(s) for n, s in ref["greedy"].items()}, floor(run))
    fx_ok, fx_text, fx_data = _vs_fixture(run, pl, "auto")
    parts = [f"vs transformers fp32: {tf.summary()}" + ("" if tf.passed else f" FAILED {tf.failures}"),
             greedy.summary() + ("" if greedy.passed else f" FAILED {greedy.failures}"), fx_text]
    data = {"vs_transformers": tf.as_data(), "greedy": {"rows": greedy.rows, "failures": greedy.failures},
            "vs_cpu_lane": fx_data, "config": e["config"], "seconds": e["seconds"]}
    return tf.passed and greedy.passed and fx_ok, parts, data


def eager_case(run: LaneRun) -> Case:
    ok, parts, data = _bf16_run(run, "eager")
    found = classify(run, "eager")
    lines, defects = divergence_text(found)
    parts += lines or ["eager alone and batched: the same tokens"]
    data["divergences"] = [{"runs": lab, **d.as_data()} for lab, d in found]
    return Case("eager", ok and not defects, "; ".join(parts), data)


def batch_invariance_case(run: LaneRun) -> Case:
    """Every prompt alone against all eight in one batch (eager and FULL graphs): the same tokens
    wherever the reference is decisive; a parting is a near-tie (token or MoE routing, by the
    noise-floor rule) or a defect."""
    found = classify(run, "batch_invariance")
    if not found:
        raise NotRun("not run: no engine ran the prompts alone and in one batch of eight")
    lines, defects = divergence_text(found)
    same = sum(d.kind == "same" for _, d in found)
    detail = (f"{len(found)} prompt runs compared alone vs in a batch of {len(run.prompts) - 1}: {same} the same "
              "throughout" + ("; " + "; ".join(lines) if lines else ""))
    return Case("batch_invariance", not defects, detail,
                {"divergences": [{"runs": lab, **d.as_data()} for lab, d in found]})


def _eager_or_none(run: LaneRun) -> tuple[dict | None, str]:
    """The eager engine's report, or None and why: the cases that compare with it still report
    what they measured on their own when it is missing, and fail."""
    try:
        return engine(run, "eager"), ""
    except NotRun as exc:
        return None, f"not judged against eager ({exc})"[:600]


def graphs_case(run: LaneRun, label: str) -> Case:
    ok, parts, data = _bf16_run(run, label)
    e, (eager, no_eager) = engine(run, label), _eager_or_none(run)
    found = classify(run, label)
    lines, defects = divergence_text(found)
    mode = e["config"].get("cudagraph_mode")
    head = [f"resolved cudagraph_mode {mode}, compilation mode {e['config'].get('compilation_mode')}"]
    if eager is None:
        parts = [*head, *lines, no_eager, *parts]
        return Case(label, False, "; ".join(parts), data)
    same_pl = nf.logprob_parity(e["prompt_logprobs"], eager["prompt_logprobs"], reference(run)["float32"],
                                reference(run)["bfloat16"], sides=2)
    parts = [*head, *(lines or ["greedy: the same tokens as eager, alone and batched"]),
             f"prompt log p vs eager: mean |d| {same_pl.mean:.1e}, p99 {same_pl.p99:.1e}"
             + ("" if same_pl.passed else f" FAILED {same_pl.failures}"), *parts]
    data.update(divergences=[{"runs": lab, **d.as_data()} for lab, d in found], vs_eager=same_pl.as_data())
    return Case(label, ok and same_pl.passed and not defects and mode not in (None, "NONE"), "; ".join(parts), data)


def kv_case(run: LaneRun, label: str, dtype: str) -> Case:
    e, (eager, no_eager), ref = engine(run, label), _eager_or_none(run), reference(run)
    pl = e["prompt_logprobs"]
    vs_bf16 = nf.fp8_kv_parity(pl, eager["prompt_logprobs"]) if eager is not None else None
    fx_ok, fx_text, fx_data = _vs_fixture(run, pl, dtype, fp8=True)
    own = float(np.quantile(np.abs(np.subtract(*_pooled(pl, ref["float32"]))), 0.99))
    fl = max(floor(run), own)
    greedy = nf.greedy_parity({n: steps_tokens(s) for n, s in e["greedy"]["alone"].items()},
                              {n: margins(s) for n, s in ref["greedy"].items()}, fl)
    # FP8 noise can leave too few decisive steps to compare; that alone is no failure here
    greedy_ok = not [f for f in greedy.failures if "too few" not in f]
    cache = e["config"].get("cache_dtype")
    parts = [f"cache dtype {cache}", no_eager if vs_bf16 is None else f"vs bf16 KV (eager): {vs_bf16.summary()}"
             + ("" if vs_bf16.passed else f" FAILED {vs_bf16.failures}"), fx_text,
             f"decisive above this run's own p99 |d| vs fp32 ({fl:.3f}): " + greedy.summary()
             + ("" if greedy_ok else f" FAILED {greedy.failures}")]
    ok = vs_bf16 is not None and vs_bf16.passed and fx_ok and greedy_ok and cache == dtype
    return Case(label, ok, "; ".join(parts), {"vs_bf16_kv": vs_bf16.as_data() if vs_bf16 else None,
                                              "vs_cpu_lane": fx_data, "greedy": greedy.rows, "config": e["config"]})


def mtp3_greedy_case(run: LaneRun) -> Case:
    plain_engine, m = engine(run, "graphs_full"), engine(run, "mtp3")["mtp"]
    alone = plain_engine["greedy"]["alone"]
    natural_c, oracle_c = m["natural_counters"], m["oracle_counters"]
    problems = []
    drafts = natural_c.get("vllm:spec_decode_num_drafts", 0)
    if not drafts or natural_c.get("vllm:spec_decode_num_draft_tokens") != 3 * drafts:
        problems.append(f"natural drafts: counters {natural_c}")
    per_pos = oracle_c.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []
    accepted, proposed = (oracle_c.get("vllm:spec_decode_num_accepted_tokens", 0),
                          oracle_c.get("vllm:spec_decode_num_draft_tokens", 0))
    if len(per_pos) != 3 or not all(n > 0 for n in per_pos) or not 0 < accepted < proposed:
        problems.append(f"steered drafts did not accept 0-3 as scheduled: {oracle_c}")
    lines = []
    found = classify(run, "mtp3")
    for label, d in found:
        if d.kind == "same":
            continue
        spec = m["natural" if label.endswith("natural") else "oracle"][d.prompt]
        reproduced = steps_tokens(alone[d.prompt][: d.step + 1]) == steps_tokens(spec[: d.step + 1])
        if reproduced:
            lines.append(f"{label} {d.prompt}: parts at step {d.step}, a near-tie plain decoding alone resolves "
                         "the same way")
        else:
            lines.append(f"{label} {d.prompt}: parts at step {d.step}, {d.kind} ({d.reason})")
            if d.kind == "defect":
                problems.append(lines[-1])
    same = sum(1 for _, d in found if d.kind == "same")
    detail = (f"{same}/{len(found)} runs ({len(m['natural'])} prompts x natural, steered; {GREEDY_TOKENS} tokens) "
              f"equal plain decoding of 4 copies; natural: {drafts} drafts, acceptance "
              f"{natural_c.get('vllm:spec_decode_num_accepted_tokens', 0)}/{natural_c.get('vllm:spec_decode_num_draft_tokens', 0)}; "
              f"steered: accepted per position {per_pos}; " + "; ".join(lines or ["no partings"])
              + (f"; FAILED: {problems}" if problems else ""))
    return Case("mtp3_greedy", not problems, detail, {"divergences": [{"runs": lab, **d.as_data()} for lab, d in found],
                                                      "natural_counters": natural_c, "oracle_counters": oracle_c})


def mtp3_sampled_case(run: LaneRun) -> Case:
    m = engine(run, "mtp3")["mtp"]
    a, b = m["sampled"]
    counters = m["sampled_counters"]
    problems = []
    if a["tokens"] != b["tokens"]:
        problems.append("the same seeded request gave different tokens twice")
    if len(a["tokens"]) != GREEDY_TOKENS and a["finish"] != "stop":
        problems.append(f"{len(a['tokens'])} tokens, finish {a['finish']}")
    if not all(math.isfinite(x) and x <= 0 for x in a["logprobs"]):
        problems.append("non-finite or positive logprobs")
    if not counters.get("vllm:spec_decode_num_drafts"):
        problems.append(f"no drafts for the sampled requests: {counters}")
    detail = (f"temperature 0.8, top-p 0.95, seed 7: {len(a['tokens'])} tokens ({a['finish']}), the same tokens "
              f"when repeated: {a['tokens'] == b['tokens']}; drafts {counters.get('vllm:spec_decode_num_drafts')}, "
              f"accepted {counters.get('vllm:spec_decode_num_accepted_tokens')}/"
              f"{counters.get('vllm:spec_decode_num_draft_tokens')}" + (f"; FAILED: {problems}" if problems else ""))
    return Case("mtp3_sampled", not problems, detail, {"counters": counters})


def fp8_attention_case(run: LaneRun) -> Case:
    """The CPU lane's bounds, on the text it measured them on (the first 384 tokens of the stdlib
    text): mean |d| vs BF16 <= 0.40 nats, perplexity within 5 %, and the served FP8 model closer to
    its exactly dequantised twin than to the original (<= 0.6x) and within 2x the BF16 run's own
    distance to its reference. Judged on the kernel an sm_89 node runs (Marlin FP8, weight-only:
    the twin is exactly its function); vLLM's sm_90 choice (W8A8, which also quantises the
    activations) is reported beside it."""
    e = engine(run, "fp8_attention")
    eager, ref, twin = engine(run, "eager"), reference(run), reference(run, "fp8_deq")

    def only(values: dict) -> dict:
        return {STDLIB: values[STDLIB]}

    pl, bf16 = only(e["prompt_logprobs"]), only(eager["prompt_logprobs"])
    methods = e["config"].get("quant_methods", {})
    fp8_units = methods.get("attention:Fp8LinearMethod", 0)
    vs_bf16, change = mean_abs(pl, bf16), ppl_change(pl, bf16)
    vs_twin, vs_orig = mean_abs(pl, only(twin["float32"])), mean_abs(pl, only(ref["float32"]))
    noise = mean_abs(bf16, only(ref["float32"]))
    checks = {f"{len(pl[STDLIB])} stdlib tokens: mean |d| vs BF16 {vs_bf16:.3f} <= {FP8_ATTN_MEAN}": vs_bf16 <= FP8_ATTN_MEAN,
              f"perplexity {change:+.2%} within 5%": abs(change) < FP8_ATTN_PPL,
              f"vs dequantised twin {vs_twin:.3f} <= 0.6 x vs original {vs_orig:.3f}": vs_twin <= 0.6 * vs_orig,
              f"vs twin <= 2 x the BF16 run's own distance {noise:.3f}": vs_twin <= 2 * noise,
              f"{fp8_units} attention units on vLLM's Fp8LinearMethod": fp8_units > 0}
    kernels = [ln for ln in e.get("kernel_lines", []) if "Fp8LinearMethod" in ln]
    if _on_cuda(run, "fp8_attention"):  # vLLM CPU has one FP8 linear path
        checks[f"linear kernel: {'; '.join(kernels) or 'not logged'}"] = any("Marlin" in ln for ln in kernels)
    lines = [ln for ln in e.get("plugin_lines", []) if "fp8 attention" in ln]
    w8a8 = _w8a8_figures(run, twin, ref, bf16)
    detail = ("; ".join(f"{k}{'' if v else ' FAILED'}" for k, v in checks.items())
              + (f"; log: {lines[0]}" if lines else "") + (f"; beside it, {w8a8['text']}" if w8a8 else ""))
    return Case("fp8_attention", all(checks.values()), detail, {"quant_methods": methods, "config": e["config"],
                                                                "kernel_lines": kernels, "w8a8": w8a8,
                                                                "all_prompts_vs_bf16": mean_abs(e["prompt_logprobs"],
                                                                                                eager["prompt_logprobs"])})


def _on_cuda(run: LaneRun, label: str) -> bool:
    return run.engines.get(label, {}).get("device", "CPU") != "CPU"


def _w8a8_figures(run: LaneRun, twin: dict, ref: dict, bf16: dict) -> dict | None:
    """vLLM's own sm_90 choice for the same checkpoint (reported, not judged)."""
    try:
        w = engine(run, "fp8_attention_w8a8")
    except NotRun:
        return None
    pl = {STDLIB: w["prompt_logprobs"][STDLIB]}
    figures = {"vs_bf16": mean_abs(pl, bf16), "vs_twin": mean_abs(pl, {STDLIB: twin["float32"][STDLIB]}),
               "vs_original": mean_abs(pl, {STDLIB: ref["float32"][STDLIB]}), "ppl_change": ppl_change(pl, bf16),
               "kernel_lines": [ln for ln in w.get("kernel_lines", []) if "Fp8LinearMethod" in ln]}
    figures["text"] = (f"W8A8 ({'; '.join(figures['kernel_lines']) or 'vLLM default'}): vs BF16 "
                       f"{figures['vs_bf16']:.3f}, vs twin {figures['vs_twin']:.3f}, vs original "
                       f"{figures['vs_original']:.3f}, perplexity {figures['ppl_change']:+.2%}")
    return figures


def _exl3_vs_references(run: LaneRun, label: str) -> tuple[dict, dict]:
    """One EXL3 engine against transformers on the dequantised twin and against the BF16 run."""
    engine(run, label)  # a case names the failure of its own inputs first
    ref, twin, eager = reference(run), reference(run, "exl3_deq"), engine(run, "eager")
    noise = mean_abs(eager["prompt_logprobs"], ref["float32"])
    effect = mean_abs(twin["float32"], ref["float32"])  # what the quantisation does, transformers fp32
    e = engine(run, label)
    pl = e["prompt_logprobs"]
    experts = e["config"].get("quant_methods", {}).get("experts:Exl3MoEMethod", 0)
    vs_twin, vs_bf16 = mean_abs(pl, twin["float32"]), mean_abs(pl, eager["prompt_logprobs"])
    limit = 1.5 * effect + 2 * noise
    checks = {f"{label}: {experts} MoE layers on Exl3MoEMethod": experts > 0,
              f"{label}: vs dequantised twin {vs_twin:.3f} <= 2 x BF16 noise {noise:.3f}": vs_twin <= 2 * noise,
              f"{label}: vs BF16 {vs_bf16:.3f} <= 1.5 x quantisation effect {effect:.3f} + 2 x noise "
              f"(ppl {ppl_change(pl, eager['prompt_logprobs']):+.1%})": vs_bf16 <= limit}
    return checks, {"quantisation_effect_fp32": effect, "bf16_noise": noise,
                    label: {"config": e["config"], "vs_twin": vs_twin, "vs_bf16": vs_bf16}}


def _verdict(name: str, checks: dict, data: dict, prefix: str = "") -> Case:
    detail = prefix + "; ".join(f"{k}{'' if v else ' FAILED'}" for k, v in checks.items())
    return Case(name, all(checks.values()), detail, data)


def _exl3_quantized(run: LaneRun) -> str:
    if "result" not in run.quantize.get("exl3", {}):
        return ""
    q = run.quantize["exl3"]["result"]
    return f"quantized on the GPU ({q.get('linears', '?')} linears, {q.get('seconds', 0):.1f} s); "


def exl3_case(run: LaneRun) -> Case:
    """EXL3 experts, eager: served by the plugin's EXL3 MoE method within the floor (x2) of
    transformers on the dequantised twin, and no further from BF16 than the quantisation moves it."""
    checks, data = _exl3_vs_references(run, "exl3_eager")
    return _verdict("exl3_experts", checks, data, _exl3_quantized(run))


def exl3_graphs_case(run: LaneRun) -> Case:
    """EXL3 experts under vLLM's default CUDA graphs: the eager case's bounds, and graphed against
    eager (prompt log p within the floor counted twice, greedy partings near-ties only)."""
    engine(run, "exl3_eager")
    checks, data = _exl3_vs_references(run, "exl3_graphs")
    g, ea, ref = engine(run, "exl3_graphs"), engine(run, "exl3_eager"), reference(run)
    same = nf.logprob_parity(g["prompt_logprobs"], ea["prompt_logprobs"], ref["float32"], ref["bfloat16"], sides=2,
                             routing_gaps=ref.get("routing_gap"))
    checks[f"graphed vs eager prompt log p: {same.summary()}"] = same.passed
    lines, defects = divergence_text(classify(run, "exl3"))
    checks["graphed vs eager greedy: " + ("; ".join(lines) or "the same tokens")] = not defects
    return _verdict("exl3_experts_graphs", checks, data)


def serve_case(run: LaneRun) -> Case:
    s = run.serve
    if "error" in s and not s.get("ready"):
        raise NotRun(s["error"] if s["error"].startswith("not run") else f"glmctl serve: {s['error']}")
    ready, comp = s.get("ready") or {}, s.get("completion") or {}
    bench, ppl = s.get("bench", {}), s.get("perplexity", {})
    bench_doc, ppl_doc = bench.get("json") or {}, ppl.get("json") or {}
    perplexity = ppl_doc.get("perplexity")
    checks = {
        f"glmctl serve ready in {s.get('startup_s')} s at {ready.get('endpoint')}": bool(ready.get("endpoint")),
        f"completion: {comp.get('tokens')} tokens": comp.get("tokens") == 8 and comp.get("logprobs_ok"),
        f"plugin active in the server ({len(s.get('log_plugin_lines', []))} lines)": any(
            "active" in ln for ln in s.get("log_plugin_lines", [])),
        f"glmctl bench exit {bench.get('rc')}": bench.get("rc") == 0 and bool(bench_doc),
        f"glmctl eval perplexity exit {ppl.get('rc')}, perplexity {perplexity}": ppl.get("rc") == 0
        and isinstance(perplexity, int | float) and math.isfinite(perplexity) and perplexity > 1,
        f"Ctrl-C: exit {s.get('exit_status')}": s.get("exit_status") == 0,
    }
    if "error" in s:
        checks[f"the lane's serve helper: {s['error']}"[:300]] = False
    detail = "; ".join(f"{k}{'' if v else ' FAILED'}" for k, v in checks.items())
    if not checks[next(k for k in checks if k.startswith("glmctl bench"))]:
        detail += f"; bench stderr: {bench.get('stderr_tail', '')[-300:]}"
    return Case("serve_http", all(checks.values()), detail,
                {"bench": bench_doc, "perplexity": ppl_doc, "log_errors": s.get("log_errors")})


def _planned_tokens(run: LaneRun, label: str, e: dict, ckpt: str, memory_gib: float) -> int:
    from glmctl.plan import gpu_node, load_model_spec, plan_capacity
    from glmctl.plan.serving_setup import ServingSetup, Speculative, WeightFormats

    args = engine_specs(run.prompts)[label][1]["llm"]
    model = load_model_spec(run.checkpoints[ckpt])
    spec = args.get("speculative_config")
    setup = ServingSetup(
        weights=WeightFormats.for_checkpoint(model.checkpoint_quant, model.fp8_attention),
        kv_cache_dtype={"auto": "auto"}.get(args["kv_cache_dtype"], args["kv_cache_dtype"]),
        speculative=Speculative(method="mtp", num_tokens=spec["num_speculative_tokens"]) if spec else Speculative(),
        max_model_len=ENGINE_SETTINGS["max_model_len"], max_num_seqs=ENGINE_SETTINGS["max_num_seqs"],
        max_num_batched_tokens=ENGINE_SETTINGS["max_num_batched_tokens"],
        enforce_eager=bool(args.get("enforce_eager")), enable_prefix_caching=args["enable_prefix_caching"])
    node = gpu_node(num_gpus=1, gpu_memory_gib=memory_gib, kv_cache_gib=KV_BYTES / GIB)
    return plan_capacity(model, node, setup).kv_tokens


def plan_case(run: LaneRun) -> Case:
    rows, problems = [], []
    s = run.serve
    if "error" not in s and s.get("ready"):
        served = s["ready"].get("kv_cache_tokens")
        preflight = s["ready"].get("planned_kv_cache_tokens")
        cli = ((s.get("plan") or {}).get("json") or {}).get("kv_tokens")
        rows.append(f"serve (tiny-gpu profile): vLLM logged {served}, serve's preflight planned {preflight}, "
                    f"`glmctl plan` {cli}")
        if not (served is not None and served == preflight == cli):
            problems.append(rows[-1])
    else:
        problems.append(f"serve: {s.get('error', 'no ready document')}"[:300])
    for label, (ckpt, _spec) in engine_specs(run.prompts).items():
        try:
            e = engine(run, label)
        except NotRun:
            continue
        kv = e.get("kv_log")
        if kv is None or ckpt not in run.checkpoints:
            problems.append(f"{label}: no KV cache line in vLLM's log")
            continue
        memory = (run.engines[label].get("device_memory_bytes") or 0) / GIB or 139.8
        try:
            planned = _planned_tokens(run, label, e, ckpt, memory)
        except Exception as exc:  # noqa: BLE001 - a planner refusal is a finding
            planned = f"planner error: {exc}"
        rows.append(f"{label} {kv['tokens']}/{planned}")
        if kv["tokens"] != planned:
            problems.append(f"{label}: vLLM logged {kv['tokens']:,} KV tokens, the planner predicts {planned}")
    detail = "; ".join(rows[:1]) + "; engines (logged/planned): " + ", ".join(rows[1:])
    if problems:
        detail += f"; FAILED: {problems}"
    return Case("plan_capacity", not problems and bool(rows), detail, {"rows": rows})


CASES = (
    ("eager", eager_case), ("graphs_full", lambda r: graphs_case(r, "graphs_full")),
    ("graphs_piecewise", lambda r: graphs_case(r, "graphs_piecewise")),
    ("kv_fp8", lambda r: kv_case(r, "kv_fp8", "fp8")), ("kv_fp8_ds_mla", lambda r: kv_case(r, "kv_fp8_ds_mla", "fp8_ds_mla")),
    ("mtp3_greedy", mtp3_greedy_case), ("mtp3_sampled", mtp3_sampled_case), ("fp8_attention", fp8_attention_case),
    ("exl3_experts", exl3_case), ("exl3_experts_graphs", exl3_graphs_case),
    ("batch_invariance", batch_invariance_case), ("serve_http", serve_case), ("plan_capacity", plan_case),
)


def judge(run: LaneRun, name: str) -> Case:
    fn = dict(CASES)[name]
    try:
        return fn(run)
    except NotRun as exc:
        return Case(name, False, str(exc)[:2000])
    except Exception as exc:  # noqa: BLE001 - a malformed report is this case's failure, not the lane's
        return Case(name, False, f"could not judge: {type(exc).__name__}: {exc}"[:2000])
