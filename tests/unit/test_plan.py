"""`glmctl plan` and glmctl.plan: page sizes, capacity rules, the report's five pools, CLI, imports.

The literal page sizes and token counts below are vLLM 0.30's own, as `tests/vllm/kv_oracle.py`
computes them with vLLM's code (tests/vllm/test_plan_vs_vllm.py checks the planner against it live).
"""

from __future__ import annotations

import json

import pytest

from glmctl.errors import ConfigError, UsageError
from glmctl.plan import (
    CapacityPlan,
    ServingSetup,
    Speculative,
    WeightFormats,
    gpu_node,
    kv_cache_layout,
    kv_capacity,
    load_model_spec,
    plan_capacity,
    sessions_that_fit,
)
from glmctl.plan.reserve import default_capture_sizes
from glmctl.plan.serving_setup import parse_speculative, parse_weight_format
from glmctl.plan.weights import matrix_bytes, weight_groups

GIB = 1 << 30


@pytest.fixture(scope="module")
def glm():
    return load_model_spec("glm-5.3-flash")


@pytest.fixture
def tiny_config(tmp_path):
    from glmctl.testing.tiny_checkpoint import TinySpec, hf_config

    path = tmp_path / "tiny" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(hf_config(TinySpec(), {"stop_token_ids": [1], "pad_token_id": 0})))
    return path.parent


def _setup(**kw) -> ServingSetup:
    kw.setdefault("weights", WeightFormats.for_checkpoint("fp8"))
    kw.setdefault("tensor_parallel_size", 8)
    return ServingSetup(**kw)


# --- the model -------------------------------------------------------------------------------


def test_preset_is_transformers_defaults(glm):
    assert (glm.num_hidden_layers, glm.hidden_size, glm.kv_lora_rank, glm.qk_rope_head_dim) == (45, 4096, 512, 0)
    assert glm.mla_layers == list(range(3, 45, 4)) and len(glm.kda_layers) == 34
    assert (glm.n_routed_experts, glm.num_experts_per_tok, glm.index_kpool, glm.index_topk) == (288, 8, 16, 2048)
    assert glm.defaulted == [] and glm.checkpoint_quant == "fp8"


def test_checkpoint_dir_and_nested_text_config(tiny_config, tmp_path):
    tiny = load_model_spec(tiny_config)
    assert tiny.mla_layers == [1, 2] and tiny.kda_layers == [0, 3] and tiny.defaulted == []
    nested = {"model_type": "glm5_next", "text_config": {"num_hidden_layers": 8, "hidden_size": 1024}}
    (tmp_path / "nested.json").write_text(json.dumps(nested))
    spec = load_model_spec(tmp_path / "nested.json")
    assert spec.hidden_size == 1024 and spec.mla_layers == [3, 7]
    assert "layer_types" in spec.defaulted and "kv_lora_rank" in spec.defaulted


def test_other_architectures_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="glm5_next"):
        load_model_spec(tmp_path)
    with pytest.raises(ConfigError, match="no model"):
        load_model_spec(tmp_path / "missing")


# --- vLLM's KV layout -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "plugin", "block", "mla_page", "idx_page", "tokens"),
    [  # GLM-5.3-Flash, TP 8, no drafter, prefix caching on, 3,463,600,000 bytes for KV
        ("auto", False, 1024, 1_048_576, 8_448, 293_799),
        ("bf16", False, 1024, 1_048_576, 8_448, 293_799),
        ("fp8", False, 1536, 786_432, 12_672, 573_804),
        ("fp8_ds_mla", False, 1536, 1_007_616, 12_672, 448_557),
        # glmctl's plugin reports a 1,024 block multiple (tail ring in one indexer page): 1,152 -> 2,048
        ("auto", True, 1024, 1_048_576, 8_448, 293_799),
        ("fp8", True, 2048, 1_048_576, 16_896, 564_470),
        ("fp8_ds_mla", True, 2048, 1_343_488, 16_896, 442_009),
    ],
)
def test_page_sizes_and_tokens_per_kv_dtype(glm, dtype, plugin, block, mla_page, idx_page, tokens):
    layout = kv_cache_layout(glm, tp=8, kv_cache_dtype=dtype, num_spec=0, mtp_layers=0, prefix_caching=True,
                             glmctl_plugin=plugin)
    assert (layout.block_size, layout.mla_page_bytes, layout.indexer_page_bytes) == (block, mla_page, idx_page)
    assert (layout.tail_page_bytes, layout.kda_state_bytes, layout.num_kda_groups) == (8_192, 542_720, 4)
    assert layout.error is None
    assert kv_capacity(layout, 3_463_600_000, 262_144).kv_tokens == tokens


