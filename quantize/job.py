"""An output checkpoint built in a hidden directory beside DST and renamed into place when complete.

    DST.parent/.DST.NAME.KIND-partial/       the work in progress (never looks like a checkpoint:
        glmctl-job.json                      config.json and the index are written last)
        <unit>.part                          the unit (shard, layer, ...) being written now
        <unit>                               finished units, each fsynced before it is recorded
    DST/                                     appears only by rename, after everything is written

The job file (`glmctl-job.json`, exllamav3's idea) records the converter's settings, a fingerprint
of the source, and every finished unit with its size and SHA-256. `--resume` skips the finished
units whose file still hashes as recorded (a unit damaged since is converted again, and said so)
and refuses when the settings or the source differ; without `--resume` an existing partial
directory is an error (it may hold hours of work) unless `--force` discards it. Converters share
this: the FP8 converter's units are shards, the EXL3 converter's may be layers.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from glmctl.errors import GlmctlError, UsageError

JOB_FILE = "glmctl-job.json"
JOB_FORMAT = "glmctl-job/1"
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class OutputError(GlmctlError):
    """Writing the output failed (disk full, permissions, I/O error). Exit code 1."""


def partial_dir_for(dst: Path, kind: str) -> Path:
    return dst.parent / f".{dst.name}.{kind}-partial"


@dataclass
class ConversionJob:
    dst: Path
    kind: str
    settings: dict
    source_fingerprint: str
    finished: dict[str, dict] = field(default_factory=dict)
    resumed_units: int = 0
    redone_units: list[str] = field(default_factory=list)
    """Units a resume found changed since they were recorded (size or hash): converted again."""

    @property
    def work(self) -> Path:
        return partial_dir_for(self.dst, self.kind)

    # -- starting ---------------------------------------------------------------------------------
    @classmethod
    def start(cls, dst: Path, kind: str, settings: dict, source_fingerprint: str, *,
              force: bool, resume: bool) -> ConversionJob:
        """Check DST, then create the partial directory or reopen it for `resume`."""
        dst = Path(dst).absolute()
        if dst.exists() and not dst.is_dir():
            raise UsageError(f"DST {dst} exists and is not a directory", hint="choose another path")
        if dst.is_dir() and any(dst.iterdir()) and not force:
            raise UsageError(f"DST {dst} exists and is not empty",
                             hint="pass --force to replace it once the new checkpoint is complete, "
                                  "or choose another path")
        job = cls(dst, kind, settings, source_fingerprint)
        work = job.work
        if work.exists():
            if resume:
                job._load_for_resume()
                return job
            if not force:
                raise UsageError(
                    f"an unfinished {kind} conversion into {dst} exists ({work})",
                    hint="pass --resume to continue it, or --force to discard it and start over")
            shutil.rmtree(work)
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            work.mkdir()
        except OSError as exc:
            raise job.io_error(exc, f"creating {work}") from exc
        job._save()
        return job

    def _load_for_resume(self) -> None:
        path = self.work / JOB_FILE
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise UsageError(f"cannot resume: {path} is missing or unreadable ({exc})",
                             hint="pass --force instead of --resume to start over") from exc
        if saved.get("format") != JOB_FORMAT or saved.get("kind") != self.kind:
            raise UsageError(f"cannot resume: {path} is not a {self.kind} job of this glmctl",
                             hint="pass --force instead of --resume to start over")
        changed = [
            f"{key}: was {saved['settings'].get(key)!r}, now {value!r}"
            for key, value in self.settings.items() if saved["settings"].get(key) != value
        ] + [f"{key}: was {value!r}, now unset" for key, value in saved["settings"].items()
             if key not in self.settings]
        if changed:
            raise UsageError("refusing to resume with different settings (" + "; ".join(changed) + ")",
                             hint="rerun with the original settings, or pass --force instead of "
                                  "--resume to discard the partial conversion and start over")
        if saved.get("source_fingerprint") != self.source_fingerprint:
            raise UsageError("refusing to resume: the source checkpoint changed since the partial "
                             "conversion began (config, index, or a shard's size or time)",
                             hint="pass --force instead of --resume to start over from the current source")
        # A unit counts as finished only if its file is still there, of the recorded size and hash.
        for unit, info in saved.get("finished", {}).items():
            f = self.work / unit
            if f.is_file() and f.stat().st_size == info.get("bytes") and info.get("sha256") == _sha256(f):
                self.finished[unit] = info
            else:
                self.redone_units.append(unit)
                f.unlink(missing_ok=True)
        self.resumed_units = len(self.finished)
        for stale in self.work.glob("*.part"):
            stale.unlink()
        self._save()

    # -- writing ----------------------------------------------------------------------------------
    def is_finished(self, unit: str) -> bool:
        return unit in self.finished

    @contextlib.contextmanager
    def unit(self, name: str) -> Iterator[Path]:
        """Yield a temp path for unit `name`; on success rename it to its final name and record it.

        The body must close (and fsync) the file before returning. Disk-full and other OS errors
        become `OutputError` with the fix; the half-written file is removed either way.
        """
        tmp = self.work / f"{name}.part"
        final = self.work / name
        try:
            yield tmp
            digest = _sha256(tmp)  # read back from the page cache: what a resume will compare
            os.replace(tmp, final)
            self.finished[name] = {"bytes": final.stat().st_size, "sha256": digest}
            self._save()
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise self.io_error(exc, f"writing {name}") from exc
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def io_error(self, exc: OSError, doing: str) -> OutputError:
        if exc.errno in _DISK_FULL:
            free = _free_bytes(self.dst.parent)
            return OutputError(
                f"disk full while {doing} in {self.work} ({_gib(free)} free)",
                hint="free space or choose a DST on a larger filesystem, then rerun the same command "
                     "with --resume (finished shards are kept)")
        return OutputError(f"{doing} in {self.work} failed: {exc.strerror or exc}",
                           hint="fix the cause, then rerun the same command with --resume")

    def check_space(self, bytes_needed: int) -> None:
        free = _free_bytes(self.dst.parent)
        if bytes_needed > free:
            raise OutputError(
                f"not enough disk space for the output: it needs {_gib(bytes_needed)} more, "
                f"{self.dst.parent} has {_gib(free)} free",
                hint="free space or choose a DST on a larger filesystem")

    def write_file(self, rel: str | Path, data: bytes) -> None:
        path = self.work / rel
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _write_synced(path, data)
        except OSError as exc:
            raise self.io_error(exc, f"writing {rel}") from exc

    def copy_file(self, src: Path, rel: Path) -> None:
        path = self.work / rel
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, path)
        except OSError as exc:
            raise self.io_error(exc, f"copying {rel}") from exc

    def finalize(self) -> Path:
        """Drop the job file and move the finished directory to DST (replacing what was there)."""
        try:
            (self.work / JOB_FILE).unlink()
            _fsync_dir(self.work)
            if self.dst.exists():
                shutil.rmtree(self.dst)  # empty, or --force: replaced only now that the new one is whole
            os.replace(self.work, self.dst)
            _fsync_dir(self.dst.parent)
        except OSError as exc:
            raise self.io_error(exc, f"moving the finished checkpoint to {self.dst}") from exc
        return self.dst

    def _save(self) -> None:
        doc = {"format": JOB_FORMAT, "kind": self.kind, "settings": self.settings,
               "source_fingerprint": self.source_fingerprint, "finished": self.finished}
        try:
            tmp = self.work / f"{JOB_FILE}.tmp"
            _write_synced(tmp, (json.dumps(doc, indent=2) + "\n").encode())
            os.replace(tmp, self.work / JOB_FILE)
        except OSError as exc:
            raise self.io_error(exc, f"recording progress in {JOB_FILE}") from exc


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _free_bytes(path: Path) -> int:
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
