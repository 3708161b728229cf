"""Subprocess body of test_plugin_mtp: the tiny GLM-5.3-Flash's greedy output with and without MTP-3
speculation, offline, two vLLM engines one after the other in this process.

    python tests/vllm/mtp_parity.py CHECKPOINT '{"prompts": {...}, "tokens": N}'
        -> one JSON line on stdout, prefixed "@@"

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the second engine
costs seconds, and the drafter can be observed and steered from here.

1. Plain decoding of every prompt, alone ("single") and as four identical requests in one batch
   ("batch4", the first copy): four rows per decode step, the row count of an MTP-3 verify step.
   vLLM CPU's matrix products round a one-row step differently from a four-row one, so
   "batch4" is the run MTP should match bit for bit, and "single" is a second batch
   composition to tell such rounding apart from speculation.
2. MTP-3 ("method": "mtp", 3 drafts): every prompt alone with the checkpoint's own MTP drafts
   ("mtp"; a random MTP layer's drafts are nearly always rejected), then with the drafts replaced
   by the plain continuation, one draft corrupted on a schedule so that verify steps accept
   3, 2, 1 and 0 drafts in turn ("oracle": every acceptance path of the verify bookkeeping), and
   one sampled request (temperature 0.8, seeded). vLLM's spec-decode counters for each part.
Greedy results: per step the token id and the top-2 logprobs.
"""

from __future__ import annotations

import gc
import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("GLMCTL_PLUGIN", "auto")
os.environ.pop("GLMCTL_PLUGIN_ACTIVE", None)

SPEC = {"method": "mtp", "num_speculative_tokens": 3, "use_local_argmax_reduction": True}  # as glmctl serves it
# Which draft (0-based) the oracle corrupts at its n-th verify step, cyclically: None keeps all
# three (3 accepted), 2 -> 2 accepted, 1 -> 1, 0 -> 0.
CORRUPT = (None, 2, 1, 0)


def _greedy(llm, prompts, tokens, copies=1):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, logprobs=2)
    out = {}
    for name, prompt in prompts.items():
        completion = llm.generate([prompt] * copies, params, use_tqdm=False)[0].outputs[0]
        steps = []
        for token, top in zip(completion.token_ids, completion.logprobs, strict=True):
            ranked = sorted(top.items(), key=lambda kv: kv[1].logprob, reverse=True)
            steps.append({"token": int(token),
                          "top": [[int(t), float(lp.logprob)] for t, lp in ranked[:2]]})
        out[name] = steps
    return out


def _spec_counters(llm) -> dict:
    counters = {}
    for metric in llm.get_metrics():
        if "spec_decode" in metric.name:
            value = getattr(metric, "value", None)
            counters[metric.name] = value if value is not None else list(metric.values)
    return counters


def _delta(after: dict, before: dict) -> dict:
    out = {}
    for name, value in after.items():
        old = before.get(name)
        if isinstance(value, list):
            old = old or [0] * len(value)
            out[name] = [a - b for a, b in zip(value, old, strict=True)]
        else:
            out[name] = value - (old or 0)
    return out


class Oracle:
    """Replaces the drafter's proposals with the known greedy continuation, one draft corrupted
    per step on the `corrupt` schedule (tests/vllm/dflash2_parity.Drafts steers DFlash2 with it)."""

    def __init__(self, corrupt: tuple = CORRUPT):
        self.corrupt = corrupt
        self.reference: list[int] | None = None
        self.position = None
        self.steps = 0

    def start(self, reference: list[int]) -> None:
        self.reference, self.position, self.steps = reference, None, 0

    def install(self) -> None:
        """Steer both model runners' drafters: V1's proposer (vLLM CPU, and CUDA with
        VLLM_USE_V2_MODEL_RUNNER=0) and the V2 runner's MTP speculators (CUDA's default)."""
        from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

        stock = SpecDecodeBaseProposer.propose
        oracle = self

        def propose(proposer, *args, **kwargs):
            drafts = stock(proposer, *args, **kwargs)
            if oracle.reference is None:
                return drafts
            return oracle.replace(drafts, emitted(drafts, kwargs.get("num_rejected_tokens_gpu")))

        SpecDecodeBaseProposer.propose = propose
        for cls in v2_speculators(("mtp", "multi_module_mtp")):
            _steer_v2(cls, oracle)

    def replace(self, drafts, emitted: int | None):
        """Replace request 0's drafts; `emitted`: the tokens the last verify step produced
        (None right after prefill)."""
        import torch

        if self.reference is None:
            return drafts
        width = drafts.shape[1]
        if self.position is None:  # right after prefill: the next token is the first output
            self.position = 0
        else:
            self.position += emitted
        nxt = self.position + 1
        want = [self.reference[p] if p < len(self.reference) else 0 for p in range(nxt, nxt + width)]
        bad = self.corrupt[self.steps % len(self.corrupt)]
        if bad is not None:
            want[bad] = (want[bad] + 1) % 2048
        self.steps += 1
        drafts[0] = torch.tensor(want, dtype=drafts.dtype, device=drafts.device)
        return drafts