def test_mtp_adds_a_layer_widens_conv_state_and_spec_blocks(glm):
    layout = kv_cache_layout(glm, tp=8, kv_cache_dtype="fp8", num_spec=3, mtp_layers=1, prefix_caching=True)
    assert (layout.num_mla_layers, layout.num_kda_groups, layout.kda_blocks_per_group) == (12, 3, 5)
    assert layout.kda_state_bytes == 561_152
    assert kv_capacity(layout, 3_463_600_000, 262_144).kv_tokens == 506_064
    no_prefix = kv_cache_layout(glm, tp=8, kv_cache_dtype="fp8", num_spec=3, mtp_layers=1, prefix_caching=False)
    assert no_prefix.kda_blocks_per_group == 4


def test_tiny_bf16_at_block_512_is_refused_like_vllm(tiny_config):
    tiny = load_model_spec(tiny_config)
    layout = kv_cache_layout(tiny, tp=1, kv_cache_dtype="auto", num_spec=0, mtp_layers=0, prefix_caching=False,
                             glmctl_plugin=False)
    assert layout.block_size == 512 and "--block-size 1024" in layout.error
    fixed = kv_cache_layout(tiny, tp=1, kv_cache_dtype="auto", num_spec=0, mtp_layers=0, prefix_caching=False,
                            user_block_size=1024, glmctl_plugin=False)
    assert fixed.error is None and kv_capacity(fixed, GIB, 8192).kv_tokens > 8192
    # glmctl's plugin picks that block size itself
    ours = kv_cache_layout(tiny, tp=1, kv_cache_dtype="auto", num_spec=0, mtp_layers=0, prefix_caching=False)
    assert ours.error is None and ours.block_size == 1024


def test_plugin_mtp_tail_ring_and_block_rule():
    """With MTP-3 the plugin's kpool tail ring holds kpool + 3 - 1 = 18 tokens (9,216 B at head
    dim 128); bf16 KV at TP8 then needs block 1536 (indexer page 12,672 B), stock vLLM uses 1024."""
    glm = load_model_spec("glm-5.3-flash")
    stock = kv_cache_layout(glm, tp=8, kv_cache_dtype="auto", num_spec=3, mtp_layers=1, prefix_caching=True,
                            glmctl_plugin=False)
    ours = kv_cache_layout(glm, tp=8, kv_cache_dtype="auto", num_spec=3, mtp_layers=1, prefix_caching=True)
    assert stock.tail_page_bytes == 2 * 16 * 128 * 2 and ours.tail_page_bytes == 2 * 18 * 128 * 2
    assert ours.error is None and ours.indexer_page_bytes >= ours.tail_page_bytes
    assert (stock.block_size, ours.block_size) == (1024, 1536)
    fp8 = kv_cache_layout(glm, tp=8, kv_cache_dtype="fp8", num_spec=3, mtp_layers=1, prefix_caching=True)
    fp8_stock = kv_cache_layout(glm, tp=8, kv_cache_dtype="fp8", num_spec=3, mtp_layers=1, prefix_caching=True,
                                glmctl_plugin=False)
    assert fp8.block_size == fp8_stock.block_size  # the shipped profiles' setup: unchanged


# --- capacity, sessions, does-not-fit --------------------------------------------------------


def test_sessions_rule_floors_and_caps_at_slots():
    assert sessions_that_fit(294_677, 262_144, 8) == 1
    assert sessions_that_fit(561_895, 262_144, 8) == 2
    assert sessions_that_fit(2_847_055, 262_144, 8) == 8  # 10.86 sessions, eight slots
    assert sessions_that_fit(262_143, 262_144, 8) == 0


