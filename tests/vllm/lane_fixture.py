"""The CPU lane's committed prompt log-probabilities of the tiny checkpoint, which the gpu lane
compares vLLM on CUDA against (tests/vllm/test_cpu_lane_fixture.py writes and checks the file).

    tests/vllm/fixtures/cpu-lane-logprobs.json          (AMX hosts; the gpu lane's reference)
    tests/vllm/fixtures/cpu-lane-logprobs-<isa>.json    (other hosts' CPU lane: same prompts)
    {"checkpoint": {"seed": 0, "weights_sha256": ...}, "made_with": {...},
     "prompts": {name: {"text": ..., "ids": [...]}},
     "transformers": {"float32": {name: [log p, ...]}, "bfloat16": {...}},
     "vllm_cpu": {"auto": {name: [...]}, "fp8": {...}, "fp8_ds_mla": {...}}}

Prompts are stored as token ids: the tiny tokenizer is trained on the running Python's standard
library, so another Python (the GPU machine has 3.12) may tokenise the same text differently,
while the weights are drawn per tensor from a seeded generator and do not depend on it. Each list
holds log p of prompt tokens 1..n-1. `weights_sha256` covers every tensor's name, dtype, shape and
bytes (not the file layout), so a run on another machine can tell whether it serves the same
weights before it compares anything.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

# Written on a CPU with AMX tiles (the hosts CI runs on): the file the gpu lane compares against.
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "cpu-lane-logprobs.json"
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_ds_mla")

_LONG_CODE = "class Foo:\n    def __init__(self):\n        self.x = 1\n" * 12
# tests/vllm/test_plugin_serving.py's parity prompts but its 660-token English one (vLLM CPU takes
# minutes over it), then the two prompts of the eager-vs-CUDA-graphs question.
PROMPTS = {
    "short": "def hello(world):",
    "medium": "import os\nimport sys\n\ndef main(argv):\n    return len(argv)\n",
    "sparse-code": _LONG_CODE,  # 215 tokens > index_topk (128): the indexer drops pools
    "fibonacci": "def fibonacci(n):\n    ",
    "config": "import os\nimport sys\n\nclass Config:\n    def __init__(self",
}


def weights_sha256(checkpoint: str | Path) -> str:
    """Digest of every tensor of the checkpoint (name, dtype, shape, bytes), in name order."""
    import torch
    from safetensors import safe_open

    checkpoint = Path(checkpoint)
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    digest = hashlib.sha256()
    by_shard: dict[str, list[str]] = {}
    for name, shard in index["weight_map"].items():
        by_shard.setdefault(shard, []).append(name)
    tensors = {}
    for shard, names in by_shard.items():
        with safe_open(str(checkpoint / shard), framework="pt") as f:
            for name in names:
                tensors[name] = f.get_tensor(name)
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        digest.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def tokenize(checkpoint: str | Path, texts: dict[str, str] | None = None) -> dict[str, list[int]]:
    """`texts` (default PROMPTS) as this machine's copy of the tiny tokenizer encodes them (with
    the BOS prefix the tokenizer adds, as a server would)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    return {name: list(tok(text)["input_ids"]) for name, text in (texts or PROMPTS).items()}


def host_isa() -> str:
    """The CPU kernels vLLM CPU runs here: "amx" where AMX tiles exist (its AMX GEMMs and MLA), else
    torch's CPU capability ("avx512", "avx2", ...): each rounds differently."""
    import torch

    if torch.cpu._is_amx_tile_supported():
        return "amx"
    return torch.backends.cpu.get_cpu_capability().lower()


def host_fixture(isa: str | None = None) -> Path:
    """The fixture this host's CPU lane is checked against: FIXTURE on AMX hosts, else one of the
    same prompts written on a host of that ISA (`cpu-lane-logprobs-<isa>.json`)."""
    isa = isa or host_isa()
    return FIXTURE if isa == "amx" else FIXTURE.with_name(f"{FIXTURE.stem}-{isa}.json")


def load(path: Path = FIXTURE) -> dict:
    return json.loads(Path(path).read_text())


def prompt_ids(fixture: dict) -> dict[str, list[int]]:
    return {name: p["ids"] for name, p in fixture["prompts"].items()}
