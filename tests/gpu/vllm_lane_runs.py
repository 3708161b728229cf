"""What the gpu lane runs on the GPU, in which order: real vLLM engines, transformers references,
the quantisers and the OpenAI server, each in its own process so its GPU memory goes with it.

Every vLLM engine gets a fixed 1 GiB KV space (`kv_cache_memory_bytes`: vLLM skips its memory
profile, which other processes on the GPU would disturb, and the planner predicts the KV tokens
exactly) and checks only that 10 % of the GPU is free at start-up, so up to a dozen run side by
side on one H200. Stages (each waits for the one before):

  A  the eager engine (compiles the Triton kernels every later engine takes from the cache), the
     transformers reference of the BF16 checkpoint, `glmctl quantize exl3` on the GPU, and here
     `glmctl quantize fp8` plus both dequantised twins;
  B  if the eager engine ran: FULL and PIECEWISE CUDA graphs, fp8 and fp8_ds_mla KV, MTP-3, the
     FP8-attention and EXL3 checkpoints (eager and graphed), the server, the twins' references;
  C  transformers' top-2 at every prefix where two runs part off the reference's own greedy path.
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
MTP = {"method": "mtp", "num_speculative_tokens": 3}
MODES = {"eager": {"enforce_eager": True},
         "full": {"compilation_config": {"cudagraph_mode": "FULL"}},
         "piecewise": {"compilation_config": {"cudagraph_mode": "PIECEWISE"}},
         "default": {}}  # vLLM's default for this model: FULL_AND_PIECEWISE (profiles run this)
ENGINE_SETTINGS = {"max_model_len": 4096, "max_num_seqs": 8, "max_num_batched_tokens": 4096}


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


@dataclass
class Job:
    """One subprocess that prints a "@@<json>" report line; its output goes to `log`."""

    label: str
    argv: list[str]
    log: Path
    timeout: float
    env: dict = field(default_factory=lambda: CUDA.env())
    proc: subprocess.Popen | None = None
    started: float = 0.0

    def start(self) -> Job:
        self.started = time.monotonic()
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=REPO,
                                         start_new_session=True)
        return self

    def collect(self) -> dict:
        assert self.proc is not None
        try:
            self.proc.wait(max(1.0, self.started + self.timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(30)
            return {"error": f"{self.label}: killed after {self.timeout:.0f} s; log tail:\n{self._tail()}"}
        text = self.log.read_text(errors="replace")
        lines = [ln for ln in text.splitlines() if ln.startswith("@@")]
        if self.proc.returncode != 0 or not lines:
            return {"error": f"{self.label}: exit {self.proc.returncode}; log tail:\n{self._tail()}"}
        report = json.loads(lines[-1][2:])
        report["wall_s"] = round(time.monotonic() - self.started, 1)
        return report

    def _tail(self, n: int = 4000) -> str:
        text = self.log.read_text(errors="replace")
        errors = [ln for ln in text.splitlines() if "Error" in ln or "error:" in ln]
        return ("\n".join(errors[-6:]) + "\n---\n" if errors else "") + text[-n:]


def run_jobs(jobs: list[Job], parallel: bool = True) -> dict[str, dict]:
    if not parallel:
        return {job.label: job.start().collect() for job in jobs}
    for job in jobs:
        job.start()
    return {job.label: job.collect() for job in jobs}


def _request(work: Path, label: str, body: dict) -> Path:
    path = work / f"{label}.json"
    path.write_text(json.dumps(body))
    return path


def engine_job(target: Target, work: Path, label: str, checkpoint: Path, spec: dict, timeout: float = 240) -> Job:
    request = _request(work, label, {"checkpoint": str(checkpoint), "engines": [{"label": label, **spec}]})
    return Job(label, [sys.executable, str(GPU / "vllm_lane_engine.py"), str(request)], work / f"{label}.log",
               timeout, target.env())


def reference_job(target: Target, work: Path, label: str, checkpoints: list[dict], timeout: float = 200) -> Job:
    request = _request(work, label, {"device": target.device, "checkpoints": checkpoints})
    return Job(label, [sys.executable, str(GPU / "vllm_lane_reference.py"), str(request)], work / f"{label}.log",
               timeout, target.env())


def serve_job(target: Target, work: Path, checkpoint: Path, timeout: float = 300) -> Job:
    from glmctl.serving.server import free_port

    request = _request(work, "serve", {"checkpoint": str(checkpoint), "profile": str(target.serve_profile),
                                       "port": free_port(), "timeout_s": 0.6 * timeout,
                                       "log": str(work / "serve-stderr.log")})
    return Job("serve", [sys.executable, str(GPU / "vllm_lane_serve.py"), str(request)], work / "serve.log", timeout,
               target.env())


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
    greedy = {"tokens": GREEDY_TOKENS, "alone": [n for n in names if n != STDLIB], "batches": [list(ISSUE_PAIR)]}
    base = {"prompts": prompts, "prompt_logprobs": names, "greedy": greedy}
    return {
        "eager": ("bf16", {**base, "llm": args("eager")}),
        "graphs_full": ("bf16", {**base, "llm": args("full"),
                                 "greedy": {**greedy, "copies4": fixture_names}}),
        "graphs_piecewise": ("bf16", {**base, "llm": args("piecewise")}),
        "kv_fp8": ("bf16", {**base, "llm": args("default", "fp8")}),
        "kv_fp8_ds_mla": ("bf16", {**base, "llm": args("default", "fp8_ds_mla")}),
        # the same graph mode as graphs_full, whose four-copy batches are its shape-matched plain runs
        "mtp3": ("bf16", {"prompts": prompts, "llm": args("full", speculative_config=MTP),
                          "mtp": {"tokens": GREEDY_TOKENS, "prompts": fixture_names, "sampled": "medium"}}),
        "fp8_attention": ("fp8", {**base, "llm": args("default")}),
        "exl3_eager": ("exl3", {**base, "llm": args("eager")}),
        "exl3_graphs": ("exl3", {**base, "llm": args("default")}),
    }


def run_lane(checkpoint: Path, work: Path, target: Target = CUDA, budget_s: float = 260,
             on_stage=print) -> LaneRun:
    """Run stages A, B, C (above); every process is stopped by `budget_s` after the start, so a
    hang costs its case and leaves the others their verdicts."""
    from tests.gpu import vllm_lane_checkpoints as ckpts
    from tests.gpu import vllm_lane_divergence as divergence

    slower = 1 if target.device == "cuda" else 8  # vLLM CPU on two cores
    deadline = time.monotonic() + budget_s * slower

    def limit(seconds: float) -> float:
        return max(5.0, min(seconds * slower, deadline - time.monotonic()))

    work.mkdir(parents=True, exist_ok=True)
    prompts, fixture, note = lane_prompts(checkpoint)
    run = LaneRun({"bf16": checkpoint}, prompts, fixture, note)
    specs = {k: v for k, v in engine_specs(prompts, target).items() if target.labels is None or k in target.labels}
    wanted = {ck for ck, _ in specs.values()}

    t = time.monotonic()
    stage_a = [engine_job(target, work, "eager", checkpoint, specs["eager"][1], limit(150)),
               reference_job(target, work, "ref_bf16", [{"label": "bf16", "path": str(checkpoint),
                                                         "dtypes": ["float32", "bfloat16"], "prompts": prompts,
                                                         "greedy": {"tokens": REFERENCE_GREEDY_TOKENS,
                                                                    "prompts": [n for n in prompts if n != STDLIB]}}],
                             limit(150))]
    if target.parallel:
        for job in stage_a:
            job.start()
    exl3_dir, exl3 = work / "tiny-exl3", None
    if "exl3" in wanted:
        exl3 = subprocess.Popen(ckpts.exl3_command(checkpoint, exl3_dir), stdout=subprocess.PIPE,
                                stderr=(work / "quantize-exl3.log").open("w"), text=True, cwd=REPO, env=target.env())
    if "fp8" in wanted:
        try:
            run.checkpoints["fp8"] = ckpts.fp8_attention_checkpoint(checkpoint, work / "tiny-fp8")
            run.checkpoints["fp8_deq"] = ckpts.fp8_dequantised_twin(run.checkpoints["fp8"], work / "tiny-fp8-deq")
            run.quantize["fp8"] = {"ok": True}
        except Exception as exc:  # noqa: BLE001 - the cases say what could not run
            run.quantize["fp8"] = {"error": f"glmctl quantize fp8 / dequantised twin: {type(exc).__name__}: {exc}"}
    if exl3 is not None:
        try:
            out, _ = exl3.communicate(timeout=limit(150))
            if exl3.returncode != 0:
                raise RuntimeError(f"exit {exl3.returncode}: {(work / 'quantize-exl3.log').read_text()[-2000:]}")
            run.quantize["exl3"] = {"ok": True, "result": json.loads(out)}
            run.checkpoints["exl3"] = exl3_dir
            run.checkpoints["exl3_deq"] = ckpts.exl3_dequantised_twin(checkpoint, exl3_dir, work / "tiny-exl3-deq")
        except Exception as exc:  # noqa: BLE001
            exl3.kill()
            run.quantize["exl3"] = {"error": f"glmctl quantize exl3 on the GPU / dequantised twin: "
                                             f"{type(exc).__name__}: {str(exc)[-1500:]}"}
    results = ({job.label: job.collect() for job in stage_a} if target.parallel
               else run_jobs(stage_a, parallel=False))
    run.engines["eager"] = results["eager"]
    run.references["bf16"] = results["ref_bf16"]
    run.stages_s["A"] = round(time.monotonic() - t, 1)
    on_stage(f"stage A {run.stages_s['A']} s: eager {'ok' if 'error' not in run.engines['eager'] else 'FAILED'}, "
             f"reference {'ok' if 'error' not in run.references['bf16'] else 'FAILED'}, quantize "
             + ", ".join(f"{k} {'ok' if 'error' not in v else 'FAILED'}" for k, v in run.quantize.items()))
    if "error" in run.engines["eager"]:
        why = "not run: the eager engine failed first (the same failure would repeat); see the eager case"
        run.engines.update({label: {"error": why} for label in specs if label != "eager"})
        run.serve = {"error": why}
        return run

    t = time.monotonic()
    stage_b = []
    for label, (ckpt, spec) in specs.items():
        if label == "eager":
            continue
        if ckpt not in run.checkpoints:
            run.engines[label] = {"error": f"not run: no {ckpt} checkpoint ({run.quantize.get(ckpt, {}).get('error')})"}
            continue
        stage_b.append(engine_job(target, work, label, run.checkpoints[ckpt], spec, limit(150)))
    twins = [{"label": twin, "path": str(run.checkpoints[twin]), "dtypes": ["float32"], "prompts": prompts}
             for twin in ("fp8_deq", "exl3_deq") if twin in run.checkpoints]
    if twins:
        stage_b.append(reference_job(target, work, "ref_twins", twins, limit(120)))
    if target.labels is None or "serve" in target.labels:
        stage_b.append(serve_job(target, work, checkpoint, limit(180)))
    results = run_jobs(stage_b, target.parallel)
    for label, report in results.items():
        if label == "serve":
            run.serve = report
        elif label == "ref_twins":
            for twin in twins:
                run.references[twin["label"]] = (report if "error" in report
                                                 else report["checkpoints"][twin["label"]])
        else:
            run.engines[label] = report
    run.stages_s["B"] = round(time.monotonic() - t, 1)
    on_stage(f"stage B {run.stages_s['B']} s: " + ", ".join(
        f"{k} {'ok' if 'error' not in v else 'FAILED'}" for k, v in results.items()))

    probes = divergence.probe_requests(run)
    if probes:
        t = time.monotonic()
        job = reference_job(target, work, "ref_probes", [{"label": ck, "path": str(run.checkpoints[ck]),
                                                          "dtypes": ["float32"], "prompts": {}, "probes": keys}
                                                         for ck, keys in probes.items()], limit(60))
        report = run_jobs([job])["ref_probes"]
        for ck in probes:
            run.probes[ck] = report if "error" in report else report["checkpoints"][ck]["probes"]
        run.stages_s["C"] = round(time.monotonic() - t, 1)
        on_stage(f"stage C {run.stages_s['C']} s: {sum(map(len, probes.values()))} reference probes")
    return run
