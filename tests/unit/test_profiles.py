"""Serving profiles: the shipped four say what the report says, the schema is strict, `extends`
merges as documented, and rendering gives exactly what `vllm serve --config` reads."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from glmctl import paths
from glmctl.errors import ConfigError
from glmctl.serving import launch_files, profiles


def _user_profile(name: str, text: str) -> None:
    root = paths.user_profiles()
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{name}.yaml").write_text(text)


def _rendered(name: str, **paths_):
    prof = launch_files.with_paths(profiles.load(name), **paths_)
    return launch_files.render(prof)


def test_shipped_profiles_are_the_four_and_all_valid():
    rows = {r.name: r for r in profiles.summaries()}
    assert set(rows) == {"commercial", "noncommercial", "latency", "tiny-cpu"}
    assert all(r.error is None and r.origin == "shipped" for r in rows.values())


def test_commercial_renders_the_reports_commercial_stack(tmp_path):
    launch = _rendered("commercial", model=tmp_path)
    c = launch.config
    assert c["model"] == str(tmp_path.absolute())
    assert c["tensor-parallel-size"] == 8 and c["max-num-seqs"] == 8 and c["max-model-len"] == 262144
    assert c["kv-cache-dtype"] == "fp8"
    assert c["speculative-config"] == {"method": "mtp", "num_speculative_tokens": 3,
                                       "use_local_argmax_reduction": True}
    assert c["compilation-config"] == {"max_cudagraph_capture_size": 48}
    assert c["enable-chunked-prefill"] is True and c["max-num-batched-tokens"] > 0
    assert c["disable-custom-all-reduce"] is True
    assert launch.env == {
        "NCCL_P2P_DISABLE": "1",
        "GLMCTL_COLLECTIVES": "host-staged",
        "GLMCTL_COLLECTIVES_INT8": "prefill",
    }
    prof = launch.profile
    assert prof.usage == "commercial" and prof.model.weights == "exl3"
    assert prof.model.licenses == ["shapleymcg-1.0", "glm-5.3-flash-model-license"]
    assert prof.hardware.gpus == 8 and prof.hardware.min_compute_capability == "8.0"
    assert [lic.id for lic in launch.notices] == ["shapleymcg-1.0", "glm-5.3-flash-model-license"]
    assert "ShapleyMcg (Brandon M. Music)" in launch.config_yaml()  # the notice is kept
    assert prof.advisories() == []


def test_noncommercial_is_commercial_with_the_dflash2_drafter(tmp_path):
    launch = _rendered("noncommercial", model=tmp_path / "m", drafter=tmp_path / "d")
    commercial = _rendered("commercial", model=tmp_path / "m")
    assert launch.profile.usage == "noncommercial"
    assert launch.config.pop("speculative-config") == {
        "method": "dflash", "model": str((tmp_path / "d").absolute()), "num_speculative_tokens": 5,
    }
    commercial.config.pop("speculative-config")
    assert launch.config == commercial.config and launch.env == commercial.env
    assert "dflash2-cc-by-nc-nd-4.0" in [lic.id for lic in launch.notices]
    assert launch.profile.advisories() == []  # 8 x (1 + 5) = 48 = the CUDA-graph limit


def test_noncommercial_needs_its_drafter_path(tmp_path):
    with pytest.raises(ConfigError, match="--drafter"):
        _rendered("noncommercial", model=tmp_path)


def test_latency_is_fp8_without_speculation_and_fewer_slots(tmp_path):
    launch = _rendered("latency", model=tmp_path)
    assert launch.profile.model.weights == "fp8"
    assert launch.config["kv-cache-dtype"] == "fp8"
    assert "speculative-config" not in launch.config
    assert launch.config["max-num-seqs"] < 8


def test_tiny_cpu_is_the_cpu_demo_setup(tmp_path):
    launch = _rendered("tiny-cpu", model=tmp_path)
    c = launch.config
    assert launch.profile.platform == "cpu" and launch.profile.usage == "commercial"
    assert c["dtype"] == "bfloat16" and c["enforce-eager"] is True and c["max-model-len"] == 8192
    assert launch.env == {"VLLM_CPU_KVCACHE_SPACE": "1"}  # no GPU collectives, no licences
    assert launch.notices == []


def test_a_profile_without_a_model_path_says_to_pass_model():
    with pytest.raises(ConfigError, match="--model"):
        launch_files.render(profiles.load("commercial"))


def test_unknown_profile_names_the_known_ones():
    with pytest.raises(ConfigError) as err:
        profiles.load("nope")
    assert "commercial" in err.value.hint and "tiny-cpu" in err.value.hint


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("usage: commercial\nmax_num_seqs: 1\nmax_model_len: 64\nmax_num_seq: 2\n", "max_num_seq: not a profile setting"),
        ("extends: tiny-cpu\nvllm_args:\n  max-model-len: 10\n", "set max_model_len instead"),
        ("extends: tiny-cpu\nvllm_args:\n  speculative_config: {}\n", "set speculative instead"),
        ("extends: tiny-cpu\nenv:\n  NCCL_P2P_DISABLE: true\n", 'give a string such as "1"'),
        ("extends: tiny-cpu\nhardware:\n  gpus: 8\n", "platform 'cpu' has no GPUs"),
        ("extends: commercial\nspeculative:\n  method: mtp\n", "needs `tokens`"),
        ("extends: commercial\ncollectives:\n  mode: vllm\n", "int8_prefill_all_reduce needs mode 'host-staged'"),
        ("extends: commercial\ncuda_graph_max_tokens: 0\n", "cuda_graph_max_tokens"),
        ("extends: commercial\nvllm_args:\n  compilation-config:\n    cudagraph_capture_sizes: [1]\n",
         "clashes with cuda_graph_max_tokens"),
        ("name: x\nextends: commercial\n", "sets `name`"),
        ("extends: [a]\n", "`extends` must be a profile name"),
        ("usage: commercial\n- a list\n", "not valid YAML"),
    ],
)
def test_schema_errors_name_the_field_and_the_fix(text, expected):
    _user_profile("bad", text)
    with pytest.raises(ConfigError) as err:
        profiles.load("bad")
    assert expected in err.value.message


def test_vllm_arg_names_are_normalised_to_flag_spelling():
    _user_profile("mine", "extends: tiny-cpu\nvllm_args:\n  --max_logprobs: 5\n  disable_log_stats: true\n")
    args = profiles.load("mine").vllm_args
    assert args["max-logprobs"] == 5 and args["disable-log-stats"] is True
    assert "max_logprobs" not in args


def test_extends_merges_and_null_removes():
    _user_profile("base", "extends: tiny-cpu\nvllm_args:\n  kernel-config:\n    enable_jit_warmup: false\n")
    _user_profile("mine", "extends: base\ndescription: mine\nvllm_args:\n  enforce-eager: null\n  max-logprobs: 3\n"
                          "  kernel-config:\n    moe_backend: auto\n")
    prof = profiles.load("mine")
    shipped = profiles.load("tiny-cpu")
    assert prof.extends == "base" and prof.description == "mine"
    assert "enforce-eager" not in prof.vllm_args and prof.vllm_args["max-logprobs"] == 3
    assert prof.vllm_args["kernel-config"] == {"enable_jit_warmup": False, "moe_backend": "auto"}
    assert prof.env == shipped.env and prof.max_model_len == shipped.max_model_len


def test_a_new_speculative_method_replaces_the_whole_block():
    _user_profile("plain", "extends: commercial\nspeculative:\n  method: none\n")
    assert profiles.load("plain").speculative.method == "none"  # tokens: 3 is not carried over
    _user_profile("drafted", "extends: noncommercial\nspeculative:\n  drafter:\n    path: /models/d\n")
    spec = profiles.load("drafted").speculative  # no method: keys merge into the parent's block
    assert spec.method == "dflash2" and spec.tokens == 5 and str(spec.drafter.path) == "/models/d"
    assert spec.drafter.licenses == ["dflash2-cc-by-nc-nd-4.0"]


def test_a_user_profile_shadows_and_can_extend_the_shipped_one_of_its_name():
    _user_profile("commercial", "extends: commercial\nmax_num_seqs: 4\n")
    prof = profiles.load("commercial")
    assert prof.max_num_seqs == 4 and prof.speculative.tokens == 3
    [row] = [r for r in profiles.summaries() if r.name == "commercial"]
    assert row.origin == "user"


def test_extends_loops_are_reported():
    _user_profile("a", "extends: b\n")
    _user_profile("b", "extends: a\n")
    with pytest.raises(ConfigError, match="loops"):
        profiles.load("a")


def test_written_files_are_what_vllm_and_a_shell_read(tmp_path):
    launch = _rendered("commercial", model=tmp_path / "ckpt")
    files = launch_files.write(launch, tmp_path / "out")
    assert yaml.safe_load(files.config.read_text()) == launch.config
    env = subprocess.run(["bash", "-c", f"set -a; . {files.env}; env"], capture_output=True, text=True).stdout
    assert "GLMCTL_COLLECTIVES=host-staged" in env.splitlines()
    assert "vllm.yaml" in files.command_line and files.env.name in files.command_line
    assert files.command.stat().st_mode & 0o111
    assert "ShapleyMcg License 1.0" in files.notices.read_text()
    assert not list((tmp_path / "out").glob(".*tmp*"))  # written atomically, nothing left behind


def test_profile_cli_ls_show_render_validate(run_cli, tmp_path):
    rows = json.loads(run_cli("profile", "ls", "--json").stdout)
    assert {r["name"] for r in rows} >= {"commercial", "tiny-cpu"}
    shown = json.loads(run_cli("profile", "show", "noncommercial", "--json").stdout)
    assert shown["speculative"]["method"] == "dflash2" and shown["max_num_seqs"] == 8
    proc = run_cli("profile", "render", "latency", "--model", str(tmp_path), "--out", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "r" / "vllm.yaml").is_file() and "vllm.env" in proc.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("extends: tiny-cpu\nvllm_args:\n  max-model-len: 5\n")
    proc = run_cli("profile", "validate", str(bad), "--no-vllm")
    assert proc.returncode == 2 and "set max_model_len instead" in proc.stdout
    proc = run_cli("profile", "validate", "noncommercial", "--no-vllm")
    assert proc.returncode == 0 and "--accept-license dflash2-cc-by-nc-nd-4.0" in proc.stdout


SECRET_PROFILE = ("extends: tiny-cpu\nenv:\n  HF_TOKEN: hf_abcdef\n  VLLM_CPU_OMP_THREADS_BIND: auto\n"
                  "vllm_args:\n  api-key: sk-live-123\n  max-logprobs: 4096\n")


def test_secrets_are_masked_in_show_and_render_and_kept_private_in_files(tmp_path, capsys):
    from tests.unit.cli_inproc import run_glmctl

    _user_profile("mine", SECRET_PROFILE)
    for args in (("profile", "show", "mine"), ("profile", "show", "mine", "--json"),
                 ("profile", "render", "mine", "--model", tmp_path), ("profile", "render", "mine", "--model",
                                                                      tmp_path, "--json")):
        run = run_glmctl(capsys, *args)
        assert run.code == 0, run.err
        assert "sk-live-123" not in run.text and "hf_abcdef" not in run.text and "***" in run.out, args
        assert "4096" in run.out and "auto" in run.out  # only secret-looking keys are masked
    out = tmp_path / "deploy"
    run = run_glmctl(capsys, "profile", "render", "mine", "--model", tmp_path, "--out", out)
    assert run.code == 0 and "sk-live" not in run.text
    assert "HF_TOKEN=hf_abcdef" in (out / "vllm.env").read_text()  # the file itself is what vLLM needs
    assert yaml.safe_load((out / "vllm.yaml").read_text())["api-key"] == "sk-live-123"
    assert (out / "vllm.env").stat().st_mode & 0o777 == 0o600
    assert (out / "vllm.yaml").stat().st_mode & 0o777 == 0o600
    plain = tmp_path / "plain"
    assert run_glmctl(capsys, "profile", "render", "tiny-cpu", "--model", tmp_path, "--out", plain).code == 0
    assert (plain / "vllm.env").stat().st_mode & 0o777 == 0o600  # an env file is private whatever it holds
    import os

    umask = os.umask(0)
    os.umask(umask)
    assert (plain / "vllm.yaml").stat().st_mode & 0o777 == 0o644 & ~umask  # no secret: an ordinary file


def test_rendered_directory_runs_plain_vllm_serve_wherever_it_is_copied(tmp_path, monkeypatch):
    import shutil

    monkeypatch.setattr(launch_files, "_vllm_serve_words", lambda: ["vllm", "serve"])  # the CUDA distribution
    files = launch_files.write(_rendered("tiny-cpu", model=tmp_path / "ckpt"), tmp_path / "here")
    script = files.command.read_text()
    assert "exec vllm serve --config vllm.yaml" in script and "glmctl.serving.vllm_entry" not in script
    assert "/here/" not in script and "python" not in script  # nothing of this machine in it
    copied = tmp_path / "elsewhere" / "deploy"
    shutil.copytree(tmp_path / "here", copied)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "vllm").write_text('#!/bin/sh\necho "args: $*"\necho "cwd: $(pwd)"\n'
                                  'echo "space: $VLLM_CPU_KVCACHE_SPACE"\nhead -c 0 vllm.yaml && echo "config readable"\n')
    (bin_dir / "vllm").chmod(0o755)
    proc = subprocess.run(["bash", str(copied / "command.sh")], capture_output=True, text=True, cwd=tmp_path,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert "args: serve --config vllm.yaml" in proc.stdout and f"cwd: {copied}" in proc.stdout
    assert "space: 1" in proc.stdout and "config readable" in proc.stdout


def test_the_vllm_cpu_distribution_gets_the_shim_and_the_file_says_why(tmp_path, monkeypatch):
    import sys

    monkeypatch.setattr(launch_files, "_vllm_serve_words", lambda: [sys.executable, "-m", "glmctl.serving.vllm_entry", "serve"])
    files = launch_files.write(_rendered("tiny-cpu", model=tmp_path / "ckpt"), tmp_path / "out")
    script = files.command.read_text()
    assert '"${PYTHON:-python3}" -m glmctl.serving.vllm_entry serve --config vllm.yaml' in script
    assert "vllm-cpu distribution" in script and "plain `vllm serve --config vllm.yaml`" in script
    assert sys.executable not in script


def test_a_user_profile_extending_itself_says_so():
    _user_profile("solo", "extends: solo\nusage: commercial\nmax_num_seqs: 1\nmax_model_len: 64\n")
    with pytest.raises(ConfigError) as err:
        profiles.load("solo")
    assert "extends itself" in err.value.message and "no shipped 'solo'" in err.value.hint


def test_validate_checks_vllm_args_against_the_shipped_flag_list_without_vllm(run_cli, tmp_path):
    from glmctl.serving.validation import validate

    _user_profile("typo", "extends: tiny-cpu\nvllm_args:\n  not-a-vllm-flag: 7\n  enable-prefix-caching: false\n"
                          "  disable-log-stats: false\n")
    report = validate("typo", use_vllm=False)
    assert not report.valid and "vLLM 0.30.0 flag list" in report.checked_by
    assert any("'not-a-vllm-flag' is not a `vllm serve` option" in e for e in report.errors)
    assert any("'disable-log-stats: false' would be ignored" in e for e in report.errors)
    assert not any("enable-prefix-caching" in e for e in report.errors)  # it has a --no- form
    assert validate("commercial", use_vllm=False).valid
