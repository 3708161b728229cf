"""Subprocess body of the vLLM lanes: one (or a few) real `vllm.LLM` engines, offline, in this process.

    python tests/gpu/vllm_lane_engine.py REQUEST.json   -> one JSON line on stdout, prefixed "@@"

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so its configuration and
its drafter can be observed and steered from here. Device-agnostic: the caller passes the `vllm.LLM`
keyword arguments (CUDA: compilation config, fixed KV space; vLLM CPU: enforce_eager), so the gpu
lane and the CPU lane's fixture test run the same code. REQUEST:

    {"checkpoint": DIR, "engines": [{"label": "eager", "llm": {...LLM kwargs...},
      "prompts": {name: [token ids]},
      "prompt_logprobs": [names],                       # log p of every prompt token 1..n-1
      "greedy": {"tokens": N, "alone": [names], "batches": [[names]], "copies4": [names]},
      "mtp": {"tokens": N, "prompts": [names], "sampled": name}}]}

Greedy steps are {"token": id, "top": [[id, log p], [id, log p]]} (vLLM's top-2). "alone": each
prompt by itself (one-row decode steps); "batches": the listed prompts in one batch; "copies4":
four copies of the prompt in one batch (four rows per decode step, the row count of an MTP-3
verify step), first copy reported. "mtp" (an engine with speculative_config): each prompt with the
checkpoint's own drafts, then with drafts steered to accept 3, 2, 1, 0 in turn
(tests/vllm/mtp_parity.Oracle, steered along the natural run's output), then one seeded sampled
request, twice. Every engine also reports its resolved configuration ("config"), the KV capacity
vLLM logged ("kv_log") and seconds per phase; each phase's end is also printed as it happens
("##phase NAME SECONDS", seconds since this process started: imported, ready, requests, greedy,
mtp, done), so the lane can start later engines once this one has filled the caches, and say
where a killed engine was.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import time
from pathlib import Path

STARTED = time.perf_counter()
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.pop("GLMCTL_PLUGIN_ACTIVE", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.gpu.vllm_lane_schedule import mark_phase  # noqa: E402 - after the path is set


def _phase(name: str) -> None:
    mark_phase(name, STARTED)

SAMPLED = {"temperature": 0.8, "top_p": 0.95, "seed": 7}


class _LogLines(logging.Handler):
    """vLLM's log records of this process (engine core and worker included), for the KV line."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        try:
            self.lines.append(record.getMessage())
        except Exception:  # noqa: BLE001 - a malformed record must not stop the engine
            pass


def _tokens_prompt(ids):
    return {"prompt_token_ids": list(ids)}


def _steps(completion) -> list[dict]:
    out = []
    for token, top in zip(completion.token_ids, completion.logprobs or [], strict=False):
        ranked = sorted(top.items(), key=lambda kv: kv[1].logprob, reverse=True)
        out.append({"token": int(token), "top": [[int(t), float(lp.logprob)] for t, lp in ranked[:2]]})
    return out


