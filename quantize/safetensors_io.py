"""The safetensors file format, read and written a slice at a time (no whole-file buffers).

Layout of a `.safetensors` file (https://github.com/huggingface/safetensors, "Format"):

    bytes [0, 8)            N, the header length, unsigned 64-bit little-endian
    bytes [8, 8 + N)        UTF-8 JSON: {"__metadata__": {str: str}, NAME: {"dtype": "BF16",
                            "shape": [rows, cols], "data_offsets": [begin, end]}, ...}; writers pad
                            it with spaces so the data starts 8-byte aligned
    bytes [8 + N, EOF)      the data section; offsets are relative to its start, tensors are
                            row-major little-endian, and (sorted by offset) they tile the section
                            with no gap and no overlap

`read_header` validates all of that against the file size, so a truncated download or a damaged
header is reported with the file name and what is wrong before any tensor is touched.
`ShardWriter` writes a header computed up front from the planned tensors, then their bytes in
order, so an output shard never has to exist in memory.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from glmctl.errors import GlmctlError

if TYPE_CHECKING:
    import torch

# Bytes per element of the dtypes safetensors names. Anything else (sub-byte FP4/FP6 packs, future
# dtypes) is still copied byte for byte; only its size-versus-shape check is skipped.
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}
FLOAT_DTYPES = ("BF16", "F16", "F32")  # what the FP8 converter accepts as input
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit


class CheckpointError(GlmctlError):
    """An input checkpoint is damaged or incomplete (missing shard, bad header, short file)."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a shard, as its header describes it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # offsets into the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ShardHeader:
    path: Path
    header_bytes: int  # N
    metadata: dict[str, str]
    tensors: dict[str, TensorEntry]  # in data order

    @property
    def data_start(self) -> int:
        return 8 + self.header_bytes

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _bad(path: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"{path.name}: {what}",
        hint=f"the file is damaged or incomplete ({path}); download it again "
             "(glmctl fetch verifies sizes and hashes)",
    )


def read_header(path: Path) -> ShardHeader:
    """Parse and validate a shard's header against the file's real size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _bad(path, f"{size} bytes long, shorter than the 8-byte header length field")
            (n,) = struct.unpack("<Q", head)
            if n == 0 or n > MAX_HEADER_BYTES:
                raise _bad(path, f"header length field says {n} bytes (must be 1..{MAX_HEADER_BYTES})")
            if 8 + n > size:
                raise _bad(path, f"header length field says {n} bytes but the file has only "
                                 f"{size - 8} after it (truncated)")
            raw = f.read(n)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(path, f"header is not valid JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise _bad(path, "header is not a JSON object")
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise _bad(path, "__metadata__ is not an object")
    entries = [_entry(path, name, spec) for name, spec in doc.items()]
    entries.sort(key=lambda e: (e.begin, e.end))
    expected = 0
    for e in entries:
        if e.begin != expected:
            what = "overlaps the previous tensor" if e.begin < expected else "leaves a gap before it"
            raise _bad(path, f"tensor {e.name!r} starts at data offset {e.begin} and {what} "
                             f"(previous tensor ends at {expected})")
        expected = e.end
    data_size = size - 8 - n
    if expected != data_size:
        state = "truncated" if expected > data_size else "has trailing bytes"
        raise _bad(path, f"the header describes {expected} bytes of tensor data but the file holds "
                         f"{data_size} ({state})")
    return ShardHeader(path, n, {str(k): str(v) for k, v in metadata.items()},
                       {e.name: e for e in entries})


def _entry(path: Path, name: str, spec) -> TensorEntry:
    if not isinstance(spec, dict):
        raise _bad(path, f"entry {name!r} is not an object")
    dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if not isinstance(dtype, str):
        raise _bad(path, f"tensor {name!r} has no dtype")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise _bad(path, f"tensor {name!r} has a malformed shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise _bad(path, f"tensor {name!r} has malformed data_offsets {offsets!r}")
    entry = TensorEntry(name, dtype, tuple(shape), offsets[0], offsets[1])
    width = DTYPE_BYTES.get(dtype)
    if width is not None and entry.numel * width != entry.nbytes:
        raise _bad(path, f"tensor {name!r} is {dtype} {list(shape)} ({entry.numel * width} bytes) "
                         f"but its data_offsets span {entry.nbytes} bytes")
    return entry


class ShardReader:
    """Reads byte ranges of one shard's tensors; use as a context manager."""

    def __init__(self, header: ShardHeader) -> None:
        self.header = header
        self._f: BinaryIO | None = None

    def __enter__(self) -> ShardReader:
        try:
            self._f = open(self.header.path, "rb", buffering=0)
        except OSError as exc:
            raise CheckpointError(f"cannot open {self.header.path}: {exc.strerror or exc}") from exc
        # A larger read-ahead window: the kernel keeps reading while the converter quantises.
        # Measured on the dev VM (bench/quantize.py, attention case): convert 0.68 -> 0.97 GB/s;
        # WILLNEED per piece did as well for converting but slowed plain reads to half.
        _advise(self._f.fileno(), 0, 0, "POSIX_FADV_SEQUENTIAL")
        return self

    def __exit__(self, *exc) -> None:
        if self._f is not None:
            self._f.close()

    def read_into(self, entry: TensorEntry, offset: int, out: torch.Tensor) -> None:
        """Fill the uint8 tensor `out` with bytes [offset, offset + len(out)) of `entry`."""
        assert self._f is not None and out.dtype.itemsize == 1 and out.is_contiguous()
        want = out.numel()
        view = memoryview(out.numpy()).cast("B")
        self._f.seek(self.header.data_start + entry.begin + offset)
        got = 0
        while got < want:
            n = self._f.readinto(view[got:])
            if not n:
                raise _bad(self.header.path, f"ended while reading tensor {entry.name!r} "
                                             "(the file shrank after its header was checked)")
            got += n

    def chunks(self, entry: TensorEntry, chunk_bytes: int) -> Iterator[memoryview]:
        """The raw bytes of `entry` in pieces of at most `chunk_bytes`, each in its own buffer (a
        `ShardWriter` may still be writing earlier pieces while later ones are read)."""
        import torch

        done = 0
        while done < entry.nbytes:
            n = min(chunk_bytes, entry.nbytes - done)
            buf = torch.empty(n, dtype=torch.uint8)
            self.read_into(entry, done, buf)
            yield memoryview(buf.numpy())
            done += n


