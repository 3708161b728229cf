"""`glmctl quantize fp8` and `verify` end to end: output format, resume, bad input, memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from glmctl.quantize.fp8_convert import convert_fp8  # noqa: E402
from glmctl.quantize.fp8_plan import Fp8Settings  # noqa: E402
from glmctl.quantize.job import JOB_FILE, partial_dir_for  # noqa: E402
from glmctl.quantize.safetensors_io import read_header  # noqa: E402
from safetensors import safe_open  # noqa: E402

from tests.unit._quantize_util import (  # noqa: E402
    cli,
    copy_checkpoint,
    looks_like_checkpoint,
    make_synthetic,
    same_tree,
)


@pytest.fixture(scope="module")
def synthetic_src(tmp_path_factory):
    return make_synthetic(tmp_path_factory)


@pytest.fixture(scope="module")
def converted(synthetic_src, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("converted") / "dst"
    code, out, err = cli("quantize", "fp8", str(synthetic_src), str(dst), "--json")
    assert code == 0, err
    return dst


def test_output_is_a_loadable_block_fp8_checkpoint(converted, synthetic_src):
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    index = json.loads((converted / "model.safetensors.index.json").read_text())
    names = set()
    for shard in sorted(converted.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:  # the reference reader accepts our writer's files
            names |= set(f.keys())
            if "model.layers.0.self_attn.q_proj.weight" in f.keys():
                assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.float8_e4m3fn
                assert f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale_inv").shape == (2, 2)
                assert f.get_tensor("model.layers.0.self_attn.f_a_proj.weight").dtype == torch.bfloat16
    assert set(index["weight_map"]) == names
    assert index["metadata"]["total_size"] == sum(read_header(p).data_bytes for p in converted.glob("*.safetensors"))
    assert (converted / "tokenizer_config.json").read_text() == (synthetic_src / "tokenizer_config.json").read_text()
    assert sorted(p.name for p in converted.iterdir()) == sorted(
        [p.name for p in synthetic_src.iterdir()] + ["glmctl-quantize.json"])


def test_verify_with_reference_reports_error_per_tensor(converted, synthetic_src):
    code, out, err = cli("quantize", "verify", str(converted), "--reference", str(synthetic_src), "--json")
    assert code == 0, out + err
    data = json.loads(out)
    assert data["ok"] and not data["problems"] and data["fp8_weights"] == len(data["errors"]) == 22
    assert all(30 < e["snr_db"] < 34 and 0.02 < e["rel_rms"] < 0.032 for e in data["errors"])
    assert data["identical"] == data["tensors"] - 2 * 22


def test_human_output_has_the_table_and_notes(synthetic_src, tmp_path):
    code, out, err = cli("quantize", "fp8", str(synthetic_src), str(tmp_path / "d"), "--dry-run")
    assert code == 0 and "dry run" in out and "needs plugin" in out
    # stock vLLM refuses FP8 KDA q/k/v, the plugin keeps them FP8; wk is BF16 at load either way
    row = next(line for line in out.splitlines() if "kda q_proj" in line)
    assert row.split()[-3:] == ["needs", "plugin", "FP8"], row
    row = next(line for line in out.splitlines() if "indexer.wk" in line)
    assert row.count("BF16 at load") == 2, row
    assert not (tmp_path / "d").exists() and not partial_dir_for(tmp_path / "d", "fp8").exists()


def test_interrupted_run_resumes_to_the_same_bytes(synthetic_src, tmp_path):
    whole = tmp_path / "whole"
    convert_fp8(synthetic_src, whole, Fp8Settings())

    dst = tmp_path / "dst"

    def stop_after_first(shard: str) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert_fp8(synthetic_src, dst, Fp8Settings(), on_shard_done=stop_after_first)
    work = partial_dir_for(dst, "fp8")
    assert not dst.exists() and not looks_like_checkpoint(work)
    assert list(json.loads((work / JOB_FILE).read_text())["finished"]) == ["model-00001-of-00002.safetensors"]

    code, _, err = cli("quantize", "fp8", str(synthetic_src), str(dst))
    assert code == 2 and "--resume" in err
    code, _, err = cli("quantize", "fp8", str(synthetic_src), str(dst), "--resume", "--exclude", "*.wk")
    assert code == 2 and "refusing to resume with different settings" in err and "exclude" in err
    code, out, err = cli("quantize", "fp8", str(synthetic_src), str(dst), "--resume", "--json")
    assert code == 0, err
    assert json.loads(out)["shards_resumed"] == 1
    assert same_tree(whole, dst) == [] and not work.exists()


def test_ctrl_c_exits_130_and_keeps_the_partial_run(synthetic_src, tmp_path, monkeypatch):
    import glmctl.quantize.fp8_convert as conv

    real = conv._convert_shard
    calls = []

    def interrupt_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(conv, "_convert_shard", interrupt_second)
    code, _, err = cli("quantize", "fp8", str(synthetic_src), str(tmp_path / "d"))
    assert code == 130 and "interrupted" in err and "--resume" in err
    work = partial_dir_for(tmp_path / "d", "fp8")
    assert sorted(p.name for p in work.iterdir()) == [JOB_FILE, "model-00001-of-00002.safetensors"]


# -- bad input: a clear message, the right exit code, no DST that looks like a checkpoint ----------

def _damage_missing_shard(src: Path) -> None:
    (src / "model-00002-of-00002.safetensors").unlink()


def _damage_truncate(src: Path) -> None:
    p = src / "model-00002-of-00002.safetensors"
    p.write_bytes(p.read_bytes()[:-1000])


def _damage_header(src: Path) -> None:
    p = src / "model-00001-of-00002.safetensors"
    raw = bytearray(p.read_bytes())
    raw[8:12] = b"\x00\xff{["
    p.write_bytes(bytes(raw))


def _damage_config(src: Path) -> None:
    (src / "config.json").write_text('{"architectures": ["Glm5NextForCausalLM"],')


def _damage_nan(src: Path) -> None:
    from safetensors.torch import load_file, save_file

    p = src / "model-00002-of-00002.safetensors"
    t = load_file(str(p))
    t["model.layers.3.self_attn.kv_b_proj.weight"][7, 9] = float("nan")
    save_file(t, str(p), metadata={"format": "pt"})


@pytest.mark.parametrize(("damage", "code", "message"), [
    (_damage_missing_shard, 1, "model-00002-of-00002.safetensors"),
    (_damage_truncate, 1, "truncated"),
    (_damage_header, 1, "header is not valid JSON"),
    (_damage_config, 2, "config.json is not valid JSON"),
    (_damage_nan, 1, "kv_b_proj.weight rows 0..512: the matrix holds NaN"),
])
def test_bad_input_gives_a_clear_error_and_no_dst(synthetic_src, tmp_path, damage, code, message):
    src = copy_checkpoint(synthetic_src, tmp_path / "src")
    damage(src)
    dst = tmp_path / "dst"
    got, _, err = cli("quantize", "fp8", str(src), str(dst))
    assert got == code and message in err, err
    assert "Traceback" not in err and "hint:" in err
    assert not dst.exists() and not looks_like_checkpoint(partial_dir_for(dst, "fp8"))


def test_nonempty_dst_needs_force_and_force_replaces_it(synthetic_src, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "old.txt").write_text("old")
    code, _, err = cli("quantize", "fp8", str(synthetic_src), str(dst))
    assert code == 2 and "not empty" in err and "--force" in err
    assert (dst / "old.txt").exists()
    code, _, err = cli("quantize", "fp8", str(synthetic_src), str(dst), "--force")
    assert code == 0, err
    assert not (dst / "old.txt").exists() and (dst / "config.json").exists()


def test_dst_inside_src_is_refused(synthetic_src):
    code, _, err = cli("quantize", "fp8", str(synthetic_src), str(synthetic_src / "out"))
    assert code == 2 and "overlaps SRC" in err


def test_disk_full_injected_at_the_write_layer(synthetic_src, tmp_path, monkeypatch):
    """ENOSPC raised by the shard writer's write() (stands in for a full disk on any machine)."""
    import errno

    from glmctl.quantize import safetensors_io

    real = safetensors_io.ShardWriter.write
    count = {"n": 0}

    def write(self, name, data):
        count["n"] += 1
        if count["n"] == 40:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, name, data)

    monkeypatch.setattr(safetensors_io.ShardWriter, "write", write)
    dst = tmp_path / "dst"
    code, _, err = cli("quantize", "fp8", str(synthetic_src), str(dst))
    assert code == 1 and "disk full while writing model-0000" in err and "--resume" in err
    work = partial_dir_for(dst, "fp8")
    assert not dst.exists() and not looks_like_checkpoint(work) and not list(work.glob("*.part"))


