"""Subprocess body of the DFlash2 tests (vLLM CPU lane and gpu lane): the tiny GLM-5.3-Flash with and
without the tiny DFlash2 drafter (5 draft tokens), offline, vLLM engines one after the other here.

    python tests/vllm/dflash2_parity.py REQUEST.json   -> one JSON line on stdout, prefixed "@@"

Device-agnostic: the caller passes the `vllm.LLM` keyword arguments (vLLM CPU: enforce_eager;
CUDA: graphs, a fixed KV space). REQUEST:

    {"checkpoint": DIR, "drafter": DIR, "prompts": {name: text}, "tokens": N, "llm": {...},
     "engines": [{"label": L, "dflash2": bool, "placement": null | "alias" | "append",
                  "llm": {...more kwargs...}, "runs": [...]}]}

Runs, in the order given: "single" (each prompt alone), "batch6" (six identical requests in one
batch, the first copy: six rows per decode step, the row count of a DFlash2-5 verify step),
"natural" (each prompt alone with the drafter's own drafts, every proposal recorded), "batched"
(all prompts in one batch, proposals recorded), "oracle" (drafts steered along the first "batch6"
run's output, one corrupted on a schedule so that verify steps accept 5, 4, 3, 2, 1, 0 drafts in
turn), "sampled" (one seeded request at temperature 0.8). Every engine reports the KV capacity
vLLM logged, where the plugin put the drafter's KV, vLLM's spec-decode counters (per engine, and
for the oracle run alone), the block size and attention backends, and seconds per run. Greedy
steps: token id and the top-2 logprobs.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("GLMCTL_PLUGIN", "auto")
os.environ.pop("GLMCTL_PLUGIN_ACTIVE", None)
os.environ.pop("GLMCTL_DFLASH2_KV", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.vllm.mtp_parity import Oracle, _delta, _greedy, _shutdown, _spec_counters, emitted  # noqa: E402

DRAFTS = 5
# Which draft (0-based) the oracle corrupts at its n-th verify step, cyclically: None keeps all
# five (5 accepted), 4 -> 4 accepted, ... 0 -> 0.
CORRUPT = (None, 4, 3, 2, 1, 0)
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "seed": 7}
_KV_LINE = re.compile(r"KV cache size: ([\d,]+) tokens")


class KvLog(logging.Handler):
    """vLLM's "KV cache size: N tokens" lines and glmctl's placement line, in order."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.tokens: list[int] = []
        self.placements: list[str] = []

    def emit(self, record):
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record must not stop the engine
            return
        if (m := _KV_LINE.search(message)) is not None:
            self.tokens.append(int(m.group(1).replace(",", "")))
        if "DFlash2 drafter KV" in message:
            self.placements.append(message.split("DFlash2 drafter KV ", 1)[1].split(" ", 1)[0])


class Drafts(Oracle):
    """Counts the plugin's selector walks, records proposals, and when steering replaces them with
    the known greedy continuation (one draft corrupted per CORRUPT). Both runners' drafters."""

    def __init__(self):
        super().__init__(CORRUPT)
        self.recorded: list | None = None
        self.selector_walks = 0

    def steer(self, reference: list[int] | None) -> None:
        self.start(reference)

    def steered(self, out, num_rejected):
        """`out` [requests, drafts] with request 0's drafts replaced (oracle runs are one request)."""
        if self.recorded is not None:
            self.recorded.append(out.tolist())
        if self.reference is None:
            return out
        return self.replace(out, None if self.position is None else emitted(out, num_rejected))

    def install(self) -> None:
        from glmctl.plugin.spec_decode import dflash2

        stock_walk = dflash2.selector_walk
        drafts = self

        def walk(*args, **kwargs):
            drafts.selector_walks += 1
            return stock_walk(*args, **kwargs)

        dflash2.selector_walk = walk
        self._install_v1()
        self._install_v2()

    def _install_v1(self) -> None:
        from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

        stock, drafts = SpecDecodeBaseProposer.propose, self

        def propose(proposer, *args, **kwargs):
            return drafts.steered(stock(proposer, *args, **kwargs), kwargs.get("num_rejected_tokens_gpu"))

        SpecDecodeBaseProposer.propose = propose

    def _install_v2(self) -> None:
        try:
            from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator
        except Exception:  # noqa: BLE001 - vLLM CPU without Triton: the V2 runner is not used there
            return
        stock, drafts = DFlashSpeculator.propose, self

        def propose(speculator, input_batch, attn_metadata, slot_mappings, last_hidden_states,
                    aux_hidden_states, num_sampled, num_rejected, *args, **kwargs):
            out = stock(speculator, input_batch, attn_metadata, slot_mappings, last_hidden_states,
                        aux_hidden_states, num_sampled, num_rejected, *args, **kwargs)
            if kwargs.get("dummy_run") or kwargs.get("is_profile"):
                return out
            # the V2 runner's first proposal follows the prefill: num_sampled 1, num_rejected 0
            first = drafts.position is None
            return drafts.steered(out, None if first else num_rejected)

        DFlashSpeculator.propose = propose


def _batched(llm, prompts: dict, tokens: int) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    outs = llm.generate(list(prompts.values()), params, use_tqdm=False)
    return {name: list(o.outputs[0].token_ids) for name, o in zip(prompts, outs, strict=True)}