def test_commercial_setup_fits_and_reports_every_part(glm):
    setup = _setup(weights=WeightFormats.for_checkpoint("fp8", experts="exl3:4", kda="fp8"), kv_cache_dtype="fp8",
                   speculative=Speculative(method="mtp", num_tokens=3), max_num_seqs=8, gpu_memory_utilization=0.97)
    plan = plan_capacity(glm, gpu_node("8xL40"), setup)
    assert plan.fits and plan.short_by_bytes is None and plan.sessions_that_fit == 8
    keys = {m.key for m in plan.memory}
    assert {"experts", "kda", "mla", "drafter", "topk_buffers", "cudagraphs", "kda_state", "kv_tokens"} <= keys
    # glmctl's indexer op reserves nothing in vLLM's profiling run; stock vLLM's reserves its workspace
    assert not keys & {"indexer_workspace", "indexer_logits"}
    stock = plan_capacity(glm, gpu_node("8xL40"), setup.model_copy(update={"glmctl_plugin": False}))
    stock_keys = {m.key: m.bytes for m in stock.memory}
    assert stock_keys["indexer_workspace"] == 40 * 262_144 * 132 + (1 << 20)
    assert stock_keys["indexer_logits"] == 512 << 20 and stock.kv_pool_bytes < plan.kv_pool_bytes
    parts = sum(m.bytes for m in plan.memory if m.section != "kv")
    assert parts + plan.kv_pool_bytes == plan.budget_bytes
    assert sum(m.bytes for m in plan.memory if m.section == "kv") == plan.kv_pool_bytes
    assert plan.kv_tokens == int(plan.num_blocks / plan.blocks_per_request * 262_144)


def test_does_not_fit_says_by_how_much(glm):
    plan = plan_capacity(glm, gpu_node("8xL40"), _setup())  # vLLM defaults: 0.92, 256 slots, bf16 KV
    assert not plan.fits and plan.kv_tokens == 0 and plan.sessions_that_fit == 0
    need = (plan.blocks_per_request + 1) * plan.kv_layout.bytes_per_block
    assert plan.short_by_bytes == need - plan.kv_pool_bytes
    assert plan.reason.startswith(f"does not fit: short by {plan.short_by_bytes / GIB:.2f} GiB per GPU")


def test_weight_formats_shrink_what_they_should(glm):
    def experts(fmt: str) -> int:
        return next(w.bytes for w in weight_groups(glm, 8, WeightFormats.for_checkpoint("fp8", experts=fmt))
                    if w.group == "experts")

    assert experts("fp8") == pytest.approx(35.45 * GIB, rel=1e-3)
    assert experts("bf16") == pytest.approx(2 * experts("fp8"), rel=1e-3)
    assert experts("exl3:4") == pytest.approx(experts("fp8") / 2, rel=0.02)
    fp8 = parse_weight_format("fp8")
    assert matrix_bytes(fp8, 256, 256) == 256 * 256 + 4 * 4
    assert matrix_bytes(parse_weight_format("exl3:4"), 256, 128) == 256 * 128 // 2 + 2 * (256 + 128)


def test_default_cudagraph_sizes_follow_vllm():
    assert default_capture_sizes(8, 1, 2048) == [1, 2, 4, 8, 16]
    assert default_capture_sizes(8, 4, 2048) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    sizes = default_capture_sizes(256, 1, 8192)
    assert sizes[-1] == 512 and 256 in sizes and 264 not in sizes and 272 in sizes
    assert default_capture_sizes(256, 1, 300)[-1] == 300  # capped by, and including, max_num_batched_tokens


# --- the report --------------------------------------------------------------------------------


def test_report_pools_reproduce_within_5_percent():
    from glmctl.plan.field_report import reproduce_report

    rep = reproduce_report()
    assert [r.reported_tokens for r in rep.rows] == [294_677, 561_895, 310_490, 382_472, 2_847_055]
    for row in rep.rows:
        assert abs(row.residual_pct) <= 5.0, row
        assert row.predicted_sessions == row.reported_sessions, row
    assert rep.max_abs_residual_pct <= 5.0


