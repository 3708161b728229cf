"""The tiny GLM-5.3-Flash checkpoint: transformers runs it, it is deterministic, complete, and usable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from glmctl.testing.tiny_checkpoint import SAFETENSORS_INDEX, TinySpec, build

SEQ = 300  # > index_topk + index_kpool: the indexer must drop pools at the last positions


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def hf(tiny_checkpoint):
    from tests.hf_reference import load_transformers_model

    return load_transformers_model(tiny_checkpoint.path)


def test_transformers_forward_gives_finite_logits_and_sparse_selection(tiny_checkpoint, hf):
    import torch

    spec = tiny_checkpoint.spec
    text = hf.model.model.language_model
    captured = {}
    full, shared = text.layers[1].self_attn, text.layers[2].self_attn
    assert full.indexer is not None and shared.indexer is None and shared.skip_topk

    def grab(module, args, output):
        captured["topk"] = output

    handle = full.indexer.register_forward_hook(grab)
    ids = torch.randint(len(tiny_checkpoint.special_token_ids), spec.vocab_size, (1, SEQ),
                        generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            logits = hf.model(input_ids=ids).logits
    finally:
        handle.remove()
    assert logits.shape == (1, SEQ, spec.vocab_size)
    assert torch.isfinite(logits).all()
    assert logits[0, -1].std() > 0.5  # not a flat distribution: greedy picks are meaningful

    selected = (captured["topk"][0] >= 0).sum(-1)  # tokens each query attends to
    assert selected[40].item() == 41  # short prefix: everything visible is kept
    # Long prefix: top-k tokens in whole pools plus the incomplete tail pool, not all 300.
    assert selected[-1].item() == spec.index_topk + SEQ % spec.index_kpool


def test_transformers_ignores_only_the_mtp_layer_and_shared_indexer_weights(tiny_checkpoint, hf):
    spec = tiny_checkpoint.spec
    mtp = f"model.language_model.layers.{spec.layers}."
    shared = [i for i, t in enumerate(spec.indexer_types()) if t == "shared"]
    for key in hf.unused_checkpoint_keys:
        assert key.startswith(mtp) or any(
            key.startswith(f"model.language_model.layers.{i}.self_attn.indexer.") for i in shared
        ), key
    assert any(k.startswith(mtp) for k in hf.unused_checkpoint_keys)


def test_every_file_has_the_same_ordinary_mode(tiny_checkpoint):
    modes = {f.name: f.stat().st_mode & 0o777 for f in tiny_checkpoint.path.iterdir() if f.is_file()}
    assert len(set(modes.values())) == 1, modes  # shards are not 0600 while the rest is 0644
    assert modes["config.json"] & 0o400


def test_config_declares_the_real_architecture(tiny_checkpoint):
    c = json.loads((tiny_checkpoint.path / "config.json").read_text())
    assert c["model_type"] == "glm5_next" and c["architectures"] == ["Glm5NextForCausalLM"]
    assert set(c["layer_types"]) == {"linear_attention", "indexed_attention"}
    assert set(c["indexer_types"]) == {"full", "shared"}
    assert c["mlp_layer_types"][0] == "dense" and "sparse" in c["mlp_layer_types"]
    assert c["kv_lora_rank"] == 512 and c["qk_rope_head_dim"] == 0 and c["index_head_dim"] == 128
    assert c["max_position_embeddings"] > c["index_topk"] + c["index_kpool"]
    assert c["num_nextn_predict_layers"] == 1 and c["mhc"] and c["n_shared_experts"] == 1


def test_index_is_complete_and_matches_the_shards(tiny_checkpoint):
    from safetensors import safe_open

    path = tiny_checkpoint.path
    index = json.loads((path / SAFETENSORS_INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2
    assert sorted(p.name for p in path.glob("*.safetensors")) == shards
    seen, total = {}, 0
    for shard in shards:
        with safe_open(str(path / shard), "pt") as f:
            for name in f.keys():
                seen[name] = shard
                t = f.get_tensor(name)
                total += t.numel() * t.element_size()
    assert seen == index["weight_map"]
    assert index["metadata"]["total_size"] == total
    assert len(seen) == tiny_checkpoint.num_tensors


def test_same_seed_gives_identical_bytes_and_another_seed_other_weights(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file

    again = build(tmp_path / "again", seed=0)
    assert _files(again.path) == _files(tiny_checkpoint.path)

    other = build(tmp_path / "other", seed=1)
    a, b = _files(tiny_checkpoint.path), _files(other.path)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", SAFETENSORS_INDEX):
        assert a[name] == b[name]
    shard = "model-00001-of-00003.safetensors"
    wa, wb = load_file(tiny_checkpoint.path / shard), load_file(other.path / shard)
    assert wa.keys() == wb.keys()
    assert not (wa["model.embed_tokens.weight"] == wb["model.embed_tokens.weight"]).all()


def test_layers_override_keeps_existing_tensors(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file

    bigger = build(tmp_path / "six", seed=0, layers=6, mtp_layers=0)
    c = json.loads((bigger.path / "config.json").read_text())
    assert c["num_hidden_layers"] == 6 and c["num_nextn_predict_layers"] == 0
    assert not any(".layers.6." in n for n in json.loads((bigger.path / SAFETENSORS_INDEX).read_text())["weight_map"])
    a = load_file(tiny_checkpoint.path / "model-00001-of-00003.safetensors")
    b = load_file(bigger.path / "model-00001-of-00002.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    assert (a[name] == b[name]).all()


def test_tokenizer_round_trips_and_has_the_chat_format(tiny_checkpoint):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint.path)
    text = 'def f(x):\n    return {"k": x ** 2}  # naïve → ünïcode, 中文\n'
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert max(ids) < tiny_checkpoint.spec.vocab_size
    for token, token_id in tiny_checkpoint.special_token_ids.items():
        assert tok.convert_tokens_to_ids(token) == token_id
        assert tok.encode(token, add_special_tokens=False) == [token_id]
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token_id is not None

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "tool", "content": "42"},
                {"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == ("[gMASK]<sop><|system|>\nBe brief.<|user|>\nHi<|assistant|>\nHello."
                        "<|observation|>\n42<|user|>\nAB<|assistant|>\n")


def test_spec_rejects_what_vllm_would_reject():
    from glmctl.errors import UsageError

    for bad in ({"index_kpool": 1}, {"index_topk": 100}, {"layers": 1}, {"kv_lora_rank": 256},
                {"max_position_embeddings": 64}):
        with pytest.raises(UsageError):
            TinySpec(**bad).validate()


def test_cli_refuses_a_non_empty_dir_without_force(run_cli, tmp_path):
    (tmp_path / "keep.txt").write_text("precious")
    proc = run_cli("testing", "tiny-checkpoint", str(tmp_path))
    assert proc.returncode == 2
    assert "not empty" in proc.stderr and "--force" in proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_cli_json_reports_what_it_wrote(run_cli, tmp_path):
    target = tmp_path / "ckpt"
    proc = run_cli("testing", "tiny-checkpoint", str(target), "--json", "--seed", "3", "--layers", "2")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["seed"] == 3 and report["layer_types"] == ["linear_attention", "indexed_attention"]
    assert report["files"] == {p.name: p.stat().st_size for p in sorted(target.iterdir())}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left behind
