"""Property tests: whatever options `glmctl plan` is given and whatever a config.json holds, the
answer is a plan (exit 0 or 1) or a sentence with exit 2, never an "unexpected error"; and a plan
that fits never shows a negative or zero capacity."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.cli_inproc import run_glmctl

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

ints = st.one_of(st.integers(-5, 5), st.integers(-(2**31), 2**31), st.sampled_from([0, 1, 2, 7, 8, 16, 64]))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 0.5, 0.92, 1.0, 1.5, -1.0]))
words = st.one_of(st.text(max_size=8), st.sampled_from(["bf16", "fp8", "exl3:4", "exl3:0", "mtp:3", "mtp:0",
                                                         "dflash2:2", "none", "auto", "fp8_ds_mla", "8xL40",
                                                         "0xL40", "8xH100", "1,2,4", "0,-1", "x"]))

OPTIONS = {
    "--tp": ints, "--num-gpus": ints, "--gpu-memory-gib": floats, "--kv-cache-gib": floats,
    "--max-model-len": ints, "--max-num-seqs": ints, "--max-num-batched-tokens": ints,
    "--gpu-memory-utilization": floats, "--block-size": ints, "--max-cudagraph-capture-size": ints,
    "--cudagraph-capture-sizes": words, "--gpus": words, "--kv-cache-dtype": words, "--speculative": words,
    "--experts": words, "--dense": words, "--kda": words, "--mla": words, "--embeddings": words,
}


def _check(run) -> None:
    assert run.code in (0, 1, 2), run.text
    assert "unexpected error" not in run.err, run.err
    if run.code == 0 and run.out.startswith("{"):
        plan = json.loads(run.out)
        assert plan["kv_tokens"] > 0 and plan["num_blocks"] > 0, plan
        assert plan["sessions_that_fit"] >= 0 and plan["setup"]["max_model_len"] > 0
        assert plan["setup"]["max_num_seqs"] > 0


@SETTINGS
@given(st.dictionaries(st.sampled_from(sorted(OPTIONS)), st.none(), max_size=5).flatmap(
    lambda keys: st.fixed_dictionaries({k: OPTIONS[k] for k in keys})), st.booleans())
def test_any_plan_options_give_a_plan_or_a_sentence(capsys, options, cpu):
    args = ["plan", "--json"] + (["--cpu"] if cpu else ["--gpus", "8xL40"])
    for flag, value in options.items():
        args += [flag, str(value)]
    _check(run_glmctl(capsys, *args))


@pytest.mark.parametrize(("flag", "value", "said"), [
    ("--max-model-len", "-1", "--max-model-len"),
    ("--max-model-len", "0", "--max-model-len"),
    ("--max-model-len", "2000000", "1,048,576"),
    ("--max-num-seqs", "-5", "--max-num-seqs"),
    ("--max-num-seqs", "0", "--max-num-seqs"),
    ("--tp", "0", "--tp"),
    ("--block-size", "0", "--block-size"),
    ("--gpu-memory-utilization", "1.5", "--gpu-memory-utilization"),
    ("--gpu-memory-utilization", "0", "--gpu-memory-utilization"),
    ("--gpu-memory-utilization", "nan", "--gpu-memory-utilization"),
    ("--max-num-batched-tokens", "0", "--max-num-batched-tokens"),
    ("--num-gpus", "0", "--num-gpus"),
    ("--kv-cache-gib", "-2", "--kv-cache-gib"),
])
def test_impossible_options_are_usage_errors(capsys, flag, value, said):
    run = run_glmctl(capsys, "plan", "--gpus", "8xL40", flag, value)
    assert run.code == 2, run.text
    assert said in run.err and "unexpected error" not in run.err


# -- config.json contents -------------------------------------------------------------------------

FIELDS = ["model_type", "num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads",
          "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_topk", "index_kpool",
          "index_head_dim", "index_n_heads", "linear_num_heads", "linear_head_dim", "n_routed_experts",
          "num_experts_per_tok", "moe_intermediate_size", "intermediate_size", "max_position_embeddings",
          "num_nextn_predict_layers", "hc_mult", "layer_types", "mlp_layer_types", "first_k_dense_replace",
          "text_config", "quantization_config", "tie_word_embeddings", "mhc", "linear_conv_kernel_dim"]
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=False, allow_infinity=False),
              st.sampled_from(["big", "glm5_next", "glm5_next_text", "linear_attention", "indexed_attention",
                               "fp8", "bf16", ""])),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(FIELDS + ["quant_method",
                                                                                                  "bits"]),
                                                                         inner, max_size=4)),
    max_leaves=8)


@SETTINGS
@given(st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6).map(lambda d: {"model_type": "glm5_next", **d}),
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6),
    json_values,
))
def test_any_config_json_gives_a_plan_or_a_sentence(capsys, tmp_path_factory, config):
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(json.dumps(config))
    _check(run_glmctl(capsys, "plan", "--model", path, "--cpu", "--json"))


@pytest.mark.parametrize("text", ["[1, 2, 3]", '{"model_type": "glm5_next", "hidden_size": "big"}', "not json",
                                  '{"model_type": "glm5_next", "num_hidden_layers": -3}', "null", '"text"'])
def test_a_config_json_that_is_not_a_model_is_a_config_error(capsys, tmp_path, text):
    path = tmp_path / "config.json"
    path.write_text(text)
    run = run_glmctl(capsys, "plan", "--model", path, "--cpu")
    assert run.code == 2 and str(path) in run.err and "unexpected error" not in run.err, run.err
