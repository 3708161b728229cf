"""What the gpu lane runs on the GPU, in which order: real vLLM engines, transformers references,
the quantisers and the OpenAI server, each in its own process so its GPU memory goes with it.

Every vLLM engine gets a fixed 1 GiB KV space (`kv_cache_memory_bytes`: vLLM skips its memory
profile, which other processes on the GPU would disturb, and the planner predicts the KV tokens
exactly) and checks only that 10 % of the GPU is free at start-up, so a dozen run side by side on
one H200. Stages, timed by tests/gpu/vllm_lane_schedule.py (its limits come from the first H200 run):

  A  the warm-up: the eager engine alone among the engines (it fills the Triton, vLLM and Inductor
     caches every later process reads), beside the transformers reference of the BF16 checkpoint,
     `glmctl quantize fp8` and `glmctl quantize exl3` (on the GPU), their dequantised twins and the
     twins' reference. Ends when the eager engine's first requests are done (or it exits, or its
     limit passes); "warm.done" in the work folder then tells bench/gpu/vllm_lane.sh to start the
     DFlash2 cases.
  B  every other engine and the server, whatever happened to the eager engine: FULL and PIECEWISE
     CUDA graphs, fp8 and fp8_ds_mla KV, MTP-3, the FP8-attention and EXL3 checkpoints (eager and
     graphed), `glmctl serve`; the eager engine and the references finish meanwhile.
  C  transformers' top-2 at every prefix where two runs part off the reference's own greedy path.

A case whose inputs are missing says which and why; no failure stops a run that does not need it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import REPO
from tests.gpu import vllm_lane_schedule as sched
from tests.gpu.vllm_lane_schedule import Job
from tests.vllm import lane_fixture

GPU = REPO / "tests" / "gpu"
KV_BYTES = 1 << 30
GREEDY_TOKENS = 48  # three kpool boundaries (16 tokens) per request
REFERENCE_GREEDY_TOKENS = 24
ISSUE_PAIR = ("issue-fibonacci", "issue-config")  # the eager-vs-graphs question, tokenised here, batched
EXTRA_PROMPTS = {"sparse-text": "The quick brown fox jumps over the lazy dog. " * 30,
                 "issue-fibonacci": lane_fixture.PROMPTS["fibonacci"],
                 "issue-config": lane_fixture.PROMPTS["config"]}
STDLIB = "stdlib-384"  # the FP8-attention test's text (tests/vllm/test_plugin_fp8_attention.py)
MTP = {"method": "mtp", "num_speculative_tokens": 3, "use_local_argmax_reduction": True}  # as glmctl serves it
MODES = {"eager": {"enforce_eager": True},
         "full": {"compilation_config": {"cudagraph_mode": "FULL"}},
         "piecewise": {"compilation_config": {"cudagraph_mode": "PIECEWISE"}},
         "default": {}}  # vLLM's default for this model: FULL_AND_PIECEWISE (profiles run this)
ENGINE_SETTINGS = {"max_model_len": 4096, "max_num_seqs": 8, "max_num_batched_tokens": 4096}
# The block-FP8 linear kernel an sm_89 node gets (Marlin FP8, W8A16): vLLM 0.30 picks the first of
# its block-FP8 kernels that runs, and these four run only on sm_90+ (as bench/gpu/rank_sim.sh
# forces it). Without this the H200 takes CUTLASS block-scaled W8A8, which an L40 never runs.
SM89_FP8_LINEAR_ENV = {"VLLM_DISABLED_KERNELS": "FlashInferFp8DeepGEMMDynamicBlockScaledKernel,"
                       "DeepGemmFp8BlockScaledMMKernel,CutlassFp8BlockScaledMMKernel,"
                       "B12xFp8BlockScaledMMKernel"}


def gpu_engine_args(mode: str, kv_cache_dtype: str = "auto", **extra) -> dict:
    return {"dtype": "bfloat16", "seed": 0, "max_logprobs": -1, "enable_prefix_caching": False,
            "gpu_memory_utilization": 0.1, "kv_cache_memory_bytes": KV_BYTES, "disable_log_stats": False,
            "kv_cache_dtype": kv_cache_dtype, **ENGINE_SETTINGS, **MODES[mode], **extra}


def cpu_engine_args(mode: str, kv_cache_dtype: str = "auto", **extra) -> dict:
    """The same engines on vLLM CPU (eager only), for checking the lane's code without a GPU."""
    return {"dtype": "bfloat16", "seed": 0, "max_logprobs": -1, "disable_log_stats": False,
            "kv_cache_dtype": kv_cache_dtype, "enforce_eager": True, "max_model_len": 4096, **extra}


