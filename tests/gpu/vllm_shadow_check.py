"""The plugin's CUDA kernels checked inside real vLLM against their torch references, call by call.

    python tests/gpu/vllm_shadow_check.py CHECKPOINT OUT.json [--prompts REQUEST.json]

One in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0, eager, the gpu lane's settings). Every
kernel call of the kpool indexer and the sparse-MLA backend is shadowed: its inputs are cloned,
the kernel runs as served, then the torch reference (glmctl.kernels' `*_ref`, the CPU target's
kernels) runs on the clones, and the two results are compared (caches entry by entry, logits where
the reference is finite, top-k as sets per row, attention output and log-sum-exp). vLLM's own
CUDA FP8 query quantisation (`fwht128_quant_fp8`) is shadowed by glmctl's reference too. Then the
sparse-text prompt's log p is taken with the served kernels, with the references in their place
(indexer, sparse MLA, both), and compared with transformers fp32 on the same GPU before and after
the top-k boundary (positions whose fp32 routing is decisive).

It answers where the CUDA path departs when the served model does (a kernel that disagrees with its
reference on vLLM's own inputs, or inputs that differ from what the references expect). The gpu
lane runs it beside the engines (bench/gpu/vllm_lane.sh); its table is printed last.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("GLMCTL_PLUGIN", "on")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHADOW_CALLS = 6  # per kernel: the first calls of each (prefill and the first decode steps)
STATS: dict = defaultdict(lambda: {"calls": 0, "worst": 0.0, "rows": 0, "rows_differing": 0, "notes": []})
INSTANCES: dict[str, list] = {"indexer": [], "mla": []}


def _rel(a, b) -> float:

    a, b = a.float(), b.float()
    scale = b.abs().max().clamp_min(1e-6)
    return float((a - b).abs().max() / scale) if a.numel() else 0.0


def _note(name: str, worst: float = 0.0, rows: int = 0, differing: int = 0, note: str | None = None) -> None:
    s = STATS[name]
    s["calls"] += 1
    s["worst"] = max(s["worst"], worst)
    s["rows"] += rows
    s["rows_differing"] += differing
    if note and len(s["notes"]) < 4:
        s["notes"].append(note)


def _cache_entries(cache):
    """The indexer cache as (fp8 values dequantised [entries, 128], present mask) per entry."""

    from glmctl.kernels.layouts import indexer_page_views

    values, scales = indexer_page_views(cache)
    deq = values.float().reshape(-1, values.shape[-1]) * scales.float().reshape(-1, 1)
    return deq, scales.reshape(-1) != 0


def _shadow_indexer(ix, refs) -> None:
    import torch

    served = ix.kernels
    table = type(served)(**vars(served))

    def cache_op(name, fn, ref, cache_args):
        def call(*args, **kwargs):
            if STATS[name]["calls"] >= SHADOW_CALLS:
                return fn(*args, **kwargs)
            clones = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            out = fn(*args, **kwargs)
            ref(*clones, **kwargs)
            worst, rows, differing = 0.0, 0, 0
            for i in cache_args:
                got, want = args[i], clones[i]
                if got.dtype == torch.uint8 and got.shape[-1] == 132:  # pooled keys: compare dequantised
                    (dg, mg), (dw, mw) = _cache_entries(got), _cache_entries(want)
                    keep = mg | mw
                    worst = max(worst, _rel(dg[keep], dw[keep]) if keep.any() else 0.0)
                    rows, differing = rows + int(keep.sum()), differing + int((mg != mw).sum())
                else:
                    worst = max(worst, _rel(got, want))
            _note(name, worst, rows, differing)
            return out
        return call

    table.prefill_write = cache_op("indexer.prefill_write", served.prefill_write, refs.prefill_write, [0])
    table.tail_seed = cache_op("indexer.tail_seed", served.tail_seed, refs.tail_seed, [0])
    table.decode_update = cache_op("indexer.decode_update", served.decode_update, refs.decode_update, [0, 1])

    def logits(name, fn, ref):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            if STATS[name]["calls"] < SHADOW_CALLS:
                want = ref(*args, **kwargs)
                finite = torch.isfinite(want)
                _note(name, _rel(out[finite], want[finite]) if finite.any() else 0.0, int(want.shape[0]))
            return out
        return call

    table.logits_ragged = logits("indexer.logits_ragged", served.logits_ragged, refs.logits_ragged)
    table.logits_paged = logits("indexer.logits_paged", served.logits_paged, refs.logits_paged)

    def compare(name, out, want, where):
        """Each row's selected token set against the reference's; `where(i)` names row i."""
        got_sets = [set(r[r >= 0].tolist()) for r in out]
        want_sets = [set(r[r >= 0].tolist()) for r in want]
        bad = [i for i, (g, w) in enumerate(zip(got_sets, want_sets, strict=False)) if g != w]
        note = None
        if bad:
            i = bad[0]
            note = (f"row {i} ({where(i)}): served-only {sorted(got_sets[i] - want_sets[i])[:8]}, "
                    f"reference-only {sorted(want_sets[i] - got_sets[i])[:8]}")
        _note(name, 0.0, len(got_sets), len(bad), note)

    def topk(logits_, seq_lens, out, **kwargs):
        served.topk(logits_, seq_lens, out, **kwargs)
        if STATS["indexer.topk"]["calls"] < SHADOW_CALLS:
            want = torch.full_like(out, -1)
            ref_kwargs = {k: v for k, v in kwargs.items() if k != "workspace"}
            refs.topk(logits_.clone(), seq_lens, want, **ref_kwargs)
            compare("indexer.topk", out, want, lambda i: f"seq_len {int(seq_lens[i])}")

    def topk_decode(logits_, positions, context, out, **kwargs):
        served.topk_decode(logits_, positions, context, out, **kwargs)
        if STATS["indexer.topk_decode"]["calls"] < SHADOW_CALLS:
            want = torch.full_like(out, 7)
            ref_kwargs = {k: v for k, v in kwargs.items() if k != "workspace"}
            refs.topk_decode(logits_.clone(), positions, context, want, **ref_kwargs)
            compare("indexer.topk_decode", out, want, lambda i: f"position {int(positions.reshape(-1)[i])}"
                    if i < positions.numel() else "position pad")

    table.topk = topk
    table.topk_decode = topk_decode
    ix.kernels = table


def _shadow_mla(impl, refs) -> None:
    import torch

    served = impl.kernels
    table = type(served)(**vars(served))

    def attention(q, kv_cache, rows, scale, *args, kv_scale=None, **kwargs):
        out = served.attention(q, kv_cache, rows, scale, *args, kv_scale=kv_scale, **kwargs)
        if STATS["mla.prefill"]["calls"] < SHADOW_CALLS:
            o, lse = refs.attention(q, kv_cache, rows, scale, kv_scale=kv_scale)
            _note("mla.prefill", max(_rel(out[0], o), _rel(out[1], lse)), int(q.shape[0]))
        return out

    def decode(q, kv_cache, rows, scale, out, lse, plan, ws, kv_scale=None):
        served.decode(q, kv_cache, rows, scale, out, lse, plan, ws, kv_scale=kv_scale)
        if STATS["mla.decode"]["calls"] < SHADOW_CALLS:
            o, want_lse = refs.attention(q, kv_cache, rows, scale, kv_scale=kv_scale)
            _note("mla.decode", max(_rel(out, o), _rel(lse, want_lse)), int(q.shape[0]),
                  note=f"plan for {getattr(plan, 'num_tokens', '?')} tokens, batch {q.shape[0]}")

    def cache_write(kv_c, slots, cache, kv_scale):
        before = cache.clone()
        served.cache_write(kv_c, slots, cache, kv_scale)
        if STATS["mla.cache_write"]["calls"] < SHADOW_CALLS:
            refs.cache_write(kv_c, slots, before, kv_scale)
            _note("mla.cache_write", _rel(cache.view(torch.uint8).float(), before.view(torch.uint8).float())
                  if cache.dtype != torch.bfloat16 else _rel(cache, before))

    def rows(token_indices, req_ids, block_table, block_size, rows_per_block):
        got = served.rows(token_indices, req_ids, block_table, block_size, rows_per_block)
        if STATS["mla.rows"]["calls"] < SHADOW_CALLS:
            want = refs.rows(token_indices, req_ids, block_table, block_size, rows_per_block)
            differing = int((got != want).any(dim=1).sum())
            _note("mla.rows", 0.0, int(got.shape[0]), differing)
        return got

    table.attention, table.cache_write, table.rows = attention, cache_write, rows
    if served.decode is not None:
        table.decode = decode
    impl.kernels = table


def _shadow_q_quant() -> None:
    from glmctl.kernels.kpool_cache_write import indexer_q_quant_ref
    from vllm.models.glm5next.nvidia import attention

    served = attention.fwht128_quant_fp8
    if served is indexer_q_quant_ref:
        return

    def quant(q):
        q_fp8, q_scale = served(q)
        if STATS["indexer.q_quant (vLLM)"]["calls"] < SHADOW_CALLS:
            r_fp8, r_scale = indexer_q_quant_ref(q)
            got = q_fp8.float() * q_scale.reshape(-1, 1).float()
            want = r_fp8.float() * r_scale.reshape(-1, 1).float()
            _note("indexer.q_quant (vLLM)", _rel(got, want), int(q.shape[0]))
        return q_fp8, q_scale

    attention.fwht128_quant_fp8 = quant


def _register_instances() -> None:
    import vllm.models.glm5next  # noqa: F401 - before the plugin's indexer module (they import each other)

    from glmctl.plugin.attention.indexer import GlmctlKpoolIndexer
    from glmctl.plugin.attention.sparse_mla import GlmctlSparseMLAImpl

    for cls, key in ((GlmctlKpoolIndexer, "indexer"), (GlmctlSparseMLAImpl, "mla")):
        stock = cls.__init__

        def init(self, *args, _stock=stock, _key=key, **kwargs):
            _stock(self, *args, **kwargs)
            INSTANCES[_key].append(self)

        cls.__init__ = init


def _use(kind: str, served: dict) -> None:
    """Kernels for every instance: "served" (as vLLM built them) or "ref" (torch references)."""
    from glmctl.plugin.attention.kernel_table import indexer_kernels, sparse_mla_kernels
    from glmctl.plugin.policy import Target

    for part in ("indexer", "mla"):
        for obj in INSTANCES[part]:
            if kind in ("ref", f"ref-{part}"):
                obj.kernels = indexer_kernels(Target.TORCH) if part == "indexer" else sparse_mla_kernels(Target.TORCH)
                if part == "indexer":
                    obj.topk_workspace = None
                else:
                    obj.decode = None
            else:
                obj.kernels, extra = served[id(obj)]
                if part == "indexer":
                    obj.topk_workspace = extra
                else:
                    obj.decode = extra


def _prompt_logprobs(llm, ids: list[int]) -> list[float]:
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return [float(d[t].logprob) for d, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]


def _greedy(llm, prompts: list[list[int]], n: int) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=n),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def main(checkpoint: str, out_path: str, prompts: dict) -> dict:
    import numpy as np
    import torch

    _register_instances()
    from vllm import LLM

    from glmctl.plugin.attention.kernel_table import indexer_kernels, sparse_mla_kernels
    from glmctl.plugin.policy import Target
    from tests.gpu.vllm_lane_runs import cpu_engine_args, gpu_engine_args

    on_cuda = torch.cuda.is_available()
    llm = LLM(model=checkpoint, **(gpu_engine_args if on_cuda else cpu_engine_args)("eager"))
    runner = "V2" if getattr(llm.llm_engine.vllm_config, "use_v2_model_runner", False) else "V1"
    served = {id(o): (o.kernels, o.topk_workspace) for o in INSTANCES["indexer"]}
    served.update({id(o): (o.kernels, o.decode) for o in INSTANCES["mla"]})
    for ix in INSTANCES["indexer"]:
        _shadow_indexer(ix, indexer_kernels(Target.TORCH))
    for impl in INSTANCES["mla"]:
        _shadow_mla(impl, sparse_mla_kernels(Target.TORCH))
    _shadow_q_quant()
    text = prompts["sparse-text"]
    import vllm

    result: dict = {"vllm_version": vllm.__version__, "torch_version": torch.__version__,
                    "device": torch.cuda.get_device_name(0) if on_cuda else "CPU",
                    "runner": runner, "mhc": os.environ.get("GLMCTL_MHC", "auto"),
                    "instances": {k: len(v) for k, v in INSTANCES.items()}}
    lp = {"served (shadowed)": _prompt_logprobs(llm, text)}
    greedy_batch = _greedy(llm, [prompts[n] for n in prompts], 16)
    result["shadow"] = {k: dict(v) for k, v in STATS.items()}
    _use("served", served)
    for kind in ("ref-indexer", "ref-mla", "ref"):
        _use(kind, served)
        lp[kind] = _prompt_logprobs(llm, text)
        if kind == "ref":
            result["greedy_ref_batch"] = _greedy(llm, [prompts[n] for n in prompts], 16)
    _use("served", served)
    lp["served"] = _prompt_logprobs(llm, text)
    result["greedy_served_batch"] = greedy_batch
    result["greedy_served_alone"] = [_greedy(llm, [prompts[n]], 16)[0] for n in prompts]
    llm.llm_engine.engine_core.shutdown()
    del llm
    torch.cuda.empty_cache()

    fp32, gap = _reference(checkpoint, text, "cuda" if on_cuda else "cpu", Path(out_path))
    from tests.vllm.noise_floor import ROUTING_TIE

    decisive = gap >= ROUTING_TIE
    cut = 128
    rows = {}
    for kind, values in lp.items():
        d = np.abs(np.asarray(values) - fp32)
        rows[kind] = {"before_topk": float(d[:cut][decisive[:cut]].mean()),
                      "after_topk": float(d[cut:][decisive[cut:]].mean()), "all": float(d.mean())}
    result["sparse_text_vs_fp32"] = rows
    Path(out_path).write_text(json.dumps(result, indent=1))
    return result


def _reference(checkpoint: str, ids: list[int], device: str, out_path: Path):
    """transformers fp32 log p of each token and the routing gap per position, in its own process
    (vLLM, once imported, changes transformers' config classes): tests/gpu/vllm_lane_reference.py."""
    import subprocess
    import tempfile

    import numpy as np

    request = Path(tempfile.mkdtemp()) / "reference.json"  # not beside OUT: the GPU call returns 8 files
    request.write_text(json.dumps({"device": device, "checkpoints": [
        {"label": "bf16", "path": checkpoint, "dtypes": ["float32"], "prompts": {"text": ids}}]}))
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("vllm_lane_reference.py")), str(request)],
                          capture_output=True, text=True, timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("@@")), None)
    if line is None:
        raise RuntimeError(f"transformers reference failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    ref = json.loads(line[2:])["checkpoints"]["bf16"]
    return (np.asarray(ref["float32"]["text"], dtype=np.float64),
            np.asarray(ref["routing_gap"]["text"], dtype=np.float64))


def table(result: dict) -> str:
    lines = [f"shadow check ({result['runner']} runner, mHC {result['mhc']}, {result['instances']}):",
             f"  {'kernel':<26} {'calls':>5} {'worst rel':>9} {'rows':>6} {'differ':>6}  note"]
    for name, s in sorted(result["shadow"].items()):
        lines.append(f"  {name:<26} {s['calls']:>5} {s['worst']:>9.2e} {s['rows']:>6} {s['rows_differing']:>6}  "
                     + "; ".join(s["notes"])[:160])
    lines.append("  sparse-text log p vs transformers fp32 (decisive positions, mean |d| nats):")
    for kind, r in result["sparse_text_vs_fp32"].items():
        lines.append(f"    {kind:<20} before top-k {r['before_topk']:.3f}  after {r['after_topk']:.3f}  all {r['all']:.3f}")
    same = sum(a == b for a, b in zip(result["greedy_served_alone"], result["greedy_served_batch"], strict=False))
    same_ref = sum(a == b for a, b in zip(result["greedy_ref_batch"], result["greedy_served_batch"], strict=False))
    lines.append(f"  greedy 16 tokens: served alone == served batch for {same}/{len(result['greedy_served_alone'])}; "
                 f"reference kernels batch == served batch for {same_ref}")
    return "\n".join(lines)


if __name__ == "__main__":
    ckpt, out = sys.argv[1], sys.argv[2]
    request = json.loads(Path(sys.argv[3]).read_text()) if len(sys.argv) > 3 else None
    if request is None:
        from tests.gpu.vllm_lane_runs import lane_prompts

        request, _, _ = lane_prompts(Path(ckpt))
        request = {k: v for k, v in request.items() if k != "stdlib-384"}
    print(table(main(ckpt, out, request)), flush=True)
