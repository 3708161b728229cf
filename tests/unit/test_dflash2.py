"""The DFlash2 pieces that need no vLLM: the drafter's KV placement rules (plugin and planner), the
planner's accounting with a drafter, the V1 selector walk, the CPU input kernel and the tiny drafter."""

from __future__ import annotations

import json

import pytest

from glmctl.plan import (
    ServingSetup,
    WeightFormats,
    cpu_node,
    gpu_node,
    load_model_spec,
    plan_capacity,
)
from glmctl.plan.drafter_kv import capacity_with_drafter, draft_page_bytes, drafter_kv
from glmctl.plan.serving_setup import DrafterSpec, Speculative
from glmctl.plugin.spec_decode.dflash2_layout import (
    PoolShape,
    alias_placement,
    append_placement,
    choose,
    pack_alias,
)

POOL = PoolShape(block_size=1536, num_mla_slots=2, mla_page=1536 * 1024, num_idx_slots=2, idx_page=12_672,
                 attention_blocks=3, other_blocks=7)  # the tiny checkpoint on vLLM CPU, max_model_len 4096


def test_alias_packs_draft_pages_first_fit_into_mla_pages():
    half = POOL.mla_page // 2
    slots = pack_alias(POOL, [half, half, half])
    assert [(s.slot, s.offset) for s in slots] == [(0, 0), (0, half), (1, 0)]
    assert pack_alias(POOL, [POOL.mla_page + 1]) is None  # a page larger than an MLA page
    assert pack_alias(POOL, [half] * 5) is None  # more than the block's MLA pages hold
    # larger pages go first, so a big page is not left without room
    big, small = int(POOL.mla_page * 0.75), POOL.mla_page // 4
    assert pack_alias(POOL, [small, small, big, big]) is not None