@dataclass(frozen=True)
class Target:
    """Where the lane runs: CUDA (the lane) or vLLM CPU (a local check of the lane's code)."""

    device: str = "cuda"
    serve_profile: Path = GPU / "tiny-gpu.yaml"
    parallel: bool = True  # vLLM CPU: one engine at a time
    labels: tuple[str, ...] | None = None  # engines to run (None: all)

    def engine_args(self, mode: str, kv_cache_dtype: str = "auto", **extra) -> dict:
        make = gpu_engine_args if self.device == "cuda" else cpu_engine_args
        return make(mode, kv_cache_dtype, **extra)

    def env(self) -> dict:
        env = {**os.environ, "VLLM_USE_FLASHINFER_SAMPLER": "0", "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1",
               "GLMCTL_PLUGIN": "on" if self.device == "cuda" else "auto"}
        if self.device == "cpu":
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            env.pop("OMP_NUM_THREADS")
        env.pop("GLMCTL_PLUGIN_ACTIVE", None)
        return env


CUDA = Target()


def _request(work: Path, label: str, body: dict) -> Path:
    path = work / f"{label}.json"
    path.write_text(json.dumps(body))
    return path


def engine_job(env: dict, work: Path, label: str, checkpoint: Path, spec: dict, timeout: float) -> Job:
    """One engine process; `spec["env"]` (optional) adds to the lane's environment for it alone."""
    extra = spec.get("env", {})
    spec = {k: v for k, v in spec.items() if k != "env"}
    request = _request(work, label, {"checkpoint": str(checkpoint), "engines": [{"label": label, **spec}]})
    return Job(label, [sys.executable, str(GPU / "vllm_lane_engine.py"), str(request)], work / f"{label}.log",
               timeout, {**env, **extra}, cwd=REPO)


def reference_job(env: dict, device: str, work: Path, label: str, checkpoints: list[dict], timeout: float) -> Job:
    request = _request(work, label, {"device": device, "checkpoints": checkpoints})
    return Job(label, [sys.executable, str(GPU / "vllm_lane_reference.py"), str(request)], work / f"{label}.log",
               timeout, env, cwd=REPO)


def serve_job(env: dict, target: Target, work: Path, checkpoint: Path, timeout: float) -> Job:
    from glmctl.serving.server import free_port

    request = _request(work, "serve", {"checkpoint": str(checkpoint), "profile": str(target.serve_profile),
                                       "port": free_port(), "timeout_s": 0.6 * timeout,
                                       "log": str(work / "serve-stderr.log")})
    return Job("serve", [sys.executable, str(GPU / "vllm_lane_serve.py"), str(request)], work / "serve.log", timeout,
               env, cwd=REPO)


def lane_env(target: Target, work: Path) -> dict:
    """The target's environment plus one shared cache root ($GLMCTL_GPU_LANE_CACHE, else under the
    work folder) and the folder where every process group the lane starts is recorded."""
    cache = Path(os.environ.get("GLMCTL_GPU_LANE_CACHE") or work / "cache")
    return {**target.env(), **sched.cache_env(cache), sched.PGID_DIR_ENV: str(work / "pgids")}


@dataclass
class LaneRun:
    """Everything the lane's cases judge (tests/gpu/vllm_lane_cases.py)."""

    checkpoints: dict[str, Path]
    prompts: dict[str, list[int]]
    fixture: dict | None
    fixture_note: str
    engines: dict[str, dict] = field(default_factory=dict)
    references: dict[str, dict] = field(default_factory=dict)  # label -> transformers run (or {"error"})
    probes: dict[str, dict] = field(default_factory=dict)  # checkpoint label -> {probe key: top-2}
    serve: dict = field(default_factory=dict)
    quantize: dict[str, dict] = field(default_factory=dict)
    stages_s: dict[str, float] = field(default_factory=dict)
    schedule: dict = field(default_factory=dict)  # limits given, how stage A ended, cache contents


