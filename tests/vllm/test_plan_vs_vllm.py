"""The planner's KV layout and capacity against vLLM 0.30's own code, for the tiny checkpoint and for
the full GLM-5.3-Flash config.

`kv_oracle.py` (run in a subprocess) builds vLLM's per-layer KV cache specs with vLLM's methods
(`MLAAttention.get_kv_cache_spec`, the real `Glm5NextIndexerCache` / `Glm5NextTailCache` modules,
`MambaBase.get_kv_cache_spec` with `Glm5NextLinearAttention`'s state shapes), lets vLLM's hybrid
block-size alignment pick the block size, and runs vLLM's grouping and capacity code
(`get_kv_cache_configs`, `get_kv_cache_capacity`) for a given amount of KV memory. Compared for every
case: block size, the page of every layer kind (MLA, indexer K cache, indexer tail, KDA state), the
number of KDA groups, the number of blocks, the KV tokens vLLM would log, and whether vLLM refuses
the layout or the memory.

The same with glmctl's plugin (its block rule and MTP tail ring, installed by the plugin's own
installers) for one TP8 rank of GLM-5.3-Flash served as a TP1 model (`glmctl testing rank-config`),
on vLLM CUDA's alignment (the H200 run's setup, whose logged 3,988,593 tokens are asserted) and on
vLLM CPU's. And end to end: vLLM CPU itself (`vllm serve`, the plugin, `--load-format dummy`) builds
a 4-layer, dense-MLP cut of that rank model and logs the KV tokens `glmctl plan --cpu` predicts.

What cannot be compared on CPU, and why: the memory vLLM finds available for KV
(`Worker.determine_available_memory`) is measured on a GPU with the weights loaded. So weights,
reserves and the budget are not compared here; the per-layer pages and everything from "available
bytes" to "KV tokens" is. The oracle's stand-ins (model config, layer attribute holders) are listed
in its docstring.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from glmctl.plan import kv_cache_layout, kv_capacity, load_model_spec
from glmctl.plan.presets import GLM53_FLASH
from tests.conftest import REPO

pytestmark = pytest.mark.vllm

FULL_KV_BYTES = 3_463_600_000  # the report's first pool, roughly
TINY_KV_BYTES = 1 << 30
H200_RUN_KV_BYTES = int(47.84 * (1 << 30))  # "Available KV cache memory: 47.84 GiB" (TP8 rank model, H200)
H200_RUN_KV_TOKENS = 3_988_593  # what that run's vLLM logged


def _cases(full: str, tiny: str) -> list[dict]:
    # backend "glmctl": the MLA cache dtype is what vLLM gives glmctl's sparse-MLA backend for it
    base = dict(kernel_block_size=64, prefix_caching=True, num_spec=0, backend="glmctl")
    cases = [
        dict(base, config=full, tp=8, kv_cache_dtype=dtype, num_spec=spec, prefix_caching=prefix,
             max_model_len=262_144, available_bytes=FULL_KV_BYTES)
        for dtype in ("auto", "fp8", "fp8_ds_mla")
        for spec, prefix in ((0, True), (3, True), (0, False))
    ]
    cases += [
        dict(base, config=full, tp=4, kv_cache_dtype="fp8", num_spec=3, max_model_len=262_144,
             available_bytes=FULL_KV_BYTES),
        dict(base, config=full, tp=8, kv_cache_dtype="fp8_e4m3", max_model_len=262_144,
             available_bytes=FULL_KV_BYTES),
        # one request of 262,144 tokens does not fit: vLLM refuses to start
        dict(base, config=full, tp=4, kv_cache_dtype="auto", num_spec=3, max_model_len=262_144,
             available_bytes=FULL_KV_BYTES),
        # the tiny checkpoint: bf16 at block 512 is a layout vLLM 0.30 rejects; 1024 works
        dict(base, config=tiny, tp=1, kv_cache_dtype="auto", prefix_caching=False, max_model_len=8192,
             available_bytes=TINY_KV_BYTES),
        dict(base, config=tiny, tp=1, kv_cache_dtype="auto", prefix_caching=False, max_model_len=8192,
             available_bytes=TINY_KV_BYTES, user_block_size=1024),
        dict(base, config=tiny, tp=1, kv_cache_dtype="fp8", num_spec=3, max_model_len=8192,
             available_bytes=TINY_KV_BYTES),
        dict(base, config=tiny, tp=2, kv_cache_dtype="fp8_ds_mla", max_model_len=8192,
             available_bytes=TINY_KV_BYTES, user_block_size=1024),
    ]
    return cases


def _rank_cases(full: str, rank: str) -> list[dict]:
    """One TP8 rank of GLM-5.3-Flash as a TP1 model, with glmctl's plugin: the H200 run's setup
    (fp8 KV, 8,192 tokens, prefix caching off, 47.84 GiB) first, then MTP-3, prefix caching,
    262,144 tokens, the TP8 node itself, and vLLM CPU's path."""
    base = dict(config=rank, tp=1, kernel_block_size=16, backend="glmctl", plugin=True, kv_cache_dtype="fp8",
                num_spec=0, prefix_caching=False, max_model_len=8192, available_bytes=H200_RUN_KV_BYTES)
    return [
        base,
        dict(base, num_spec=3),
        dict(base, prefix_caching=True),
        dict(base, num_spec=3, prefix_caching=True, max_model_len=262_144),
        dict(base, kv_cache_dtype="auto", num_spec=3, max_model_len=262_144),
        dict(base, config=full, tp=8),
        dict(base, config=full, tp=8, num_spec=3, max_model_len=262_144),
        dict(base, platform="cpu", available_bytes=TINY_KV_BYTES),
        dict(base, platform="cpu", num_spec=3, available_bytes=TINY_KV_BYTES),
        dict(base, platform="cpu", kv_cache_dtype="auto", available_bytes=TINY_KV_BYTES),
    ]