TMPFS_SCRIPT = r"""
set -u
mount -t tmpfs -o size="$SIZE" tmpfs "$MNT" || exit 99
"$PY" -c "$CODE" quantize fp8 "$SRC" "$MNT/dst"
echo "rc=$?"
ls -A "$MNT"
ls -A "$MNT"/.dst.fp8-partial 2>/dev/null | sed 's/^/partial: /'
"""

TMPFS_CODE = r"""
import os, sys
if os.environ.get("NO_SPACE_CHECK"):
    import glmctl.quantize.job as job
    job.ConversionJob.check_space = lambda self, n: None  # let the write itself hit ENOSPC
from glmctl.app import main
sys.argv = ["glmctl", *sys.argv[1:]]
main()
"""


def _run_in_tmpfs(src: Path, tmp_path: Path, size: str, no_space_check: bool):
    """Run the CLI with DST on a real tmpfs of `size`, mounted in a private user+mount namespace."""
    import os
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to mount a private tmpfs")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    env = {**os.environ, "COLUMNS": "4000", "SIZE": size, "MNT": str(mnt), "PY": sys.executable, "CODE": TMPFS_CODE,
           "SRC": str(src), "NO_SPACE_CHECK": "1" if no_space_check else "",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", TMPFS_SCRIPT],
                          capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode == 99 or "rc=" not in proc.stdout:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()[:200]}); "
                    "test_disk_full_injected_at_the_write_layer covers the write path")
    return proc