def greedy_batch(llm, prompts: dict, names: list[str], tokens: int) -> dict[str, list[dict]]:
    """The listed prompts as one batch, greedy, with vLLM's top-2 logprobs per step."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, logprobs=2, ignore_eos=True)
    outs = llm.generate([_tokens_prompt(prompts[n]) for n in names], params, use_tqdm=False)
    return {n: _steps(o.outputs[0]) for n, o in zip(names, outs, strict=True)}


def prompt_logprobs(llm, prompts: dict, names: list[str]) -> dict[str, list[float]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([_tokens_prompt(prompts[n]) for n in names], params, use_tqdm=False)
    result = {}
    for name, out in zip(names, outs, strict=True):
        ids = prompts[name]
        result[name] = [float(entry[t].logprob) for entry, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
    return result


def resolved_config(llm) -> dict:
    """What vLLM made of the request, read on the worker: compilation and graph modes, the
    attention backends, KV blocks, and which layers run which quantization method."""

    def probe(worker):
        runner = worker.model_runner
        cc = runner.compilation_config
        info = {"compilation_mode": str(getattr(cc, "mode", None)),
                "cudagraph_mode": getattr(getattr(cc, "cudagraph_mode", None), "name", None),
                "cudagraph_capture_sizes": list(getattr(cc, "cudagraph_capture_sizes", None) or []),
                "cache_dtype": str(worker.vllm_config.cache_config.cache_dtype)}
        try:
            info["attention_backends"] = sorted({g.backend.get_name() for groups in runner.attn_groups
                                                 for g in groups})
        except Exception as exc:  # noqa: BLE001 - informative only
            info["attention_backends"] = f"unavailable: {exc}"
        try:
            info["num_blocks"] = int(runner.kv_cache_config.num_blocks)
            info["block_sizes"] = sorted({int(g.kv_cache_spec.block_size)
                                          for g in runner.kv_cache_config.kv_cache_groups})
        except Exception as exc:  # noqa: BLE001
            info["num_blocks"] = f"unavailable: {exc}"
        methods: dict[str, int] = {}
        try:
            for name, module in runner.get_model().named_modules():
                method = getattr(module, "quant_method", None)
                if method is not None:
                    kind = "attention" if ".self_attn." in name else (
                        "experts" if ".experts" in name else "other")
                    key = f"{kind}:{type(method).__name__}"
                    methods[key] = methods.get(key, 0) + 1
        except Exception as exc:  # noqa: BLE001
            methods = {"unavailable": str(exc)}
        info["quant_methods"] = methods
        return info

    try:
        return llm.collective_rpc(probe)[0]
    except Exception as exc:  # noqa: BLE001 - the engine's results still count
        return {"error": f"{type(exc).__name__}: {exc}"}


def run_mtp(llm, prompts: dict, job: dict) -> dict:
    from vllm import SamplingParams

    from tests.vllm.mtp_parity import Oracle, _delta, _spec_counters

    names, tokens = job["prompts"], job["tokens"]
    out: dict = {"natural": {}, "oracle": {}}
    oracle = Oracle()
    oracle.install()
    for name in names:
        out["natural"].update(greedy_batch(llm, prompts, [name], tokens))
    before = _spec_counters(llm)
    out["natural_counters"] = before
    for name in names:
        oracle.start([s["token"] for s in out["natural"][name]])
        out["oracle"].update(greedy_batch(llm, prompts, [name], tokens))
    oracle.reference = None
    out["oracle_counters"] = _delta(_spec_counters(llm), before)
    sampled = []
    before = _spec_counters(llm)
    params = SamplingParams(max_tokens=tokens, logprobs=1, **SAMPLED)
    for _ in range(2):
        completion = llm.generate([_tokens_prompt(prompts[job["sampled"]])], params, use_tqdm=False)[0].outputs[0]
        sampled.append({"tokens": [int(t) for t in completion.token_ids], "finish": completion.finish_reason,
                        "logprobs": [float(lp[t].logprob) for t, lp in zip(completion.token_ids,
                                                                             completion.logprobs, strict=True)]})
    out["sampled"] = sampled
    out["sampled_counters"] = _delta(_spec_counters(llm), before)
    return out


def _shutdown(llm) -> None:
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    destroy_model_parallel()
    destroy_distributed_environment()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass


def run_engine(checkpoint: str, spec: dict, log: _LogLines) -> dict:
    from vllm import LLM

    from glmctl.serving.launch import parse_kv_capacity

    prompts = {n: list(ids) for n, ids in spec.get("prompts", {}).items()}
    seconds: dict[str, float] = {}
    start, first_line = time.perf_counter(), len(log.lines)
    llm = LLM(model=checkpoint, **spec["llm"])
    seconds["init"] = time.perf_counter() - start
    _phase("ready")
    result: dict = {"label": spec["label"], "config": resolved_config(llm)}
    kv = [parse_kv_capacity(line) for line in log.lines[first_line:]]
    kv = [k for k in kv if k is not None]
    result["kv_log"] = kv[0].__dict__ if kv else None
    result["plugin_lines"] = [ln for ln in log.lines[first_line:] if ln.startswith("glmctl")][:8]
    # vLLM's kernel choices ("Selected MarlinFP8ScaledMMLinearKernel for Fp8LinearMethod", ...)
    result["kernel_lines"] = sorted({ln for ln in log.lines[first_line:] if ln.startswith("Selected ")})[:16]

    if spec.get("prompt_logprobs"):
        t = time.perf_counter()
        result["prompt_logprobs"] = prompt_logprobs(llm, prompts, spec["prompt_logprobs"])
        seconds["prompt_logprobs"] = time.perf_counter() - t
        _phase("requests")
    greedy = spec.get("greedy")
    if greedy:
        t = time.perf_counter()
        n = greedy["tokens"]
        runs: dict = {"alone": {}, "batches": {}, "copies4": {}}
        for name in greedy.get("alone", []):
            runs["alone"].update(greedy_batch(llm, prompts, [name], n))
        for names in greedy.get("batches", []):
            runs["batches"]["+".join(names)] = greedy_batch(llm, prompts, list(names), n)
        for name in greedy.get("copies4", []):
            batch = {f"{name}#{i}": prompts[name] for i in range(4)}
            runs["copies4"][name] = greedy_batch(llm, batch, list(batch), n)[f"{name}#0"]
        result["greedy"] = runs
        seconds["greedy"] = time.perf_counter() - t
        _phase("greedy")
    if spec.get("mtp"):
        t = time.perf_counter()
        result["mtp"] = run_mtp(llm, prompts, spec["mtp"])
        seconds["mtp"] = time.perf_counter() - t
        _phase("mtp")
    result["seconds"] = seconds
    _shutdown(llm)
    _phase("done")
    return result


def main(request: dict) -> dict:
    import torch
    import vllm

    _phase("imported")
    log = _LogLines()  # after vLLM's import: its logging config replaces the "vllm" logger's handlers
    logging.getLogger("vllm").addHandler(log)

    device = (f"{torch.cuda.get_device_name(0)} (sm_{''.join(map(str, torch.cuda.get_device_capability(0)))}, "
              f"{torch.cuda.get_device_properties(0).multi_processor_count} SMs)"
              if torch.cuda.is_available() else "CPU")
    report = {"vllm_version": vllm.__version__, "torch_version": torch.__version__, "device": device,
              "device_memory_bytes": torch.cuda.mem_get_info(0)[1] if torch.cuda.is_available() else None,
              "engines": {}}
    for spec in request["engines"]:
        report["engines"][spec["label"]] = run_engine(request["checkpoint"], spec, log)
    return report


if __name__ == "__main__":
    print("@@" + json.dumps(main(json.loads(Path(sys.argv[1]).read_text()))), flush=True)