@pytest.fixture(scope="module")
def rank_config_json(tmp_path_factory) -> str:
    from glmctl.plan.prediction.rank import rank_model_spec
    from glmctl.testing.rank_config import rank_hf_config

    rank = rank_model_spec(load_model_spec("glm-5.3-flash"), 8)
    path = tmp_path_factory.mktemp("rank") / "config.json"
    path.write_text(json.dumps(rank_hf_config(rank, {"stop_token_ids": [0], "pad_token_id": 0},
                                              GLM53_FLASH["indexer_types"], experts="fp8")))
    return str(path)


@pytest.fixture(scope="module")
def oracle(tmp_path_factory, tiny_checkpoint, rank_config_json):
    full = tmp_path_factory.mktemp("glm53") / "config.json"
    full.write_text(json.dumps(GLM53_FLASH))
    cases = _cases(str(full), str(tiny_checkpoint.path / "config.json")) + _rank_cases(str(full), rank_config_json)
    proc = subprocess.run([sys.executable, "tests/vllm/kv_oracle.py", json.dumps(cases)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("@@")]
    assert lines, proc.stderr[-4000:]
    return list(zip(cases, json.loads(lines[-1][2:]), strict=True))


def _planner(case: dict):
    model = load_model_spec(case["config"])
    layout = kv_cache_layout(
        model, tp=case["tp"], kv_cache_dtype=case["kv_cache_dtype"], num_spec=case["num_spec"],
        mtp_layers=model.num_nextn_predict_layers if case["num_spec"] else 0,
        prefix_caching=case["prefix_caching"], kernel_block_size=case["kernel_block_size"],
        user_block_size=case.get("user_block_size"), glmctl_plugin=case.get("plugin", False),
        platform=case.get("platform", "cuda"),
    )
    return layout, kv_capacity(layout, case["available_bytes"], case["max_model_len"])


def test_layouts_and_capacity_equal_vllms(oracle):
    checked = refused = 0
    for case, vllm in oracle:
        layout, capacity = _planner(case)
        label = {k: case.get(k) for k in ("config", "tp", "kv_cache_dtype", "num_spec", "prefix_caching",
                                          "plugin", "platform", "max_model_len")}
        pages = {kind: pairs[0] for kind, pairs in vllm["pages"].items()}
        assert all(len(pairs) == 1 for pairs in vllm["pages"].values()), (label, vllm["pages"])
        assert vllm["mla_kv_cache_dtype"] == case["kv_cache_dtype"], label  # no remapping
        assert layout.block_size == vllm["block_size"], label
        assert layout.mla_page_bytes == pages["mla"][0], label
        assert layout.indexer_page_bytes == pages["k_cache"][0], label
        assert layout.tail_page_bytes == pages["tail_cache"][1], label  # unpadded
        # real KDA state; vLLM pads the layer's page, and the grouping pads it to the MLA page
        assert layout.kda_state_bytes == pages["kda"][1] <= pages["kda"][0] <= layout.mla_page_bytes, label
        assert vllm["layers"]["mla"] == layout.num_mla_layers and vllm["layers"]["kda"] == layout.num_kda_layers
        if "error" in vllm:
            refused += 1
            fits = layout.error is None and case["available_bytes"] >= capacity.needed_bytes
            assert not fits, (label, vllm["error"])
            continue
        assert layout.error is None, (label, layout.error)
        mamba_groups = sum(1 for kind, _ in vllm["groups"] if kind == "MambaSpec")
        assert layout.num_kda_groups == mamba_groups, label
        assert capacity.num_blocks == vllm["num_blocks"], label
        assert capacity.kv_tokens == vllm["kv_tokens"], label
        assert capacity.max_concurrency == pytest.approx(vllm["max_concurrency"]), label
        checked += 1
    assert checked >= 20 and refused == 2  # the tiny bf16 layout and the 1-request-does-not-fit case


def test_rank_model_of_the_h200_run_is_the_planners(oracle, rank_config_json):
    """The TP8 rank model vLLM logged 3,988,593 KV tokens for on the H200 (block 2,048; groups
    [2048, 16, 8192 x 4]: MLA + indexer, the tail, four KDA groups in "none" mode): vLLM's own
    functions with glmctl's block rule give the same, and so does the planner; the TP8 node's GPU
    has the same layout."""
    rank = next(vllm for case, vllm in oracle if case["config"] == rank_config_json)
    node = next(vllm for case, vllm in oracle if case.get("plugin") and case["tp"] == 8
                and case["max_model_len"] == 8192)
    assert rank["block_size"] == 2048 and rank["kv_tokens"] == H200_RUN_KV_TOKENS
    assert [kind for kind, _ in rank["groups"]] == ["UniformTypeKVCacheSpecs"] * 2 + ["MambaSpec"] * 4
    assert (node["block_size"], node["num_blocks"], node["kv_tokens"]) == (
        rank["block_size"], rank["num_blocks"], rank["kv_tokens"])
    layout, capacity = _planner(next(case for case, _ in oracle if case["config"] == rank_config_json))
    assert (layout.block_size, capacity.kv_tokens) == (2048, H200_RUN_KV_TOKENS)


def test_fp8_page_for_glmctls_backend_is_the_planners_512_byte_row(oracle):
    """`--kv-cache-dtype fp8` with glmctl's sparse-MLA backend: vLLM keeps `fp8` (its mapping to
    the 656-byte fp8_ds_mla record is for a backend named FLASHMLA_SPARSE only), and its own
    MLAAttentionSpec page is block_size x the planner's `mla_bytes_per_token(..., "fp8")` = 512
    bytes per token, for the full GLM-5.3-Flash config, the TP8 rank model and the tiny checkpoint."""
    from glmctl.plan.kv_cache import mla_bytes_per_token

    seen = set()
    for case, vllm in oracle:
        if case["kv_cache_dtype"] not in ("fp8", "fp8_e4m3"):
            continue
        model = load_model_spec(case["config"])
        assert vllm["mla_kv_cache_dtype"] == case["kv_cache_dtype"]
        assert vllm["flashmla_sparse_kv_cache_dtype"] == "fp8_ds_mla"
        mla_page = vllm["pages"]["mla"][0][0]
        assert mla_page == vllm["block_size"] * mla_bytes_per_token(model, case["kv_cache_dtype"])
        assert mla_page == vllm["block_size"] * 512
        seen.add((case["config"], case["kv_cache_dtype"]))
    assert len(seen) == 4  # full fp8, full fp8_e4m3, tiny fp8, the TP8 rank model fp8


def test_vllm_cpu_serves_a_rank_model_cut_with_the_planners_kv_tokens(tmp_path_factory):
    """vLLM CPU with the plugin builds the TP8 rank model's first four layers (dense MLPs, no MTP:
    the same KV layout, 0.6 GiB of random weights) and logs the KV tokens and block size the planner
    predicts for its 1 GiB of fp8 KV. (Generation is not asked for: this is about the allocation.)"""
    import re

    from glmctl.plan import ServingSetup, WeightFormats, cpu_node, plan_capacity
    from glmctl.testing.rank_config import build_rank_config
    from tests.vllm.plugin_servers import start_server

    root = tmp_path_factory.mktemp("rank-cut")
    info = build_rank_config(root / "rank", tp=8, num_layers=4, mtp_layers=0, dense_mlps=True)
    server = start_server(info.path, root / "vllm.log", "--load-format", "dummy", "--kv-cache-dtype", "fp8")
    try:
        log = server.log_text()
    finally:
        server.stop()
    tokens = re.search(r"CPU KV cache size: ([\d,]+) tokens", log)
    block = re.search(r"Setting attention block size to (\d+) tokens", log)
    assert tokens and block, log[-4000:]
    model = load_model_spec(info.path)
    plan = plan_capacity(model, cpu_node(1.0), ServingSetup(
        tensor_parallel_size=1, weights=WeightFormats.for_checkpoint(model.checkpoint_quant),
        kv_cache_dtype="fp8", max_model_len=4096))  # plugin_servers: 4,096 tokens, 1 GiB of KV
    assert (plan.setup.block_size, plan.kv_tokens) == (int(block.group(1)), int(tokens.group(1).replace(",", "")))
    assert plan.setup.block_size == 2048


_PARSE_RANK_CONFIGS = """
import json, sys
from vllm.plugins import load_general_plugins
load_general_plugins()  # the plugin registers glmctl_exl3 before vLLM reads the configs
from vllm.engine.arg_utils import EngineArgs
out = {}
for path in sys.argv[1:]:
    mc = EngineArgs(model=path, load_format="dummy", max_model_len=4096, kv_cache_dtype="fp8").create_model_config()
    t = mc.hf_text_config
    out[path] = dict(quantization=mc.quantization, architecture=mc.architecture, hybrid=mc.is_hybrid,
                     heads=t.num_attention_heads, kda_heads=t.linear_num_heads, moe=t.moe_intermediate_size,
                     dense=t.intermediate_size, vocab=t.vocab_size, experts=t.n_routed_experts,
                     indexer_heads=t.index_n_heads, layers=t.num_hidden_layers, mtp=t.num_nextn_predict_layers)
print("@@" + json.dumps(out))
"""


def test_vllm_reads_every_rank_config_variant(tmp_path_factory):
    """vLLM 0.30's own config parser (EngineArgs -> ModelConfig, the plugin loaded) accepts the full
    45-layer rank model in each variant, with the per-rank numbers and the quantization it names."""
    from glmctl.testing.rank_config import EXPERT_VARIANTS, build_rank_config
    from tests.vllm.subprocess_report import run_report

    root = tmp_path_factory.mktemp("rank-variants")
    paths = {v: str(build_rank_config(root / v, tp=8, experts=v).path) for v in EXPERT_VARIANTS}
    seen = run_report(["-c", _PARSE_RANK_CONFIGS, *paths.values()], timeout=300, no_torchvision=True)
    for variant, path in paths.items():
        got = seen[path]
        assert got.pop("quantization") == {"bf16": None, "fp8": "fp8", "exl3": "glmctl_exl3"}[variant]
        assert got == dict(architecture="Glm5NextForCausalLM", hybrid=True, heads=8, kda_heads=8, moe=256,
                           dense=1536, vocab=19_360, experts=288, indexer_heads=32, layers=45, mtp=1), variant