@pytest.mark.parametrize("no_space_check", [False, True], ids=["preflight", "mid-write"])
def test_disk_full_on_a_real_small_tmpfs(synthetic_src, tmp_path, no_space_check):
    """DST on a 1 MiB tmpfs (the output needs ~3 MiB): caught before writing, or by the write itself."""
    proc = _run_in_tmpfs(synthetic_src, tmp_path, "1m", no_space_check)
    listing = proc.stdout.splitlines()
    assert "rc=1" in listing, proc.stdout + proc.stderr
    assert ("disk full while writing" if no_space_check else "not enough disk space") in proc.stderr
    assert "dst" not in listing  # no DST at all
    partial = [line for line in listing if line.startswith("partial: ")]
    assert not {"partial: config.json", "partial: model.safetensors.index.json"} & set(partial)
    assert not [p for p in partial if p.endswith(".part")]


# -- verify finds what is wrong ---------------------------------------------------------------------

def _patch_tensor_bytes(ckpt: Path, name: str, transform) -> None:
    for shard in ckpt.glob("*.safetensors"):
        h = read_header(shard)
        if name in h.tensors:
            e = h.tensors[name]
            raw = bytearray(shard.read_bytes())
            start = h.data_start + e.begin
            raw[start:start + e.nbytes] = transform(bytes(raw[start:start + e.nbytes]))
            shard.write_bytes(bytes(raw))
            return
    raise KeyError(name)


