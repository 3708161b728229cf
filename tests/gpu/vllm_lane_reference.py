"""Subprocess body of the vLLM lanes' reference: transformers 5.24 `glm5_next` on one device.

    python tests/gpu/vllm_lane_reference.py REQUEST.json   -> one JSON line on stdout, prefixed "@@"

REQUEST: {"device": "cuda" | "cpu", "checkpoints": [{"label": L, "path": DIR,
          "dtypes": ["float32", "bfloat16"], "prompts": {name: [ids]},
          "greedy": {"tokens": N, "prompts": [names]},        # fp32 greedy path (optional)
          "probes": {key: [ids]}}]}                          # fp32 top-2 after these ids (optional)

For every checkpoint and dtype: log p of each prompt token 1..n-1 ("prompt_logprobs"). In fp32:
the greedy continuation by full recomputation, each step as {"token", "top": [[id, log p] x 2]}
(the format of vLLM's top-2 logprobs), and for each probe the top-2 of the next token. fp32 means
fp32: TF32 is off for matmuls and cuDNN convolutions.
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

    from tests.hf_reference import load_transformers_model

    out: dict = {}
    for dtype in spec.get("dtypes", ["float32"]):
        model = load_transformers_model(spec["path"], dtype=dtype).model.to(device)

        def logprobs(ids: list[int], model=model):
            with torch.inference_mode():
                logits = model(input_ids=torch.tensor([ids], device=device)).logits[0].float()
            return torch.log_softmax(logits, -1)

        prompt = {}
        for name, ids in spec["prompts"].items():
            lp = logprobs(ids)
            target = torch.tensor(ids[1:], device=device)
            prompt[name] = lp[:-1].gather(1, target[:, None])[:, 0].cpu().tolist()
        out[dtype] = prompt
        if dtype == "float32":
            greedy = spec.get("greedy") or {}
            paths = {}
            for name in greedy.get("prompts", []):
                seq, steps = list(spec["prompts"][name]), []
                for _ in range(greedy["tokens"]):
                    top = _top2(logprobs(seq)[-1])
                    steps.append({"token": top[0][0], "top": top})
                    seq.append(top[0][0])
                paths[name] = steps
            out["greedy"] = paths
            out["probes"] = {key: _top2(logprobs(ids)[-1]) for key, ids in (spec.get("probes") or {}).items()}
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
