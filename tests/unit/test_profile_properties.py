"""Property test: whatever a profile YAML holds, loading, showing, rendering and validating it give
a profile or a sentence (ConfigError, exit 2), never an "unexpected error"."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from glmctl import paths
from glmctl.errors import GlmctlError
from glmctl.serving import launch_files, profiles
from glmctl.serving.validation import validate, with_placeholders
from tests.unit.cli_inproc import run_glmctl

SETTINGS = settings(max_examples=80, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

KEYS = ["extends", "usage", "platform", "model", "speculative", "kv_cache_dtype", "tensor_parallel_size",
        "max_num_seqs", "max_model_len", "max_num_batched_tokens", "gpu_memory_utilization",
        "cuda_graph_max_tokens", "collectives", "hardware", "env", "vllm_args", "description", "name"]
SUBKEYS = ["path", "served_name", "weights", "licenses", "method", "tokens", "drafter", "mode",
           "int8_prefill_all_reduce", "gpus", "min_compute_capability", "min_gpu_memory_gib", "HF_TOKEN",
           "api-key", "max_logprobs", "enforce-eager", "compilation-config", "max_cudagraph_capture_size",
           "not-a-flag", "NCCL_P2P_DISABLE", "GLMCTL_COLLECTIVES", "1BAD"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 70_000), st.floats(allow_nan=True),
                    st.sampled_from(["commercial", "noncommercial", "cuda", "cpu", "mtp", "dflash2", "none", "fp8",
                                     "exl3", "host-staged", "vllm", "tiny-cpu", "commercial", "8.9", "/x", ""]),
                    st.text(max_size=6))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(st.sampled_from(SUBKEYS), inner, max_size=4)),
                      max_leaves=10)
overrides = st.dictionaries(st.sampled_from([k for k in KEYS if k not in ("extends", "name")]), values, max_size=3)
documents = st.one_of(
    overrides.map(lambda d: {"extends": "tiny-cpu", **d}),  # mostly valid: reaches render and validate
    overrides.map(lambda d: {"extends": "commercial", **d}),
    st.dictionaries(st.sampled_from(KEYS), values, max_size=7),
    values,
)


@SETTINGS
@given(documents)
def test_any_profile_yaml_gives_a_profile_or_a_sentence(capsys, document):
    root = paths.user_profiles()
    root.mkdir(parents=True, exist_ok=True)
    (root / "prop.yaml").write_text(yaml.safe_dump(document))
    try:
        prof = profiles.load("prop")
    except GlmctlError as exc:
        assert exc.exit_code == 2 and exc.message
        return
    try:
        launch_files.render(with_placeholders(prof))
    except GlmctlError as exc:
        assert exc.exit_code == 2
    report = validate("prop", use_vllm=False)
    assert report.valid == (not report.errors)
    run = run_glmctl(capsys, "profile", "show", "prop", "--json")
    assert run.code == 0 and "unexpected error" not in run.err, run.err


@pytest.mark.parametrize("text", ["- a\n- b\n", "usage: [commercial]\n", "42\n", "extends: 7\n", "{{{\n",
                                  "usage: commercial\nmax_num_seqs: .nan\nmax_model_len: 64\n"])
def test_malformed_profiles_are_config_errors_on_the_cli(capsys, text):
    root = paths.user_profiles()
    root.mkdir(parents=True, exist_ok=True)
    (root / "broken.yaml").write_text(text)
    for args in (("profile", "show", "broken"), ("profile", "validate", "broken", "--no-vllm"),
                 ("profile", "render", "broken", "--model", "/tmp"), ("serve", "--profile", "broken", "--dry-run")):
        run = run_glmctl(capsys, *args)
        assert run.code == 2 and "unexpected error" not in run.err, (args, run.text)