def test_verify_fails_on_a_wrong_scale_a_changed_tensor_and_a_bad_skip_list(converted, synthetic_src, tmp_path):
    bad = copy_checkpoint(converted, tmp_path / "bad")
    doubled = torch.full((2, 2), 2.0) * 1
    _patch_tensor_bytes(bad, "model.layers.0.self_attn.q_proj.weight_scale_inv",
                        lambda b: (torch.frombuffer(bytearray(b), dtype=torch.float32) * doubled.flatten()).numpy().tobytes())
    _patch_tensor_bytes(bad, "model.layers.0.input_layernorm.weight", lambda b: b[::-1])
    _patch_tensor_bytes(bad, "model.layers.2.self_attn.v_proj.weight", lambda b: b"\x7f" + b[1:])
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"].remove("model.layers.1.mlp.shared_experts.gate_up_proj")
    cfg["quantization_config"]["modules_to_not_convert"].append("model.layers.1.self_attn.kv_b_proj")
    (bad / "config.json").write_text(json.dumps(cfg))

    code, out, err = cli("quantize", "verify", str(bad), "--reference", str(synthetic_src), "--json")
    data = json.loads(out)
    assert code == 1 and not data["ok"]
    problems = "\n".join(data["problems"])
    assert "input_layernorm.weight differs from the reference" in problems
    assert "v_proj.weight holds 1 NaN codes" in problems
    assert "shared_experts.gate_up_proj is unquantised but not in modules_to_not_convert" in problems
    assert "kv_b_proj is FP8 but listed in modules_to_not_convert" in problems
    q = next(e for e in data["errors"] if e["name"] == "model.layers.0.self_attn.q_proj.weight")
    assert not q["ok"] and q["snr_db"] < 1 and q["rel_rms"] > 0.9