def checkpoint_tensor_names(path: Path) -> list[str] | None:
    """Tensor names of a local checkpoint directory, from its index or else its shard headers;
    None when there are none or they cannot be read (a damaged checkpoint is the loader's to
    report)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            return list(json.loads(index.read_text())["weight_map"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        return None
    try:
        return [name for shard in shards for name in read_header(shard).tensors]
    except Exception:  # noqa: BLE001 - see above
        return None


def _advise(fd: int, offset: int, length: int, advice: str) -> None:
    """posix_fadvise where the platform has it; a hint, so failures are ignored."""
    flag = getattr(os, advice, None)
    if flag is not None:
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, offset, length, flag)


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor an output shard will hold: written in the order of the plan."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


def encode_header(tensors: list[PlannedTensor], metadata: dict[str, str]) -> bytes:
    """The 8-byte length plus the space-padded JSON header for tensors laid out in list order."""
    doc: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for t in tensors:
        doc[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


class ShardWriter:
    """Writes one shard: the header first, then each planned tensor's bytes, strictly in order.

    `write(name, data)` may be called several times per tensor (row stripes); the bytes go to the
    file from a background thread (at most `QUEUE_DEPTH` pieces waiting), so the caller can read
    and compute while the disk writes. `data` must not be modified after it is handed over. An
    I/O error in the thread (a full disk) is raised by the next `write` or by `close`; `close()`
    checks every tensor got exactly its planned byte count, then flushes and fsyncs.
    """

    QUEUE_DEPTH = 4
    SYNC_BYTES = 128 * 2**20

    def __init__(self, path: Path, tensors: list[PlannedTensor], metadata: dict[str, str]) -> None:
        self.path = path
        self._plan = tensors
        self._index = 0
        self._written = 0  # bytes of the current tensor handed over
        self._f = open(path, "wb")
        self._error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=self.QUEUE_DEPTH)
        try:
            self._f.write(encode_header(tensors, metadata))
        except BaseException:
            self._f.close()
            raise
        self._thread = threading.Thread(target=self._drain, name=f"write {path.name}", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        unsynced = 0
        while (data := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._f.write(data)
                    unsynced += memoryview(data).nbytes
                    if unsynced >= self.SYNC_BYTES:  # flush here, while the caller computes,
                        os.fdatasync(self._f.fileno())  # so that close() has little left to do
                        unsynced = 0
                except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                    self._error = exc

    def _raise_pending(self) -> None:
        if self._error is not None:
            raise self._error

    def write(self, name: str, data) -> None:
        self._raise_pending()
        while self._index < len(self._plan) and self._plan[self._index].nbytes == self._written \
                and self._plan[self._index].name != name:
            self._index, self._written = self._index + 1, 0  # previous tensor complete
        planned = self._plan[self._index] if self._index < len(self._plan) else None
        if planned is None or planned.name != name:
            raise RuntimeError(f"{self.path.name}: wrote {name!r} out of the planned order")
        n = memoryview(data).nbytes
        if self._written + n > planned.nbytes:
            raise RuntimeError(f"{self.path.name}: {name!r} got more than its {planned.nbytes} bytes")
        self._queue.put(data)
        self._written += n

    def _stop(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def close(self) -> None:
        missing = sum(t.nbytes for t in self._plan[self._index:]) - self._written
        self._stop()
        self._raise_pending()
        if missing:
            raise RuntimeError(f"{self.path.name}: closed with {missing} planned bytes unwritten")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()

    def abort(self) -> None:
        try:
            self._error = self._error or RuntimeError("aborted")  # the thread skips what is queued
            self._stop()
            self._f.close()
        except OSError:
            pass
        self.path.unlink(missing_ok=True)