def lane_prompts(checkpoint: Path) -> tuple[dict, dict | None, str]:
    """The fixture's token ids where its weights are these weights, plus the lane's own prompts
    tokenised here (the English one and the eager-vs-graphs pair as the issue ran them)."""
    local = lane_fixture.tokenize(checkpoint)
    extra = {**lane_fixture.tokenize(checkpoint, EXTRA_PROMPTS), STDLIB: stdlib_tokens(checkpoint)}
    if not lane_fixture.FIXTURE.exists():
        return {**local, **extra}, None, f"no fixture at {lane_fixture.FIXTURE.relative_to(REPO)}"
    fixture = lane_fixture.load()
    digest = lane_fixture.weights_sha256(checkpoint)
    if digest != fixture["checkpoint"]["weights_sha256"]:
        return {**local, **extra}, None, (f"the GPU machine's tiny checkpoint has other weights ({digest[:12]} vs "
                                          f"the fixture's {fixture['checkpoint']['weights_sha256'][:12]})")
    same = sum(local[n] == ids for n, ids in lane_fixture.prompt_ids(fixture).items())
    note = f"fixture weights match; {same}/{len(local)} prompts tokenise here as in the fixture"
    return {**lane_fixture.prompt_ids(fixture), **extra}, fixture, note


def stdlib_tokens(checkpoint: Path, n: int = 384) -> list[int]:
    """The first `n` tokens of glmctl's fixed stdlib text, as the CPU lane's FP8-attention test
    scores it: the text the quantised checkpoints' bounds were measured on."""
    from glmctl.evals.corpus import stdlib_text
    from glmctl.evals.tokenizer import HFTokenizer

    return HFTokenizer(Path(checkpoint)).encode(stdlib_text().text[:20_000])[:n]


def engine_specs(prompts: dict, target: Target = CUDA) -> dict[str, tuple[str, dict]]:
    """label -> (checkpoint label, engine request) for every engine of stages A and B."""
    args = target.engine_args
    names = list(prompts)
    fixture_names = [n for n in names if n in lane_fixture.PROMPTS]
    alone = [n for n in names if n != STDLIB]
    greedy = {"tokens": GREEDY_TOKENS, "alone": alone, "batches": [list(ISSUE_PAIR)]}
    # every prompt alone and all of them in one batch (8 requests): the batch-invariance question
    batched = {**greedy, "batches": [list(ISSUE_PAIR), alone]}
    base = {"prompts": prompts, "prompt_logprobs": names, "greedy": greedy}
    return {
        "eager": ("bf16", {**base, "llm": args("eager"), "greedy": batched}),
        "graphs_full": ("bf16", {**base, "llm": args("full"),
                                 "greedy": {**batched, "copies4": fixture_names}}),
        "graphs_piecewise": ("bf16", {**base, "llm": args("piecewise")}),
        "kv_fp8": ("bf16", {**base, "llm": args("default", "fp8")}),
        "kv_fp8_ds_mla": ("bf16", {**base, "llm": args("default", "fp8_ds_mla")}),
        # the same graph mode as graphs_full, whose four-copy batches are its shape-matched plain runs
        "mtp3": ("bf16", {"prompts": prompts, "llm": args("full", speculative_config=MTP),
                          "mtp": {"tokens": GREEDY_TOKENS, "prompts": fixture_names, "sampled": "medium"}}),
        # the kernel an L40 runs (Marlin W8A16), judged; vLLM's own sm_90 choice (W8A8) reported beside
        "fp8_attention": ("fp8", {**base, "llm": args("default"),
                                  **({"env": SM89_FP8_LINEAR_ENV} if target.device == "cuda" else {})}),
        "fp8_attention_w8a8": ("fp8", {"prompts": {n: prompts[n] for n in names if n == STDLIB},
                                       "prompt_logprobs": [n for n in names if n == STDLIB], "llm": args("default")}),
        "exl3_eager": ("exl3", {**base, "llm": args("eager")}),
        "exl3_graphs": ("exl3", {**base, "llm": args("default")}),
    }




def _ok(report: dict) -> str:
    return "ok" if "error" not in report else "FAILED"


