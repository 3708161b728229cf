"""The host segment the TP ranks of one node share: POSIX shared memory, created once, per-rank slots.

Name: `glmctl-coll-<session>-<creator pid>` in /dev/shm (`GLMCTL_SHM_DIR` overrides). Rank 0
creates it under `<name>.init`, writes the header, and renames it into place, so nobody ever maps a
half-written header. Every rank maps it and registers it with CUDA; once all have (a host barrier
in the header), rank 0 unlinks the name: the memory lives exactly as long as some rank maps it, so a
crash after start-up leaks nothing. A crash during start-up can leave a name behind; the next
creator removes every `glmctl-coll-*-<pid>` whose creator process is gone (`sweep_stale`).

Layout (bytes):
    0       header words (uint32): identity, abort word, per-rank host blocks (pid, state, barrier
            generation, capture count and digest)
    8192    GPU-written words, one 128-byte line per rank: status (+0), the direct path's epoch
            (+8), the fence word (+16: a stream memory write whose only job is its fence) and
            progress (+64)
    16384   flags, one 64-byte line per (barrier, source rank, destination rank)
    D       direct-path flags (D = `direct_flags_offset(world)`): one 64-byte line per (round,
            destination rank), word j of it written by source rank j (a reader polls one line);
            round 0 announces the payload, round 1 a two-shot call's reduced chunk
    H       data area (H = `header_bytes(world)`, a multiple of 64 KiB): world slots of `capacity`
    ...     result area: `capacity` bytes
    ...     direct area: LL region, then native region, each 2 parities x world slots of
            `direct_capacity` bytes (the direct path's payloads: their own region, so they never
            race the barrier paths' slots; LL words and native payloads apart, so no native byte
            pattern is ever read as a current LL word)
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from glmctl import switches
from glmctl.collectives.collective_errors import PeerLostError, SegmentError

MAGIC = 0x474C4D43_4F4C4C31  # "GLMCOLL1"
VERSION = 5  # 5: direct-path flag rounds, LL and native regions, the fence word
MAX_WORLD = 16
BARRIERS = 3
FLAGS = BARRIERS  # flag ids: the barriers
DIRECT = FLAGS  # the id the status word uses while a direct-path kernel waits (it has no memop flag)
DIRECT_PROGRAMS = 16  # programs (CTAs) of every direct-path kernel (each keeps its own epoch)
DIRECT_ROUNDS = 2  # flag rounds of a direct call: the payload, a two-shot's reduced chunk
GPU_WORDS_OFFSET = 8192
FLAGS_OFFSET = 16384
HEADER_ALIGN = 65536
PREFIX = "glmctl-coll-"

# header word indices
W_MAGIC_LO, W_MAGIC_HI, W_VERSION, W_WORLD, W_CAP_LO, W_CAP_HI, W_CREATOR = range(7)
W_ABORT, W_ABORT_REASON = 8, 9
RANK_BLOCK_WORD, RANK_BLOCK_WORDS = 64, 16
R_PID, R_STATE, R_GEN, R_CAPTURE_COUNT, R_CAPTURE_DIGEST = range(5)

STATE_EMPTY, STATE_ATTACHED, STATE_CLOSED = 0, 1, 2
REASONS = {1: "exited", 2: "stopped making progress", 3: "closed its communicator", 4: "failed"}


def shm_dir() -> Path:
    return switches.read("GLMCTL_SHM_DIR")


def sanitize_session(session: str) -> str:
    clean = re.sub(r"[^A-Za-z0-9_.]", "_", session)[:80]
    if not clean:
        raise SegmentError("the collectives group id is empty")
    return clean


def pid_alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, not yet reaped by its parent) counts as gone."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except PermissionError:
        return True


def sweep_stale(directory: Path | None = None) -> list[str]:
    """Unlink segments (finished or half-made) whose creator process no longer runs."""
    directory = directory or shm_dir()
    removed = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        m = re.fullmatch(re.escape(PREFIX) + r".+-(\d+)(\.init)?", name)
        if m and not pid_alive(int(m.group(1))):
            try:
                os.unlink(directory / name)
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


def direct_flags_offset(world: int) -> int:
    return FLAGS_OFFSET + FLAGS * world * world * 64


def header_bytes(world: int) -> int:
    flags_end = direct_flags_offset(world) + DIRECT_ROUNDS * world * 64
    return -(-flags_end // HEADER_ALIGN) * HEADER_ALIGN


def segment_bytes(world: int, capacity: int, direct_capacity: int = 0) -> int:
    return header_bytes(world) + (world + 1) * capacity + 4 * world * direct_capacity


class SharedSegment:
    """One mapping of the segment. CPU-side access to header words; offsets for the GPU side."""

    def __init__(self, path: Path, fd: int, mm: mmap.mmap, world: int, capacity: int, rank: int,
                 direct_capacity: int = 0):
        self.path, self._fd, self._mm = path, fd, mm
        self.world, self.capacity, self.rank = world, capacity, rank
        self.direct_capacity = direct_capacity
        self.size = segment_bytes(world, capacity, direct_capacity)
        self.words = np.frombuffer(mm, dtype=np.uint32)  # the whole segment as 32-bit words
        self._anchor = ctypes.c_char.from_buffer(mm)  # pins the mapping's address for CUDA
        self.address = ctypes.addressof(self._anchor)
        self.unlinked = False

    # ---- creation and attachment --------------------------------------------------------------
    @classmethod
    def create(cls, session: str, world: int, capacity: int, direct_capacity: int = 0) -> SharedSegment:
        if not 2 <= world <= MAX_WORLD:
            raise SegmentError(f"world size {world} is outside 2..{MAX_WORLD}")
        directory = shm_dir()
        sweep_stale(directory)
        name = f"{PREFIX}{sanitize_session(session)}-{os.getpid()}"
        final, tmp = directory / name, directory / (name + ".init")
        size = segment_bytes(world, capacity, direct_capacity)
        _check_space(directory, size)
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise SegmentError(f"cannot create shared segment {tmp}: {exc}") from exc
        try:
            os.ftruncate(fd, size)
            try:
                os.posix_fallocate(fd, 0, size)  # fail now, not with SIGBUS on first touch
            except OSError as exc:
                raise SegmentError(
                    f"{directory} cannot hold the {size / 2**20:.0f} MiB collectives segment ({exc})",
                    hint="enlarge /dev/shm (docker: --shm-size), lower the collectives' max message "
                    "size, or point GLMCTL_SHM_DIR at a larger tmpfs",
                ) from exc
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        seg = cls(final, fd, mm, world, capacity, rank=0, direct_capacity=direct_capacity)
        w = seg.words
        w[W_MAGIC_LO], w[W_MAGIC_HI] = MAGIC & 0xFFFFFFFF, MAGIC >> 32
        w[W_VERSION], w[W_WORLD] = VERSION, world
        w[W_CAP_LO], w[W_CAP_HI] = capacity & 0xFFFFFFFF, capacity >> 32
        w[W_CREATOR] = os.getpid()
        seg.set_rank_word(0, R_PID, os.getpid())
        seg.set_rank_word(0, R_STATE, STATE_ATTACHED)
        os.rename(tmp, final)
        return seg

    @classmethod
    def attach(cls, session: str, rank: int, world: int, capacity: int, timeout_s: float,
               name: str | None = None, direct_capacity: int = 0) -> SharedSegment:
        """Find rank 0's segment (polling until `timeout_s`), map it and check it matches."""
        directory = shm_dir()
        deadline = time.monotonic() + timeout_s
        pattern = re.compile(re.escape(PREFIX + sanitize_session(session)) + r"-(\d+)")
        while True:
            candidates = [name] if name else sorted(os.listdir(directory))
            for cand in candidates:
                m = pattern.fullmatch(cand)
                if m and pid_alive(int(m.group(1))):
                    seg = cls._map(directory / cand, rank, world, capacity, direct_capacity)
                    if seg is not None:
                        return seg
            if time.monotonic() > deadline:
                raise SegmentError(
                    f"rank {rank} found no collectives segment for group '{session}' in {directory} "
                    f"after {timeout_s:.0f} s",
                    hint="rank 0 did not start, or the ranks were given different group ids",
                )
            time.sleep(0.005)

    @classmethod
    def _map(cls, path: Path, rank: int, world: int, capacity: int,
             direct_capacity: int) -> SharedSegment | None:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return None
        size = segment_bytes(world, capacity, direct_capacity)
        actual = os.fstat(fd).st_size
        if actual != size:
            os.close(fd)
            raise SegmentError(
                f"segment {path} has {actual} bytes, rank {rank} expects {size}",
                hint="every rank must pass the same world size and max message size",
            )
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        seg = cls(path, fd, mm, world, capacity, rank, direct_capacity)
        w = seg.words
        magic = int(w[W_MAGIC_LO]) | (int(w[W_MAGIC_HI]) << 32)
        cap = int(w[W_CAP_LO]) | (int(w[W_CAP_HI]) << 32)
        if magic != MAGIC or w[W_VERSION] != VERSION or w[W_WORLD] != world or cap != capacity:
            seg.close()
            raise SegmentError(
                f"segment {path} does not match rank {rank} (world {int(w[W_WORLD])} vs {world}, "
                f"capacity {cap} vs {capacity}, version {int(w[W_VERSION])} vs {VERSION})",
                hint="every rank must run the same glmctl with the same world size and max size",
            )
        if seg.rank_word(rank, R_STATE) != STATE_EMPTY:
            seg.close()
            raise SegmentError(f"rank {rank} is already attached to {path}",
                               hint="two processes were given the same rank")
        seg.set_rank_word(rank, R_PID, os.getpid())
        seg.set_rank_word(rank, R_STATE, STATE_ATTACHED)
        return seg

    # ---- header words -------------------------------------------------------------------------
    def rank_word(self, rank: int, field: int) -> int:
        return int(self.words[RANK_BLOCK_WORD + rank * RANK_BLOCK_WORDS + field])

    def set_rank_word(self, rank: int, field: int, value: int) -> None:
        self.words[RANK_BLOCK_WORD + rank * RANK_BLOCK_WORDS + field] = value & 0xFFFFFFFF

    def word_at(self, offset: int) -> int:
        return int(self.words[offset // 4])

    def set_word_at(self, offset: int, value: int) -> None:
        self.words[offset // 4] = value & 0xFFFFFFFF

    @property
    def abort(self) -> tuple[int, int] | None:
        """(culprit rank, reason code) once any rank declared the group broken."""
        a = int(self.words[W_ABORT])
        return None if a == 0 else (a - 1, int(self.words[W_ABORT_REASON]))

    def set_abort(self, culprit: int, reason: int) -> None:
        if self.words[W_ABORT] == 0:
            self.words[W_ABORT_REASON] = reason
            self.words[W_ABORT] = culprit + 1

    # ---- offsets of GPU-visible words and areas -----------------------------------------------
    @staticmethod
    def status_offset(rank: int) -> int:
        return GPU_WORDS_OFFSET + 128 * rank

    @staticmethod
    def direct_epoch_offset(rank: int) -> int:
        return GPU_WORDS_OFFSET + 128 * rank + 8

    @staticmethod
    def fence_offset(rank: int) -> int:
        return GPU_WORDS_OFFSET + 128 * rank + 16

    @staticmethod
    def progress_offset(rank: int) -> int:
        return GPU_WORDS_OFFSET + 128 * rank + 64

    def direct_flag_offset(self, round_: int, dst: int) -> int:
        """The line rank `dst` polls in a direct call's flag round; source j writes its word j."""
        return direct_flags_offset(self.world) + (round_ * self.world + dst) * 64

    def flag_offset(self, flag: int, src: int, dst: int) -> int:
        """Flag ids: barrier b is `b`."""
        return FLAGS_OFFSET + ((flag * self.world + src) * self.world + dst) * 64

    @property
    def data_offset(self) -> int:
        return header_bytes(self.world)

    @property
    def result_offset(self) -> int:
        return self.data_offset + self.world * self.capacity

    @property
    def direct_offset(self) -> int:
        """The LL region; the native region follows it (`direct_native_offset`)."""
        return self.result_offset + self.capacity

    @property
    def direct_native_offset(self) -> int:
        return self.direct_offset + 2 * self.world * self.direct_capacity

    def view(self, rank: int) -> SharedSegment:
        """Another rank's handle on this same mapping (ranks as threads of one process: one
        mapping, registered with CUDA once). Closing a view leaves the mapping alone."""
        v = object.__new__(SharedSegment)
        v.__dict__.update(self.__dict__)
        v.rank, v._owner = rank, self
        return v

    # ---- rendezvous ---------------------------------------------------------------------------
    def host_barrier(self, timeout_s: float, what: str,
                     on_wait: Callable[[], None] | None = None) -> None:
        """Block until every rank reached the same barrier generation; name the ranks that did not."""
        gen = self.rank_word(self.rank, R_GEN) + 1
        self.set_rank_word(self.rank, R_GEN, gen)
        deadline = time.monotonic() + timeout_s
        while True:
            missing = [j for j in range(self.world) if self.rank_word(j, R_GEN) < gen]
            if not missing:
                return
            for j in missing:
                pid = self.rank_word(j, R_PID)
                if pid and not pid_alive(pid):
                    raise PeerLostError(f"rank {j} (pid {pid}) exited before {what}", rank=j)
                if self.rank_word(j, R_STATE) == STATE_CLOSED:
                    raise PeerLostError(f"rank {j} closed its communicator before {what}", rank=j)
            if on_wait is not None:
                on_wait()
            if time.monotonic() > deadline:
                j = missing[0]
                raise PeerLostError(
                    f"rank {self.rank} waited {timeout_s:.0f} s for rank(s) {missing} at {what}",
                    hint="a rank is stuck or was started with a different group id", rank=j)
            time.sleep(0.0005)

    # ---- teardown -----------------------------------------------------------------------------
    def unlink(self) -> None:
        if getattr(self, "_owner", None) is not None:
            return self._owner.unlink()
        if not self.unlinked:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.unlinked = True

    def close(self) -> None:
        if self._mm is None or getattr(self, "_owner", None) is not None:
            return
        self.words = None
        self._anchor = None
        try:
            self._mm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the process
        os.close(self._fd)
        self._mm = None


def _check_space(directory: Path, size: int) -> None:
    try:
        st = os.statvfs(directory)
    except FileNotFoundError as exc:
        raise SegmentError(f"{directory} does not exist",
                           hint="point GLMCTL_SHM_DIR at a tmpfs directory") from exc
    free = st.f_bavail * st.f_frsize
    if free < size:
        raise SegmentError(
            f"{directory} has {free / 2**20:.0f} MiB free, the collectives segment needs "
            f"{size / 2**20:.0f} MiB",
            hint="enlarge /dev/shm (docker: --shm-size), lower the max message size, or set "
            "GLMCTL_SHM_DIR to a larger tmpfs",
        )