def test_report_utilization_is_the_fit_not_a_hand_tuned_number():
    from glmctl.plan.field_report import REPORT_GPU_MEMORY_UTILIZATION, fit_utilization

    assert fit_utilization() == REPORT_GPU_MEMORY_UTILIZATION


# --- options and the CLI ---------------------------------------------------------------------


def test_option_parsing_errors():
    with pytest.raises(UsageError, match="only served for the routed experts"):
        parse_weight_format("exl3:4", "kda")
    with pytest.raises(UsageError, match="--drafter"):
        parse_speculative("dflash2:5")
    with pytest.raises(UsageError):
        parse_speculative("eagle:3")
    assert str(parse_speculative("mtp:3")) == "mtp:3"
    with pytest.raises(UsageError, match="unknown GPU"):
        gpu_node("8xV100")
    assert gpu_node(num_gpus=8, gpu_memory_gib=44.4).device_memory_bytes == gpu_node("8xL40").device_memory_bytes


def test_cli_json_is_a_capacity_plan(run_cli):
    proc = run_cli("plan", "--gpus", "8xL40", "--kv-cache-dtype", "fp8", "--speculative", "mtp:3", "--kda", "fp8",
                   "--experts", "exl3:4", "--max-num-seqs", "8", "--gpu-memory-utilization", "0.97", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    plan = CapacityPlan.model_validate(data)
    assert plan.fits and plan.setup.weights["experts"] == "exl3:4" and plan.setup.speculative == "mtp:3"
    assert {"memory", "kv_per_token", "kv_tokens", "sessions_that_fit", "short_by_bytes", "node"} <= set(data)


def test_cli_does_not_fit_exits_1_after_printing(run_cli):
    proc = run_cli("plan", "--gpus", "8xL40", "--json")
    assert proc.returncode == 1
    assert json.loads(proc.stdout)["fits"] is False
    assert "does not fit: short by" in proc.stderr


@pytest.mark.parametrize(
    "args",
    [("--gpus", "8xL40", "--tp", "3"), ("--gpus", "8xQ9"), ("--gpus", "8xL40", "--kda", "exl3:4"),
     ("--gpus", "8xL40", "--speculative", "dflash2:3"), ("--gpus", "8xL40", "--kv-cache-dtype", "int3"), ()],
)
def test_cli_usage_errors_exit_2(run_cli, args):
    assert run_cli("plan", *args).returncode == 2


def test_cli_cpu_plan_of_the_tiny_checkpoint(run_cli, tiny_config):
    proc = run_cli("plan", "--model", str(tiny_config), "--cpu", "--block-size", "1024", "--json",
                   env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    layout = kv_cache_layout(load_model_spec(tiny_config), tp=1, kv_cache_dtype="auto", num_spec=0, mtp_layers=0,
                             prefix_caching=False, user_block_size=1024)
    assert data["node"]["platform"] == "cpu" and data["setup"]["block_size"] == 1024
    assert data["kv_tokens"] == kv_capacity(layout, GIB, data["setup"]["max_model_len"]).kv_tokens > 0


def test_cli_reproduce_report_prints_residuals(run_cli):
    proc = run_cli("plan", "--reproduce-report")
    assert proc.returncode == 0, proc.stderr
    for reported in ("294,677", "561,895", "310,490", "382,472", "2,847,055"):
        assert reported in proc.stdout
    assert "fitted" in proc.stdout and "GiB per GPU" in proc.stdout


def test_plan_imports_nothing_heavy():
    from tests.unit.test_cli import _imported_heavy

    assert _imported_heavy(["plan", "--model", "glm-5.3-flash", "--gpus", "8xL40", "--tp", "8"]) == []
    assert _imported_heavy(["plan", "--reproduce-report"]) == []


def test_glmctl_exl3_checkpoints_are_planned_with_their_bits(tmp_path):
    """`glmctl quantize exl3` writes quant_method glmctl_exl3; the planner reads its bits."""
    import json

    from glmctl.quantize.exl3_format import Exl3ExpertsSpec

    from glmctl.plan.model import load_model_spec
    from glmctl.plan.presets import PRESETS

    spec = Exl3ExpertsSpec(bits=3, modules=["model.layers.3.mlp.experts"])
    config = {**PRESETS["glm-5.3-flash"], "quantization_config": spec.to_config()}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_model_spec(tmp_path).checkpoint_quant == "exl3:3"


@pytest.mark.parametrize(("scaled", "families"), [
    ((), []),  # FP8 experts only: attention stays bf16
    (("model.layers.0.self_attn.q_proj",), ["kda"]),
    (("model.layers.0.self_attn.q_proj", "model.layers.3.self_attn.q_b_proj"), ["kda", "mla"]),
])
def test_fp8_attention_is_read_from_the_checkpoint_and_planned_as_fp8(tmp_path, scaled, families):
    """An FP8 checkpoint whose attention projections carry block scales (`glmctl quantize fp8`'s
    default) is planned with those families in FP8, as glmctl's plugin holds them; `--kda bf16`
    still overrides."""
    import json

    from glmctl.plan.model import load_model_spec
    from glmctl.plan.presets import PRESETS
    from glmctl.plan.serving_setup import WeightFormats
    from glmctl.plan.weights import weight_groups

    quant = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    (tmp_path / "config.json").write_text(json.dumps({**PRESETS["glm-5.3-flash"], "quantization_config": quant}))
    names = {f"{m}.{leaf}": "model-00001.safetensors" for m in scaled for leaf in ("weight", "weight_scale_inv")}
    names["model.layers.3.mlp.experts.0.up_proj.weight_scale_inv"] = "model-00001.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": names}))
    spec = load_model_spec(tmp_path)
    assert spec.fp8_attention == families
    formats = WeightFormats.for_checkpoint(spec.checkpoint_quant, spec.fp8_attention)
    assert [g for g in ("kda", "mla") if formats.model_dump()[g]["kind"] == "fp8"] == families
    bf16 = {g.group: g.bytes for g in weight_groups(spec, 8, WeightFormats.for_checkpoint("fp8"))}
    planned = {g.group: g.bytes for g in weight_groups(spec, 8, formats)}
    for family in ("kda", "mla"):
        assert (planned[family] < bf16[family]) == (family in families)
    forced = WeightFormats.for_checkpoint(spec.checkpoint_quant, spec.fp8_attention, kda="bf16")
    assert forced.kda.kind == "bf16"