def _engine_facts(llm) -> dict:
    """What the engine built: KV capacity (vLLM's figure), the drafter's placement, blocks, backends."""
    facts: dict = {}
    try:
        engine = llm.llm_engine.engine_core.engine_core
        facts["kv_tokens"] = engine.vllm_config.cache_config.kv_cache_size_tokens
    except Exception as exc:  # noqa: BLE001 - the log line stands in
        facts["kv_tokens_error"] = repr(exc)
    try:
        runner = engine.model_executor.driver_worker.worker.model_runner
        from glmctl.plugin.spec_decode.dflash2_kv import split_draft

        split = split_draft(runner.kv_cache_config.kv_cache_groups)
        facts["placement"] = split[2] if split is not None else None
        facts["block_sizes"] = sorted({int(g.kv_cache_spec.block_size)
                                       for g in runner.kv_cache_config.kv_cache_groups})
        facts["num_blocks"] = int(runner.kv_cache_config.num_blocks)
        facts["runner"] = type(runner).__module__ + "." + type(runner).__name__
        groups = getattr(runner, "attn_groups", None) or []
        facts["attention_backends"] = sorted({g.backend.get_name() for gs in groups for g in gs})
    except Exception as exc:  # noqa: BLE001 - informative only
        facts["error"] = repr(exc)
    return facts


def run_engine(spec: dict, request: dict, drafts: Drafts, log: KvLog, reference: dict) -> dict:
    from vllm import LLM, SamplingParams

    kwargs = {**request.get("llm", {}), **spec.get("llm", {})}
    if spec.get("dflash2"):
        kwargs["speculative_config"] = {"method": "dflash", "model": request["drafter"],
                                        "num_speculative_tokens": DRAFTS}
    if spec.get("placement"):
        os.environ["GLMCTL_DFLASH2_KV"] = spec["placement"]
    else:
        os.environ.pop("GLMCTL_DFLASH2_KV", None)
    prompts, tokens = request["prompts"], request["tokens"]
    started = time.monotonic()
    logged = len(log.tokens), len(log.placements)
    llm = LLM(model=request["checkpoint"], **kwargs)
    facts = _engine_facts(llm)
    # vLLM logs its capacity once per distinct message: the config's figure, else a new log line
    kv_tokens = facts.get("kv_tokens") or (log.tokens[-1] if len(log.tokens) > logged[0] else None)
    placement = facts.get("placement") or (log.placements[-1] if len(log.placements) > logged[1] else None)
    part: dict = {"kv_tokens": kv_tokens, "placement": placement if spec.get("dflash2") else None,
                  "facts": facts, "seconds": {"start": round(time.monotonic() - started, 1)}, "proposals": {}}
    tokenizer = llm.get_tokenizer()
    part["ids"] = {name: list(tokenizer.encode(text)) for name, text in prompts.items()}  # as vLLM tokenises
    walks0 = drafts.selector_walks
    for run in spec.get("runs", []):
        t0 = time.monotonic()
        if run == "single":
            part["single"] = _greedy(llm, prompts, tokens)
        elif run == "batch6":
            part["batch6"] = _greedy(llm, prompts, tokens, copies=6)
            reference.setdefault("batch6", part["batch6"])
        elif run == "natural":
            part["natural"] = {}
            for name, prompt in prompts.items():
                drafts.recorded = []
                part["natural"].update(_greedy(llm, {name: prompt}, tokens))
                part["proposals"][name] = drafts.recorded
            drafts.recorded = None
        elif run == "batched":
            drafts.recorded = []
            part["batched"] = _batched(llm, prompts, tokens)
            part["proposals"]["batched"], drafts.recorded = drafts.recorded, None
        elif run == "oracle":
            before = _spec_counters(llm)
            part["oracle"] = {}
            for name, prompt in prompts.items():
                drafts.steer([step["token"] for step in reference["batch6"][name]])
                part["oracle"].update(_greedy(llm, {name: prompt}, tokens))
            drafts.steer(None)
            part["oracle_counters"] = _delta(_spec_counters(llm), before)
        elif run == "sampled":
            out = llm.generate([prompts[next(iter(prompts))]], SamplingParams(max_tokens=tokens, **SAMPLED),
                               use_tqdm=False)[0].outputs[0]
            part["sampled"] = {"tokens": len(out.token_ids), "finish": out.finish_reason}
        else:
            raise ValueError(f"unknown run {run!r}")
        part["seconds"][run] = round(time.monotonic() - t0, 1)
    part["counters"] = _spec_counters(llm)
    part["selector_walks"] = drafts.selector_walks - walks0
    _shutdown(llm)
    return part


def main(request: dict) -> dict:
    log = KvLog()
    logging.getLogger("vllm").addHandler(log)
    drafts = Drafts()
    reference: dict = {}
    result: dict = {}
    installed = False
    for spec in request["engines"]:
        if spec.get("dflash2") and not installed:
            # after the first engine exists: the plugin is active and vLLM's classes are imported
            drafts.install()
            installed = True
        try:
            result[spec["label"]] = run_engine(spec, request, drafts, log, reference)
        except Exception as exc:  # noqa: BLE001 - reported per engine; the caller decides
            import traceback

            result[spec["label"]] = {"error": f"{type(exc).__name__}: {exc}",
                                     "traceback": traceback.format_exc()[-4000:]}
    return result


if __name__ == "__main__":
    print("@@" + json.dumps(main(json.loads(Path(sys.argv[1]).read_text()))), flush=True)