def test_verify_without_quantization_config_fails(converted, tmp_path):
    bad = copy_checkpoint(converted, tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    del cfg["quantization_config"]
    (bad / "config.json").write_text(json.dumps(cfg))
    code, out, _ = cli("quantize", "verify", str(bad))
    assert code == 1 and "no quantization_config" in out


def test_real_entry_point_converts_and_verifies(run_cli, synthetic_src, tmp_path):
    dst = tmp_path / "dst"
    proc = run_cli("quantize", "fp8", str(synthetic_src), str(dst), "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tensors_quantized"] == 22
    proc = run_cli("quantize", "verify", str(dst), "--quiet", timeout=300)
    assert proc.returncode == 0 and proc.stdout == ""


MEMORY_CODE = r"""
import json, sys
from pathlib import Path
import torch
from glmctl.quantize.fp8_convert import convert_fp8
from glmctl.quantize.fp8_plan import Fp8Settings
def status(key):  # VmHWM is this process image's peak RSS (ru_maxrss would include the parent's)
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
before = status("VmRSS")
convert_fp8(Path(sys.argv[1]), Path(sys.argv[2]), Fp8Settings(modules=("*.self_attn.*",)))
print(json.dumps({"before": before, "peak": status("VmHWM")}))
"""


def test_peak_memory_is_bounded_by_twice_the_largest_tensor_not_the_checkpoint(tmp_path, run_cli):
    """Peak RSS growth of a conversion process (tracemalloc cannot see torch's allocations).

    Checkpoint: 10 projections of 16 MiB and one of 64 MiB (bf16), 224 MiB in all, in 2 shards.
    The converter streams in 8 MiB reads, so growth stays far below 2 x 64 MiB.
    """
    import subprocess
    import sys

    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    weight_map = {}
    for s in range(2):
        tensors = {}
        for i in range(5):
            tensors[f"model.layers.{5 * s + i}.self_attn.q_proj.weight"] = torch.randn(2048, 4096, generator=g).bfloat16()
        if s == 1:
            tensors["model.layers.9.self_attn.o_proj.weight"] = torch.randn(8192, 4096, generator=g).bfloat16()
        name = f"model-{s + 1:05d}-of-00002.safetensors"
        save_file(tensors, str(src / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (src / "config.json").write_text(json.dumps({"model_type": "test"}))
    proc = subprocess.run([sys.executable, "-c", MEMORY_CODE, str(src), str(tmp_path / "dst")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    m = json.loads(proc.stdout)
    largest, total = 64 * 2**20, 224 * 2**20
    growth = m["peak"] - m["before"]
    assert growth < 2 * largest < total, f"peak RSS grew by {growth / 2**20:.0f} MiB"


def test_fp8_source_passes_through_and_verifies_against_it(synthetic_src, tmp_path):
    """SRC already block-FP8 in its MLPs: they pass through byte for byte, attention is converted."""
    fp8_src = tmp_path / "fp8-src"
    code, _, err = cli("quantize", "fp8", str(synthetic_src), str(fp8_src), "--modules", "*.mlp.*")
    assert code == 0, err
    dst = tmp_path / "dst"
    code, out, err = cli("quantize", "fp8", str(fp8_src), str(dst), "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["tensors_quantized"] == 22 and result["tensors_kept_fp8"] > 0
    skip = json.loads((dst / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert [s for s in skip if ".mlp." in s and not s.endswith(".mlp.gate")] == []  # only routers stay
    code, out, _ = cli("quantize", "verify", str(dst), "--reference", str(fp8_src), "--json")
    data = json.loads(out)
    assert code == 0 and data["ok"] and len(data["errors"]) == 22
    assert data["identical"] == data["tensors"] - 2 * 22  # every FP8 MLP tensor byte-identical


def test_single_file_checkpoint_stays_single_file(tmp_path):
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    save_file({"model.layers.0.self_attn.q_proj.weight": torch.randn(256, 384).bfloat16(),
               "model.norm.weight": torch.ones(384)}, str(src / "model.safetensors"), metadata={"format": "pt"})
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    code, _, err = cli("quantize", "fp8", str(src), str(tmp_path / "dst"))
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "dst").iterdir()) == ["config.json", "glmctl-quantize.json",
                                                                     "model.safetensors"]
    code, out, _ = cli("quantize", "verify", str(tmp_path / "dst"), "--reference", str(src))
    assert code == 0 and "1 converted" in out


# -- a verifier reports on broken checkpoints; a resume trusts nothing it has not re-hashed --------

@pytest.mark.parametrize(("damage", "said"), [
    (_damage_truncate, "truncated"),
    (_damage_header, "header is not valid JSON"),
    (_damage_missing_shard, "missing"),
])
def test_verify_json_reports_a_damaged_shard(converted, tmp_path, damage, said):
    dst = copy_checkpoint(converted, tmp_path / "dst")
    damage(dst)
    code, out, err = cli("quantize", "verify", str(dst), "--json")
    assert code == 1, err
    doc = json.loads(out)
    assert doc["ok"] is False and any(said in p for p in doc["problems"]), doc["problems"]
    assert "unexpected error" not in err


def test_resume_converts_a_finished_shard_again_when_its_bytes_changed(synthetic_src, tmp_path):
    whole = tmp_path / "whole"
    convert_fp8(synthetic_src, whole, Fp8Settings())
    dst = tmp_path / "dst"

    def stop_after_first(shard: str) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert_fp8(synthetic_src, dst, Fp8Settings(), on_shard_done=stop_after_first)
    done = partial_dir_for(dst, "fp8") / "model-00001-of-00002.safetensors"
    data = bytearray(done.read_bytes())
    data[-5] ^= 0x01  # same size, one bit: only the hash can tell
    done.write_bytes(bytes(data))
    code, out, err = cli("quantize", "fp8", str(synthetic_src), str(dst), "--resume", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["shards_resumed"] == 0
    assert any("model-00001-of-00002.safetensors had changed" in n for n in result["notes"])
    assert same_tree(whole, dst) == []


def test_a_conversion_whose_output_fails_verification_never_becomes_dst(synthetic_src, tmp_path, monkeypatch):
    import glmctl.quantize.fp8_convert as conv

    real = conv._write_metadata

    def broken_config(job, *args):
        real(job, *args)
        config = json.loads((job.work / "config.json").read_text())
        config["quantization_config"]["activation_scheme"] = "static"
        (job.work / "config.json").write_text(json.dumps(config))

    monkeypatch.setattr(conv, "_write_metadata", broken_config)
    dst = tmp_path / "dst"
    code, _, err = cli("quantize", "fp8", str(synthetic_src), str(dst))
    assert code == 1 and "fails verification" in err and "activation_scheme" in err, err
    assert not dst.exists() and partial_dir_for(dst, "fp8").is_dir()