def test_placements_cost_what_vllm_allocates():
    pages = [POOL.mla_page // 2] * 2
    alias = alias_placement(POOL, pages, draft_blocks=3)
    append = append_placement(POOL, pages)
    assert alias.block_bytes == POOL.block_bytes and alias.blocks_per_request == 3 + 7 + 3
    assert append.block_bytes == POOL.block_bytes + sum(pages) and append.blocks_per_request == 10
    # vLLM's figures for the tiny pair at 1 GiB (tests/vllm/test_plugin_dflash2.py measures them)
    assert alias.kv_tokens(1 << 30, 4096) == 106_496
    assert append.kv_tokens(1 << 30, 4096) == 92_569


def test_choose_takes_the_placement_with_more_tokens_and_honours_the_switch():
    big = [POOL.mla_page // 2] * 2  # 1024 B/token of draft K/V against 2064.5 of target: alias wins
    assert choose(POOL, big, 3).mode == "alias"
    small = [POOL.mla_page // 8] * 2  # 256 B/token: appending costs less than a block per 1536 tokens
    assert choose(POOL, small, 3).mode == "append"
    assert choose(POOL, small, 3, forced="alias").mode == "alias"
    assert choose(POOL, big, 3, forced="append").mode == "append"
    assert choose(POOL, [POOL.mla_page * 2], 3).mode == "append"  # does not fit an MLA page
    assert choose(POOL, small, 3, sliding_window=True).mode == "alias"  # only its own group frees blocks
    with pytest.raises(ValueError, match="GLMCTL_DFLASH2_KV=alias"):
        choose(POOL, [POOL.mla_page * 2], 3, forced="alias")


def test_requested_placement_reads_the_switch(monkeypatch):
    from glmctl.plugin.spec_decode.dflash2_layout import requested_placement

    monkeypatch.delenv("GLMCTL_DFLASH2_KV", raising=False)
    assert requested_placement() is None
    monkeypatch.setenv("GLMCTL_DFLASH2_KV", "Append")
    assert requested_placement() == "append"
    monkeypatch.setenv("GLMCTL_DFLASH2_KV", "mirror")
    with pytest.raises(ValueError, match="auto, alias, append"):
        requested_placement()


DRAFTER = DrafterSpec(source="test", num_hidden_layers=5, hidden_size=4096, intermediate_size=12288,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128)


def test_draft_page_follows_vllms_full_attention_spec():
    # K and V, KV heads split over TP (at least one per GPU), cache dtype bytes
    assert draft_page_bytes(DRAFTER, 1, "auto", 64) == 64 * 2 * 8 * 128 * 2
    assert draft_page_bytes(DRAFTER, 8, "fp8", 64) == 64 * 2 * 1 * 128 * 1
    assert draft_page_bytes(DRAFTER, 16, "bfloat16", 64) == 64 * 2 * 1 * 128 * 2


def _plan(spec: Speculative, **kw):
    model = load_model_spec("glm-5.3-flash")
    setup = ServingSetup(tensor_parallel_size=8, kv_cache_dtype="fp8", max_num_seqs=8, speculative=spec,
                         weights=WeightFormats.for_checkpoint(model.checkpoint_quant, experts="exl3:4"), **kw)
    return plan_capacity(model, gpu_node("8xL40"), setup)


def test_plan_counts_the_drafter_kv_at_real_shapes():
    without = _plan(Speculative(method="mtp", num_tokens=5))
    plan = _plan(Speculative(method="dflash2", num_tokens=5, drafter=DRAFTER))
    assert plan.fits and plan.drafter_kv is not None
    d = plan.drafter_kv
    assert d.page_bytes == draft_page_bytes(DRAFTER, 8, "fp8", plan.setup.block_size)
    assert d.bytes_per_token == 5 * 2 * 1 * 128
    assert plan.num_blocks * d.block_bytes <= plan.kv_pool_bytes
    assert plan.kv_tokens == int(plan.num_blocks / d.blocks_per_request * plan.setup.max_model_len)
    assert any(line.key == "drafter_kv" for line in plan.memory)
    assert any(k.key == "drafter" for k in plan.kv_per_token)
    assert any("DFlash2 drafter K/V" in note for note in plan.notes)
    # both placements are real layouts; the plan takes the one with more tokens
    tokens = {}
    for placement in ("alias", "append"):
        other = drafter_kv(plan.kv_layout, DRAFTER, 8, plan.setup.max_model_len, forced=placement)
        tokens[placement] = capacity_with_drafter(other, plan.kv_pool_bytes, plan.setup.max_model_len).kv_tokens
    assert plan.kv_tokens == max(tokens.values()) and tokens[d.placement] == plan.kv_tokens
    assert without.kv_tokens > plan.kv_tokens  # the drafter's K/V costs tokens


def test_plan_cli_counts_the_drafter(run_cli, tmp_path):
    drafter = tmp_path / "config.json"
    drafter.write_text(json.dumps({"num_hidden_layers": 5, "hidden_size": 4096, "intermediate_size": 12288,
                                   "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}))
    proc = run_cli("plan", "--gpus", "8xL40", "--kv-cache-dtype", "fp8", "--experts", "exl3:4", "--speculative", "dflash2:5",
                   "--drafter", str(drafter), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["drafter_kv"]["placement"] in ("alias", "append") and doc["drafter_kv"]["num_layers"] == 5
    assert doc["setup"]["speculative"] == "dflash2:5"


def test_plan_on_cpu_with_the_tiny_drafter_shape(monkeypatch, tmp_path):
    """The tiny pair on vLLM CPU (2 MLA layers, block 1536 under 5 drafts): vLLM's figures, both
    placements (tests/vllm/test_plugin_dflash2.py measures them)."""
    from glmctl.testing.tiny_checkpoint import TinySpec, hf_config

    config = tmp_path / "config.json"
    config.write_text(json.dumps(hf_config(TinySpec(), {"stop_token_ids": [0], "pad_token_id": 0})))
    model = load_model_spec(config)
    drafter = DrafterSpec(source="test", num_hidden_layers=2, hidden_size=256, intermediate_size=512,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    setup = ServingSetup(weights=WeightFormats.for_checkpoint("bf16"), max_model_len=4096, block_size=16,
                         enable_prefix_caching=False,
                         speculative=Speculative(method="dflash2", num_tokens=5, drafter=drafter))
    for placement, tokens in (("alias", 106_496), ("append", 92_569)):
        monkeypatch.setenv("GLMCTL_DFLASH2_KV", placement)
        plan = plan_capacity(model, cpu_node(1.0), setup)
        assert plan.setup.block_size == 1536 and plan.drafter_kv.placement == placement
        assert plan.kv_tokens == tokens


# -- torch pieces ------------------------------------------------------------------------------


def test_selector_walk_follows_the_best_successor_of_each_choice():
    torch = pytest.importorskip("torch")
    from glmctl.plugin.spec_decode.dflash2 import selector_walk

    gen = torch.Generator().manual_seed(0)
    reqs, steps, k = 3, 5, 4
    candidates = torch.randint(0, 1000, (reqs, steps, k), generator=gen)
    scores = torch.randn(reqs, steps, k, k, generator=gen)
    got = selector_walk(candidates, scores)
    for r in range(reqs):
        previous, want = 0, []
        for s in range(steps):
            row = scores[r, s, previous].tolist()
            choice = row.index(max(row))
            want.append(int(candidates[r, s, choice]))
            previous = choice
        assert got[r].tolist() == want


def test_dflash_inputs_match_the_kernels_semantics():
    torch = pytest.importorskip("torch")
    from glmctl.plugin.platforms.cpu.dflash2_cpu import copy_and_expand_dflash_inputs

    block, q = 4, 3  # 1 + 2 drafts
    # two requests: 5 context tokens at positions 10..14 (the last one rejected), 2 at 3..4
    positions = torch.tensor([10, 11, 12, 13, 14, 3, 4])
    qsl = torch.tensor([0, 5, 7], dtype=torch.int32)
    table = torch.tensor([[7, 8, 9, 2, 5], [6, 1, 0, 0, 0]], dtype=torch.int32)
    out = {name: torch.full((16,), -1, dtype=torch.int64) for name in
           ("ctx_pos", "q_pos", "ctx_slot", "q_slot")}
    ids = torch.full((16,), -1, dtype=torch.int32)
    sample = torch.full((4,), -1, dtype=torch.int32)
    copy_and_expand_dflash_inputs(
        next_token_ids_ptr=torch.tensor([100, 200], dtype=torch.int32), target_positions_ptr=positions,
        out_input_ids_ptr=ids, out_context_positions_ptr=out["ctx_pos"], out_query_positions_ptr=out["q_pos"],
        out_context_slot_mapping_ptr=out["ctx_slot"], out_query_slot_mapping_ptr=out["q_slot"],
        out_token_indices_ptr=sample, block_table_ptr=table, query_start_loc_ptr=qsl,
        num_rejected_tokens_ptr=torch.tensor([1, 0], dtype=torch.int32), block_table_stride=5,
        parallel_drafting_token_id=9, block_size=block, num_query_per_req=q, num_speculative_tokens=q - 1,
        total_input_tokens=7, has_num_rejected=True, max_tokens_per_req=8, triton_block_size=8)

    def slot(req, pos):
        return int(table[req, min(pos // block, 4)]) * block + pos % block

    assert out["ctx_pos"][:7].tolist() == positions.tolist()
    assert out["ctx_slot"][:7].tolist() == [slot(0, p) for p in (10, 11, 12, 13, 14)] + [slot(1, 3), slot(1, 4)]
    # request 0 continues after its last accepted position (13), request 1 after 4
    assert out["q_pos"][:6].tolist() == [14, 15, 16, 5, 6, 7]
    assert out["q_slot"][:6].tolist() == [slot(0, 14), slot(0, 15), slot(0, 16), slot(1, 5), slot(1, 6), slot(1, 7)]
    assert ids[:6].tolist() == [100, 9, 9, 200, 9, 9]
    assert sample.tolist() == [1, 2, 4, 5]


def test_tiny_drafter_is_sized_for_its_target(tiny_checkpoint, tmp_path):
    pytest.importorskip("safetensors")
    from safetensors import safe_open

    from glmctl.plan.serving_setup import load_drafter
    from glmctl.testing.tiny_drafter import build

    info = build(tmp_path / "d", tiny_checkpoint.path, seed=0)
    config = json.loads((info.path / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["model_type"] == "qwen3"
    assert config["hidden_size"] == tiny_checkpoint.config["hidden_size"]
    assert config["vocab_size"] == tiny_checkpoint.config["vocab_size"]
    d = config["dflash_config"]
    assert d["mask_token_id"] == tiny_checkpoint.special_token_ids["[MASK]"]
    assert d["target_layer_ids"] == [0, 2]
    assert {"conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"} <= set(d)
    with safe_open(str(info.path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        fc = f.get_tensor("fc.weight")
    assert fc.shape == (256, 2 * 256)  # two target layers' hidden states into the drafter's width
    assert "candidate_selector.predecessor_codebook" in names and "layers.1.mlp_conv.base_kernel" in names
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)  # shared with the target
    assert (info.path / "tokenizer.json").read_bytes() == (tiny_checkpoint.path / "tokenizer.json").read_bytes()
    spec = load_drafter(info.path)
    assert (spec.num_hidden_layers, spec.num_key_value_heads, spec.head_dim) == (2, 2, 64)
    # deterministic
    again = build(tmp_path / "d2", tiny_checkpoint.path, seed=0)
    assert (again.path / "model.safetensors").read_bytes() == (info.path / "model.safetensors").read_bytes()


def test_tiny_drafter_cli_refuses_a_bad_target(run_cli, tmp_path):
    proc = run_cli("testing", "tiny-drafter", str(tmp_path / "d"), "--target", str(tmp_path / "nothing"))
    assert proc.returncode == 2 and "--target" in proc.stderr