def run_lane(checkpoint: Path, work: Path, target: Target = CUDA, budget_s: float | None = None,
             on_stage=print) -> LaneRun:
    """Run stages A, B, C (above) by a deadline: `budget_s` from now, else $GLMCTL_GPU_LANE_DEADLINE
    (epoch seconds, what bench/gpu/vllm_lane.sh sets), else 480 s from now. Each process runs
    under its own limit (vllm_lane_schedule) cut to that deadline, so a hang costs its own case
    and leaves the others their verdicts."""
    from tests.gpu import vllm_lane_checkpoints as ckpts
    from tests.gpu import vllm_lane_divergence as divergence

    if budget_s is None:
        at = os.environ.get("GLMCTL_GPU_LANE_DEADLINE")
        budget_s = float(at) - time.time() if at else 480.0
    slower = 1 if target.device == "cuda" else 8  # vLLM CPU on two cores
    began = time.monotonic()
    deadline = began + budget_s * slower

    def limit(seconds: float, reserve: float = 0.0) -> float:
        return max(5.0, min(seconds * slower, deadline - reserve * slower - time.monotonic()))

    work.mkdir(parents=True, exist_ok=True)
    (work / "warm.done").unlink(missing_ok=True)
    env = lane_env(target, work)
    prompts, fixture, note = lane_prompts(checkpoint)
    run = LaneRun({"bf16": checkpoint}, prompts, fixture, note)
    specs = {k: v for k, v in engine_specs(prompts, target).items() if target.labels is None or k in target.labels}
    wanted = {ck for ck, _ in specs.values()}
    started: list[Job] = []
    results: dict[str, dict] = {}

    def launch(job: Job) -> Job:  # vLLM CPU: one process at a time, each to its end
        started.append(job.start())
        if not target.parallel:
            results[job.label] = job.collect()
        return job

    try:
        eager = launch(engine_job(env, work, "eager", checkpoint, specs["eager"][1], limit(sched.COLD_ENGINE_S)))
        launch(reference_job(env, target.device, work, "ref_bf16", [
            {"label": "bf16", "path": str(checkpoint), "dtypes": ["float32", "bfloat16"], "prompts": prompts,
             "greedy": {"tokens": REFERENCE_GREEDY_TOKENS, "prompts": [n for n in prompts if n != STDLIB]}}],
            limit(sched.REFERENCE_S)))
        _quantize(run, checkpoint, work, env, wanted, limit(sched.REFERENCE_S), ckpts)
        for twin, source in (("fp8_deq", "fp8"), ("exl3_deq", "exl3")):
            if twin not in run.checkpoints and source in wanted:
                why = run.quantize.get(source, {}).get("error", "no checkpoint")
                run.references[twin] = {"error": f"not run: no {twin} checkpoint ({why})"}
        twins = [{"label": twin, "path": str(run.checkpoints[twin]), "dtypes": ["float32"], "prompts": prompts}
                 for twin in ("fp8_deq", "exl3_deq") if twin in run.checkpoints]
        if twins:
            launch(reference_job(env, target.device, work, "ref_twins", twins, limit(sched.REFERENCE_S)))
        gate = "sequential" if not target.parallel else eager.wait_phase(sched.GATE_PHASE,
                                                                          eager.started + eager.timeout)
        run.stages_s["A"] = round(time.monotonic() - began, 1)
        run.schedule.update(stage_a_ended_by=gate, triton_kernels_cached=sched.triton_cached_kernels(env),
                            limits_s={j.label: round(j.timeout) for j in started})
        (work / "warm.done").write_text(json.dumps({"ended_by": gate, "after_s": run.stages_s["A"]}))
        on_stage(f"stage A {run.stages_s['A']} s (ended by the eager engine's {gate}): quantize "
                 + ", ".join(f"{k} {_ok(v)}" for k, v in run.quantize.items())
                 + f"; {run.schedule['triton_kernels_cached']} Triton kernels cached")

        t = time.monotonic()
        stage_b = []
        for label, (ckpt, spec) in sorted(specs.items(), key=lambda kv: -sched.engine_limit(kv[0])):
            if label == "eager":
                continue
            if ckpt not in run.checkpoints:
                results[label] = {"error": f"not run: no {ckpt} checkpoint ({run.quantize.get(ckpt, {}).get('error')})"}
                continue
            stage_b.append(engine_job(env, work, label, run.checkpoints[ckpt], spec,
                                      limit(sched.engine_limit(label), sched.PROBES_S)))
        if target.labels is None or "serve" in target.labels:
            stage_b.insert(0, serve_job(env, target, work, checkpoint, limit(sched.SERVE_S, sched.PROBES_S)))
        if target.parallel:
            results.update(sched.run_pool(stage_b, sched.max_parallel(), deadline - sched.PROBES_S * slower,
                                          also=list(started)))
            started += [j for j in stage_b if j.proc is not None]
        else:
            for job in stage_b:
                job.timeout = min(job.timeout, limit(job.timeout / slower, sched.PROBES_S))
                launch(job)
        run.schedule["limits_s"].update({j.label: round(j.timeout) for j in stage_b if j.proc is not None})
        run.stages_s["B"] = round(time.monotonic() - t, 1)
        _file(run, results, twins)
        on_stage(f"stage B {run.stages_s['B']} s: " + ", ".join(f"{k} {_ok(v)}" for k, v in results.items()))

        probes = divergence.probe_requests(run)
        if probes:
            t = time.monotonic()
            job = launch(reference_job(env, target.device, work, "ref_probes", [
                {"label": ck, "path": str(run.checkpoints[ck]), "dtypes": ["float32"], "prompts": {}, "probes": keys}
                for ck, keys in probes.items()], limit(sched.PROBES_S)))
            report = results.get("ref_probes") or job.collect()
            for ck in probes:
                run.probes[ck] = report if "error" in report else report["checkpoints"][ck]["probes"]
            run.stages_s["C"] = round(time.monotonic() - t, 1)
            on_stage(f"stage C {run.stages_s['C']} s: {sum(map(len, probes.values()))} reference probes")
    finally:
        for job in started:
            job.stop()
        run.stages_s["total"] = round(time.monotonic() - began, 1)
    return run


