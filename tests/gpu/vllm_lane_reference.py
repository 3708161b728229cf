"""Subprocess body of the vLLM lanes' reference: transformers 5.24 `glm5_next` on one device.

    python tests/gpu/vllm_lane_reference.py REQUEST.json   -> one JSON line on stdout, prefixed "@@"

REQUEST: {"device": "cuda" | "cpu", "checkpoints": [{"label": L, "path": DIR,
          "dtypes": ["float32", "bfloat16"], "prompts": {name: [ids]},
          "greedy": {"tokens": N, "prompts": [names]},        # fp32 greedy path (optional)
          "probes": {key: [ids]}}]}                          # fp32 top-2 after these ids (optional)

For every checkpoint and dtype: log p of each prompt token 1..n-1 ("prompt_logprobs"). In fp32:
the greedy continuation by full recomputation, each step as {"token", "top": [[id, log p] x 2],
"routing_gap"} (the format of vLLM's top-2 logprobs), for each probe {"top": the top-2 of the next
token, "routing_gap"}, and per prompt the routing gap of every scored position ("routing_gap":
tests.hf_reference.routing_gap, the smallest over the MoE layers; below 2 x ROUTING_TIE a bf16
run may swap an expert there). fp32 means fp32: TF32 is off for matmuls and cuDNN convolutions.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _top2(logprobs) -> list:
    values, ids = logprobs.topk(2)
    return [[int(i), float(v)] for i, v in zip(ids, values, strict=True)]


def run_checkpoint(spec: dict, device: str) -> dict:
    import torch

    from tests.hf_reference import forward_with_routing_gaps, load_transformers_model

    out: dict = {}
    for dtype in spec.get("dtypes", ["float32"]):
        model = load_transformers_model(spec["path"], dtype=dtype).model.to(device)
        forward = forward_with_routing_gaps(model)

        def logprobs(ids: list[int], forward=forward):
            """(log p per position, routing gap per position)"""
            with torch.inference_mode():
                lp, gap = forward(torch.tensor([ids], device=device))
            return lp, gap.float().cpu()

        prompt, gaps = {}, {}
        for name, ids in spec["prompts"].items():
            lp, gap = logprobs(ids)
            target = torch.tensor(ids[1:], device=device)
            prompt[name] = lp[:-1].gather(1, target[:, None])[:, 0].cpu().tolist()
            gaps[name] = gap[:-1].tolist()  # position i predicts token i + 1
        out[dtype] = prompt
        if dtype == "float32":
            out["routing_gap"] = gaps
            greedy = spec.get("greedy") or {}
            paths = {}
            for name in greedy.get("prompts", []):
                seq, steps = list(spec["prompts"][name]), []
                for _ in range(greedy["tokens"]):
                    lp, gap = logprobs(seq)
                    top = _top2(lp[-1])
                    steps.append({"token": top[0][0], "top": top, "routing_gap": float(gap[-1])})
                    seq.append(top[0][0])
                paths[name] = steps
            out["greedy"] = paths
            out["probes"] = {}
            for key, ids in (spec.get("probes") or {}).items():
                lp, gap = logprobs(ids)
                out["probes"][key] = {"top": _top2(lp[-1]), "routing_gap": float(gap[-1])}
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


def main(request: dict) -> dict:
    import torch

    device = request.get("device", "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    import transformers

    report = {"transformers_version": transformers.__version__, "torch_version": torch.__version__,
              "device": torch.cuda.get_device_name(0) if device == "cuda" else "CPU", "checkpoints": {}}
    for spec in request["checkpoints"]:
        report["checkpoints"][spec["label"]] = run_checkpoint(spec, device)
    return report


if __name__ == "__main__":
    print("@@" + json.dumps(main(json.loads(Path(sys.argv[1]).read_text()))), flush=True)