def emitted(drafts, num_rejected) -> int | None:
    """The tokens request 0's last verify step emitted (its accepted drafts plus one), from the
    rejected count a proposer is given; None right after prefill (no rejected count yet)."""
    return None if num_rejected is None else drafts.shape[1] - int(num_rejected[0]) + 1


def v2_speculators(kinds) -> list[type]:
    """The V2 model runner's speculator classes of these kinds (module names under
    vllm.v1.worker.gpu.spec_decode) that this vLLM has; none where it has no V2 runner."""
    import importlib
    import inspect

    found: list[type] = []
    for kind in kinds:
        try:
            module = importlib.import_module(f"vllm.v1.worker.gpu.spec_decode.{kind}.speculator")
        except ImportError:
            continue
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__ or not hasattr(cls, "propose"):
                continue
            owner = next(c for c in cls.__mro__ if "propose" in c.__dict__)  # where it is defined
            if owner not in found:
                found.append(owner)
    return found


def _steer_v2(cls, oracle) -> None:
    """V2's `propose(input_batch, attn_metadata, slot_mappings, last_hidden_states,
    aux_hidden_states, num_sampled, num_rejected, ...)` returns [num_reqs, drafts]; after a
    verify step `num_sampled[r]` is the tokens request r emitted (accepted + 1)."""
    stock = cls.propose
    if getattr(stock, "_oracle", False):
        return

    def propose(speculator, *args, **kwargs):
        drafts = stock(speculator, *args, **kwargs)
        if kwargs.get("dummy_run") or oracle.reference is None:
            return drafts
        sampled = kwargs["num_sampled"] if "num_sampled" in kwargs else args[5]
        return oracle.replace(drafts, int(sampled[0]))

    propose._oracle = True
    cls.propose = propose


def _engine(path, **kwargs):
    from vllm import LLM

    return LLM(model=path, dtype="bfloat16", max_model_len=8192, enforce_eager=True, seed=0,
               max_logprobs=-1, disable_log_stats=False, **kwargs)


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


def main(path: str, request: dict) -> dict:
    from vllm import SamplingParams

    prompts, tokens = request["prompts"], request["tokens"]
    result: dict = {}
    llm = _engine(path)
    result["single"] = _greedy(llm, prompts, tokens)
    result["batch4"] = _greedy(llm, prompts, tokens, copies=4)
    _shutdown(llm)

    oracle = Oracle()
    llm = _engine(path, speculative_config=SPEC)
    oracle.install()
    result["mtp"] = _greedy(llm, prompts, tokens)
    before = _spec_counters(llm)
    result["mtp_counters"] = before
    result["oracle"] = {}
    for name, prompt in prompts.items():
        oracle.start([step["token"] for step in result["batch4"][name]])
        result["oracle"].update(_greedy(llm, {name: prompt}, tokens))
    oracle.reference = None
    result["oracle_counters"] = _delta(_spec_counters(llm), before)
    sampled = llm.generate([prompts[next(iter(prompts))]],
                           SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=tokens),
                           use_tqdm=False)[0].outputs[0]
    result["sampled"] = {"tokens": len(sampled.token_ids), "finish": sampled.finish_reason}
    _shutdown(llm)
    return result


if __name__ == "__main__":
    print("@@" + json.dumps(main(sys.argv[1], json.loads(sys.argv[2]))), flush=True)
