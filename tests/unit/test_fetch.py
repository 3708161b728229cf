"""`glmctl fetch` against a local fake Hub (tests/unit/fake_hub.py): download, resume, verify,
repair, licence gate, offline verification, and every failure's message and exit code."""

from __future__ import annotations

import json
import socket
import time

import numpy as np
import pytest

from tests.unit.fake_hub import COMMIT, FakeHub

BIG = 12 << 20  # > huggingface_hub's 10 MiB download chunk, so an interrupted body can resume by Range


def _write_repo(root, repo, *, big=False):
    from safetensors.numpy import save_file

    d = root / repo
    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    layer0 = {"model.embed_tokens.weight": rng.standard_normal((64, 16)).astype(np.float32)}
    rows = (BIG // (16 * 4)) if big else 8
    layer1 = {"model.layers.0.mlp.weight": rng.standard_normal((rows, 16)).astype(np.float32)}
    save_file(layer0, d / "model-00001-of-00002.safetensors")
    save_file(layer1, d / "model-00002-of-00002.safetensors")
    weight_map = {k: "model-00001-of-00002.safetensors" for k in layer0}
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in layer1})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (d / "config.json").write_text(json.dumps({"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 1}))
    return d


@pytest.fixture
def hub(tmp_path):
    root = tmp_path / "hub"
    _write_repo(root, "org/tiny")
    _write_repo(root, "org/big", big=True)
    _write_repo(root, "incoai/GLM-5.3-DFlash2")
    h = FakeHub(root).start()
    yield h
    h.stop()


@pytest.fixture
def fetch_cli(run_cli, hub, tmp_path):
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": "", "HF_HUB_DISABLE_TELEMETRY": "1",
           "GLMCTL_MODELS": str(tmp_path / "models")}

    def _run(*args, **kw):
        extra = kw.pop("env", {})
        return run_cli("fetch", *args, env={**env, **extra}, **kw)

    return _run


def _gets(hub, path_part):
    return [r for r in hub.requests if r[0] == "GET" and path_part in r[1]]


def test_download_writes_manifest_and_verifies(fetch_cli, tmp_path):
    dest = tmp_path / "out"
    proc = fetch_cli("org/tiny", "--local-dir", str(dest), "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["revision"] == COMMIT and result["verify"]["source"] == "hub"
    assert {f["status"] for f in result["verify"]["files"]} == {"ok"}
    assert len(result["verify"]["files"]) == 4 and result["verify"]["problems"] == []
    assert (dest / ".glmctl" / "manifest.json").stat().st_mode & 0o777 == (dest / "config.json").stat().st_mode & 0o777
    manifest = json.loads((dest / ".glmctl" / "manifest.json").read_text())
    shards = [f for f in manifest["files"] if f["path"].endswith(".safetensors")]
    assert all(len(f["sha256"]) == 64 for f in shards)
    assert all(f["git_oid"] for f in manifest["files"] if f["path"] == "config.json")


def test_interrupted_transfer_resumes_with_a_range_request(fetch_cli, hub, tmp_path):
    hub.cut_after["model-00002-of-00002.safetensors"] = [(10 << 20) + 12345, 1]
    proc = fetch_cli("org/big", "--local-dir", str(tmp_path / "big"), "--json")
    assert proc.returncode == 0, proc.stderr
    ranged = [r for r in _gets(hub, "model-00002") if r[2]]
    assert ranged and ranged[0][2].startswith("bytes=10485760"), hub.requests
    assert json.loads(proc.stdout)["verify"]["files"][0]["status"] == "ok"


def test_failed_fetch_resumes_without_downloading_finished_files_again(fetch_cli, hub, tmp_path):
    dest = tmp_path / "out"
    hub.cut_after["model-00002-of-00002.safetensors"] = [100, 50]
    first = fetch_cli("org/tiny", "--local-dir", str(dest), "--jobs", "1")
    assert first.returncode == 1 and "interrupted" in first.stderr and "run the same command again" in first.stderr
    assert (dest / "config.json").exists() and not (dest / ".glmctl" / "manifest.json").exists()
    hub.cut_after.clear()
    before = len(_gets(hub, "/resolve/"))
    second = fetch_cli("org/tiny", "--local-dir", str(dest), "--json")
    assert second.returncode == 0, second.stderr
    fetched_again = {r[1].rsplit("/", 1)[1] for r in _gets(hub, "/resolve/")[before:]}
    assert "config.json" not in fetched_again and "model-00002-of-00002.safetensors" in fetched_again


def test_flipped_byte_is_detected_and_repaired(fetch_cli, tmp_path):
    dest = tmp_path / "out"
    assert fetch_cli("org/tiny", "--local-dir", str(dest)).returncode == 0
    shard = dest / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # inside the tensor data: the header still parses, only the hash can tell
    shard.write_bytes(bytes(data))
    bad = fetch_cli("--verify", str(dest), "--json")
    assert bad.returncode == 1
    statuses = {f["path"]: f["status"] for f in json.loads(bad.stdout)["verify"]["files"]}
    assert statuses["model-00002-of-00002.safetensors"] == "hash-mismatch"
    assert statuses["config.json"] == "ok"
    fixed = fetch_cli("--verify", str(dest), "--repair", "--json")
    assert fixed.returncode == 0, fixed.stderr
    assert json.loads(fixed.stdout)["repaired"] == ["model-00002-of-00002.safetensors"]


def test_truncated_file_reported_by_name(fetch_cli, tmp_path):
    dest = tmp_path / "out"
    assert fetch_cli("org/tiny", "--local-dir", str(dest)).returncode == 0
    shard = dest / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    proc = fetch_cli("--verify", str(dest), "--offline")
    assert proc.returncode == 1
    assert "model-00001-of-00002.safetensors" in proc.stdout and "size-mismatch" in proc.stdout


def test_offline_verify_uses_the_manifest(fetch_cli, tmp_path):
    dest = tmp_path / "out"
    assert fetch_cli("org/tiny", "--local-dir", str(dest)).returncode == 0
    with socket.socket() as s:  # a port nothing listens on: the Hub is unreachable
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    proc = fetch_cli("--verify", str(dest), "--json", env={"HF_ENDPOINT": dead})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["verify"]["source"] == "manifest"
    assert "manifest" in proc.stderr


def test_restricted_licence_refused_without_acceptance(fetch_cli, hub, tmp_path):
    dest = tmp_path / "drafter"
    proc = fetch_cli("dflash2", "--local-dir", str(dest))
    assert proc.returncode == 2
    assert "--accept-license dflash2-cc-by-nc-nd-4.0" in proc.stderr
    assert not _gets(hub, "/resolve/") and not (dest / "config.json").exists()


def test_restricted_licence_accepted_is_recorded(fetch_cli, tmp_path):
    dest = tmp_path / "drafter"
    proc = fetch_cli("dflash2", "--local-dir", str(dest), "--accept-license", "dflash2-cc-by-nc-nd-4.0", "--json")
    assert proc.returncode == 0, proc.stderr
    record = json.loads((dest / ".glmctl" / "license-dflash2-cc-by-nc-nd-4.0.json").read_text())
    assert record["license"] == "dflash2-cc-by-nc-nd-4.0" and len(record["text_sha256"]) == 64
    again = fetch_cli("dflash2", "--local-dir", str(tmp_path / "again"))  # remembered: no flag needed
    assert again.returncode == 0, again.stderr


def test_gated_repo_says_what_to_do(fetch_cli, hub, tmp_path):
    hub.gated.add("org/tiny")
    proc = fetch_cli("org/tiny", "--local-dir", str(tmp_path / "x"))
    assert proc.returncode == 1
    assert "gated" in proc.stderr and "HF_TOKEN" in proc.stderr


def test_missing_repo_and_revision_are_usage_errors(fetch_cli, tmp_path):
    assert fetch_cli("org/nope", "--local-dir", str(tmp_path / "x")).returncode == 2
    proc = fetch_cli("org/tiny", "--revision", "v9", "--local-dir", str(tmp_path / "x"))
    assert proc.returncode == 2 and "v9" in proc.stderr


def test_no_network(fetch_cli, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    proc = fetch_cli("org/tiny", "--local-dir", str(tmp_path / "x"), env={"HF_ENDPOINT": dead})
    assert proc.returncode == 1 and "cannot reach" in proc.stderr


def test_not_enough_disk_is_refused_before_downloading(hub, tmp_path, monkeypatch):
    import shutil

    from glmctl.hub import download, fetching

    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", hub.url)
    monkeypatch.setattr(download.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(100, 90, 10))
    with pytest.raises(download.DiskSpaceError, match="GiB needed"):
        fetching.fetch("org/tiny", repo=None, revision=None, include=[], exclude=[], local_dir=tmp_path / "x",
                       accept=[], hash_contents=True, jobs=1)
    assert not _gets(hub, "/resolve/")


def test_unknown_target_and_missing_repo_for_catalogue_artifact(fetch_cli):
    proc = fetch_cli("not a repo")
    assert proc.returncode == 2 and "known artifacts" in proc.stderr
    proc = fetch_cli("glm-5.3-flash-exl3-4bit")
    assert proc.returncode == 2 and "--repo" in proc.stderr


def test_corrupt_header_without_manifest_is_reported_by_name(fetch_cli, tmp_path):
    """Structure checks run even where no manifest exists (a directory fetched by other tools)."""
    dest = tmp_path / "out"
    assert fetch_cli("org/tiny", "--local-dir", str(dest)).returncode == 0
    import shutil

    shutil.rmtree(dest / ".glmctl")
    shard = dest / "model-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:12] = b"\x00\x01\x02\x03"  # inside the JSON header
    shard.write_bytes(bytes(data))
    proc = fetch_cli("--verify", str(dest), "--json")
    assert proc.returncode == 1 and "no glmctl manifest" in proc.stderr
    files = {f["path"]: f for f in json.loads(proc.stdout)["verify"]["files"]}
    assert files["model-00001-of-00002.safetensors"]["status"] == "bad-header"


# -- a hostile or absent Hub: nothing deleted, deadlines that hold, every failure a sentence -----

def _dead_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _damage(dest):
    shard = dest / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    return shard, bytes(data)


@pytest.mark.parametrize("hub_state", ["500", "offline"])
def test_a_repair_that_cannot_download_keeps_the_damaged_file(fetch_cli, hub, tmp_path, hub_state):
    dest = tmp_path / "out"
    assert fetch_cli("org/tiny", "--local-dir", str(dest)).returncode == 0
    shard, damaged = _damage(dest)
    env = {}
    if hub_state == "500":
        hub.faults["file:model-00002-of-00002.safetensors"] = "500"
    else:
        env = {"HF_ENDPOINT": _dead_endpoint()}
    proc = fetch_cli("--verify", str(dest), "--repair", "--timeout", "2", env=env)
    assert proc.returncode == 1, proc.stderr
    assert ("HTTP 500" if hub_state == "500" else "cannot reach") in proc.stderr
    assert "unexpected error" not in proc.stderr
    assert shard.read_bytes() == damaged  # still there, exactly as it was
    assert not list((dest / ".glmctl").glob("repair-*"))  # and no staging left behind


def test_a_repair_that_downloads_the_wrong_bytes_keeps_the_damaged_file(fetch_cli, hub, tmp_path):
    dest = tmp_path / "out"
    assert fetch_cli("org/tiny", "--local-dir", str(dest)).returncode == 0
    shard, damaged = _damage(dest)
    (hub.root / "org" / "tiny" / shard.name).write_bytes(damaged[:-1] + b"\x00")  # the Hub now serves other bytes
    proc = fetch_cli("--verify", str(dest), "--repair", "--offline")
    assert proc.returncode == 1 and "does not match its recorded hash" in proc.stderr, proc.stderr
    assert shard.read_bytes() == damaged


@pytest.mark.parametrize("contents", [[], ["config.json"]])
def test_verifying_a_directory_with_nothing_to_verify_is_not_verified(fetch_cli, tmp_path, contents):
    dest = tmp_path / "empty"
    dest.mkdir()
    for name in contents:
        (dest / name).write_text("{}")
    proc = fetch_cli("--verify", str(dest))
    assert proc.returncode == 1, proc.stdout
    assert "nothing to verify" in proc.stdout and "NOT verified" in proc.stdout
    assert "--repair" not in proc.stdout  # there is no manifest to repair from


@pytest.mark.parametrize(("where", "fault", "said"), [
    ("info", "garbage", "not the Hub's API"),
    ("info", "missing", "not the Hub's API"),
    ("tree", "garbage", "not the Hub's API"),
    ("tree", "missing", "lists no files"),
    ("info", "500", "HTTP 500"),
])
def test_a_hub_answering_garbage_is_a_sentence(fetch_cli, hub, tmp_path, where, fault, said):
    hub.faults[where] = fault
    dest = tmp_path / "x"
    proc = fetch_cli("org/tiny", "--local-dir", str(dest))
    assert proc.returncode == 1 and said in proc.stderr, proc.stderr
    assert "unexpected error" not in proc.stderr and not dest.exists()


def test_a_stalled_hub_is_cut_at_the_timeout(fetch_cli, hub, tmp_path):
    hub.faults["info"] = "hang"
    started = time.monotonic()
    proc = fetch_cli("org/tiny", "--local-dir", str(tmp_path / "x"), "--timeout", "2", "--deadline", "60")
    assert proc.returncode == 1 and "unexpected error" not in proc.stderr, proc.stderr
    assert time.monotonic() - started < 45  # seconds, not the Hub's 30 s hang per retry


@pytest.mark.parametrize("where", ["tree", "file:model-00001-of-00002.safetensors"])
def test_the_deadline_bounds_the_whole_fetch_and_says_so(fetch_cli, hub, tmp_path, where):
    hub.faults[where] = "hang"
    started = time.monotonic()
    proc = fetch_cli("org/tiny", "--local-dir", str(tmp_path / "x"), "--deadline", "4")
    assert proc.returncode == 1 and "did not finish within its --deadline of 4 s" in proc.stderr, proc.stderr
    assert time.monotonic() - started < 25


def test_ctrl_c_stops_a_fetch_at_once_and_says_what_is_kept(hub, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from tests.conftest import REPO

    hub.faults["file:model-00001-of-00002.safetensors"] = "hang"
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": "",
           "HF_HUB_DISABLE_TELEMETRY": "1"}
    # as at a terminal: a shell starts background jobs (a CI script's `make test &`, nohup) with
    # SIGINT ignored, and a child inherits that, so the test restores the default disposition
    proc = subprocess.Popen([sys.executable, "-m", "glmctl", "fetch", "org/tiny", "--local-dir", str(tmp_path / "x")],
                            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not _gets(hub, "model-00001") and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert time.monotonic() - sent < 5
    assert "interrupted" in err and "resume" in err


def test_an_unaccepted_licence_is_refused_before_the_network(fetch_cli, tmp_path):
    proc = fetch_cli("dflash2", "--local-dir", str(tmp_path / "d"), env={"HF_ENDPOINT": _dead_endpoint()})
    assert proc.returncode == 2 and "--accept-license dflash2-cc-by-nc-nd-4.0" in proc.stderr, proc.stderr
    assert "cannot reach" not in proc.stderr and "GLMCTL_DEBUG" not in proc.stderr
