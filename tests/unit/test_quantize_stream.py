"""The streaming safetensors layer, checkpoint opening, and the resumable job directory."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from glmctl.quantize.checkpoint import open_checkpoint  # noqa: E402
from glmctl.quantize.job import JOB_FILE, ConversionJob, OutputError, partial_dir_for  # noqa: E402
from glmctl.quantize.safetensors_io import (  # noqa: E402
    CheckpointError,
    PlannedTensor,
    ShardReader,
    ShardWriter,
    read_header,
)
from safetensors.torch import load_file, save_file  # noqa: E402

from glmctl.errors import ConfigError, UsageError  # noqa: E402


def _shard(path: Path, tensors: dict | None = None) -> Path:
    tensors = tensors or {"a.weight": torch.arange(12, dtype=torch.float32).view(3, 4),
                          "b": torch.ones(5, dtype=torch.bfloat16)}
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def _rewrite_header(path: Path, mutate) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    doc = json.loads(raw[8:8 + n])
    mutate(doc)
    head = json.dumps(doc).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + raw[8 + n:])


def test_header_of_a_library_written_file(tmp_path):
    h = read_header(_shard(tmp_path / "x.safetensors"))
    assert list(h.tensors) in (["a.weight", "b"], ["b", "a.weight"])
    assert h.tensors["a.weight"].shape == (3, 4) and h.tensors["a.weight"].dtype == "F32"
    assert h.metadata == {"format": "pt"} and h.data_bytes == 48 + 10


@pytest.mark.parametrize(("damage", "message"), [
    (lambda p: p.write_bytes(b"\x01\x02"), "shorter than the 8-byte header"),
    (lambda p: p.write_bytes(p.read_bytes()[:-3]), "truncated"),
    (lambda p: p.write_bytes(p.read_bytes()[:40]), "truncated"),
    (lambda p: p.write_bytes(struct.pack("<Q", 2**40) + p.read_bytes()[8:]), "header length field"),
    (lambda p: p.write_bytes(p.read_bytes()[:8] + b"{nope" + p.read_bytes()[13:]), "not valid JSON"),
    (lambda p: p.write_bytes(p.read_bytes() + b"xx"), "trailing bytes"),
    (lambda p: _rewrite_header(p, lambda d: d["b"].update(shape=[7])), "data_offsets span"),
    (lambda p: _rewrite_header(p, lambda d: d["b"].update(data_offsets=[0, 10])), "overlaps"),
    (lambda p: _rewrite_header(p, lambda d: d["b"].update(shape="x")), "malformed shape"),
])
def test_damaged_headers_are_named_precisely(tmp_path, damage, message):
    path = _shard(tmp_path / "model-00001.safetensors")
    damage(path)
    with pytest.raises(CheckpointError, match=message) as info:
        read_header(path)
    assert "model-00001.safetensors" in str(info.value)


def test_writer_output_loads_with_the_safetensors_library(tmp_path):
    a = torch.randn(5, 7)
    b = torch.arange(3, dtype=torch.int64)
    plan = [PlannedTensor("a", "F32", (5, 7)), PlannedTensor("empty", "BF16", (0, 4)), PlannedTensor("b", "I64", (3,))]
    w = ShardWriter(tmp_path / "o.safetensors", plan, {"format": "pt"})
    raw = a.view(torch.uint8).flatten().numpy()
    w.write("a", raw[:50])
    w.write("a", raw[50:])  # a tensor may arrive in pieces
    w.write("b", b.numpy())
    w.close()
    back = load_file(str(tmp_path / "o.safetensors"))
    assert torch.equal(back["a"], a) and torch.equal(back["b"], b) and back["empty"].shape == (0, 4)
    assert read_header(tmp_path / "o.safetensors").data_start % 8 == 0


def test_writer_refuses_out_of_order_and_short_tensors(tmp_path):
    plan = [PlannedTensor("a", "F32", (2,)), PlannedTensor("b", "F32", (2,))]
    w = ShardWriter(tmp_path / "o.safetensors", plan, {})
    with pytest.raises(RuntimeError, match="out of the planned order"):
        w.write("b", torch.ones(2).numpy())
    w.write("a", torch.ones(1).numpy())
    with pytest.raises(RuntimeError, match="unwritten"):
        w.close()
    w.abort()
    assert not (tmp_path / "o.safetensors").exists()


def test_reader_reads_byte_ranges_and_chunks(tmp_path):
    t = torch.arange(1000, dtype=torch.int32)
    h = read_header(_shard(tmp_path / "x.safetensors", {"t": t}))
    with ShardReader(h) as r:
        out = torch.empty(40, dtype=torch.uint8)
        r.read_into(h.tensors["t"], 400, out)
        assert torch.equal(out.view(torch.int32), t[100:110])
        joined = b"".join(bytes(c) for c in r.chunks(h.tensors["t"], 1000))
    assert joined == t.numpy().tobytes()


def _ckpt(tmp_path: Path, shards: int = 2) -> Path:
    d = tmp_path / "ck"
    d.mkdir()
    wm = {}
    for i in range(shards):
        name = f"m-{i}.safetensors"
        _shard(d / name, {f"l{i}.weight": torch.ones(2, 2)})
        wm[f"l{i}.weight"] = name
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    (d / "config.json").write_text("{}")
    (d / "tokenizer.json").write_text("{}")
    (d / ".cache").mkdir()
    (d / ".cache" / "x").write_text("download state")
    return d


def test_open_checkpoint_lists_shards_and_extra_files(tmp_path):
    ck = open_checkpoint(_ckpt(tmp_path))
    assert ck.shard_names == ["m-0.safetensors", "m-1.safetensors"]
    assert [str(p) for p in ck.extra_files] == ["tokenizer.json"]


def test_missing_shard_names_the_shard_and_a_tensor(tmp_path):
    d = _ckpt(tmp_path)
    (d / "m-1.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"missing .*m-1\.safetensors.*l1\.weight"):
        open_checkpoint(d)


def test_index_disagreeing_with_headers_is_refused(tmp_path):
    d = _ckpt(tmp_path)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    idx["weight_map"]["ghost.weight"] = "m-0.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="ghost.weight"):
        open_checkpoint(d)


def test_unreadable_or_missing_config_is_a_config_error(tmp_path):
    d = _ckpt(tmp_path)
    (d / "config.json").write_text("{ not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        open_checkpoint(d)
    (d / "config.json").unlink()
    with pytest.raises(ConfigError, match="no config.json"):
        open_checkpoint(d)


def test_fingerprint_changes_with_a_shard(tmp_path):
    d = _ckpt(tmp_path)
    before = open_checkpoint(d).fingerprint()
    _shard(d / "m-1.safetensors", {"l1.weight": torch.zeros(2, 2), "extra": torch.zeros(1)})
    json_idx = json.loads((d / "model.safetensors.index.json").read_text())
    json_idx["weight_map"]["extra"] = "m-1.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(json_idx))
    assert open_checkpoint(d).fingerprint() != before


def test_job_records_units_and_resume_checks_settings_and_source(tmp_path):
    dst = tmp_path / "out"
    job = ConversionJob.start(dst, "fp8", {"block": 128}, "fp-1", force=False, resume=False)
    with job.unit("s1") as tmp:
        tmp.write_bytes(b"abc")
    with pytest.raises(ZeroDivisionError), job.unit("s2") as tmp:
        tmp.write_bytes(b"half")
        raise ZeroDivisionError
    work = partial_dir_for(dst.absolute(), "fp8")
    assert sorted(p.name for p in work.iterdir()) == [JOB_FILE, "s1"]
    assert not dst.exists()

    with pytest.raises(UsageError, match="--resume"):
        ConversionJob.start(dst, "fp8", {"block": 128}, "fp-1", force=False, resume=False)
    with pytest.raises(UsageError, match="block: was 128, now 64"):
        ConversionJob.start(dst, "fp8", {"block": 64}, "fp-1", force=False, resume=True)
    with pytest.raises(UsageError, match="source checkpoint changed"):
        ConversionJob.start(dst, "fp8", {"block": 128}, "fp-2", force=False, resume=True)
    (work / "s1").write_bytes(b"abcd")  # a unit whose size no longer matches is redone
    again = ConversionJob.start(dst, "fp8", {"block": 128}, "fp-1", force=False, resume=True)
    assert not again.is_finished("s1")
    with again.unit("s1") as tmp:
        tmp.write_bytes(b"abc")
    again.write_file("config.json", b"{}")
    assert again.finalize() == dst.absolute()
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "s1"] and not work.exists()


def test_force_discards_a_partial_run_and_nonempty_dst_needs_force(tmp_path):
    dst = tmp_path / "out"
    ConversionJob.start(dst, "fp8", {}, "x", force=False, resume=False)
    job = ConversionJob.start(dst, "fp8", {}, "x", force=True, resume=False)
    assert job.finished == {}
    dst.mkdir()
    (dst / "old").write_text("keep me until the new one is complete")
    with pytest.raises(UsageError, match="not empty"):
        ConversionJob.start(dst, "fp8", {}, "x", force=False, resume=True)


def test_disk_full_on_a_unit_is_an_output_error_with_the_fix(tmp_path):
    import errno

    job = ConversionJob.start(tmp_path / "out", "fp8", {}, "x", force=False, resume=False)
    with pytest.raises(OutputError, match="disk full") as info, job.unit("s1") as tmp:
        tmp.write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    assert "--resume" in info.value.hint
    assert not (job.work / "s1.part").exists() and not job.is_finished("s1")
    with pytest.raises(OutputError, match="not enough disk space"):
        job.check_space(2**62)