def _quantize(run: LaneRun, checkpoint: Path, work: Path, env: dict, wanted: set, timeout: float, ckpts) -> None:
    """`glmctl quantize exl3` on the GPU (a subprocess, as a user runs it) while `glmctl quantize
    fp8` runs here on the CPU; then both dequantised twins."""
    exl3_dir, exl3 = work / "tiny-exl3", None
    if "exl3" in wanted:
        exl3 = subprocess.Popen(ckpts.exl3_command(checkpoint, exl3_dir), stdout=subprocess.PIPE,
                                stderr=(work / "quantize-exl3.log").open("w"), text=True, cwd=REPO, env=env,
                                start_new_session=True)
        sched.record_group(env, exl3.pid)
    if "fp8" in wanted:
        try:
            run.checkpoints["fp8"] = ckpts.fp8_attention_checkpoint(checkpoint, work / "tiny-fp8")
            run.checkpoints["fp8_deq"] = ckpts.fp8_dequantised_twin(run.checkpoints["fp8"], work / "tiny-fp8-deq")
            run.quantize["fp8"] = {"ok": True}
        except Exception as exc:  # noqa: BLE001 - the cases say what could not run
            run.quantize["fp8"] = {"error": f"glmctl quantize fp8 / dequantised twin: {type(exc).__name__}: {exc}"}
    if exl3 is None:
        return
    try:
        out, _ = exl3.communicate(timeout=timeout)
        if exl3.returncode != 0:
            raise RuntimeError(f"exit {exl3.returncode}: {(work / 'quantize-exl3.log').read_text()[-2000:]}")
        run.quantize["exl3"] = {"ok": True, "result": json.loads(out)}
        run.checkpoints["exl3"] = exl3_dir
        run.checkpoints["exl3_deq"] = ckpts.exl3_dequantised_twin(checkpoint, exl3_dir, work / "tiny-exl3-deq")
    except Exception as exc:  # noqa: BLE001
        sched.kill_group(exl3.pid)
        run.quantize["exl3"] = {"error": f"glmctl quantize exl3 on the GPU / dequantised twin: "
                                         f"{type(exc).__name__}: {str(exc)[-1500:]}"}


def _file(run: LaneRun, results: dict[str, dict], twins: list[dict]) -> None:
    """Put each process's report where the cases read it."""
    for label, report in results.items():
        if label == "serve":
            run.serve = report
        elif label == "ref_bf16":
            run.references["bf16"] = report
        elif label == "ref_twins":
            for twin in twins:
                run.references[twin["label"]] = (report if "error" in report
                                                 else report["checkpoints"][twin["label"]])
        elif label != "ref_probes":
            run.engines[label] = report