def test_fp8_attention_of_a_converted_checkpoint(tiny_checkpoint, tmp_path):
    """The real converter's output (shard headers only, no index) and a BF16 source."""
    from pathlib import Path

    from glmctl.quantize.fp8_convert import convert_fp8
    from glmctl.quantize.fp8_plan import Fp8Settings

    from glmctl.plan.model import load_model_spec

    src = Path(tiny_checkpoint.path)
    assert load_model_spec(src).fp8_attention == []
    out = tmp_path / "fp8"
    convert_fp8(src, out, Fp8Settings())
    assert load_model_spec(out).fp8_attention == ["kda", "mla"]
    (out / "model.safetensors.index.json").unlink()  # then from the shard headers
    assert load_model_spec(out).fp8_attention == ["kda", "mla"]


def test_the_fp8_ds_mla_note_gives_the_layouts_bytes():
    from glmctl.kernels.layouts import FP8_DS_MLA_ROW_BYTES, FP8_ROW_BYTES

    from glmctl.plan import gpu_node, load_model_spec, plan_capacity

    plan = plan_capacity(load_model_spec("glm-5.3-flash"), gpu_node(num_gpus=8, gpu_memory_gib=44.4),
                         _setup(kv_cache_dtype="fp8_ds_mla"))
    assert any(f"stores {FP8_DS_MLA_ROW_BYTES} bytes per token" in n and n.endswith(f"stores {FP8_ROW_BYTES}")
               for n in plan.notes)
