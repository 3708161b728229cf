"""Run an untrusted Python program (a model's completion plus its tests) outside the glmctl process.

Each program gets:
- its own process, started with `python -I -c BOOT` (no PYTHON* variables, no user site, no script
  directory on sys.path) in a **new session** (so it leads a process group of its own), in a
  **fresh temporary directory** that is removed afterwards;
- an environment of a few fixed variables (PATH, LANG, HOME and TMPDIR = its directory): nothing of
  glmctl's environment, so no token or key is inherited; no inherited file descriptors but its
  stdout, stderr (files outside its directory, size-limited) and a status pipe;
- resource limits, set by sandbox_boot.py before the program's first line: address space, CPU
  seconds, open files, processes, file size, no core dumps; run as root, it drops to a user id of
  its own, because root ignores the process limit;
- a **wall-clock deadline**: past it the whole process group is killed (SIGKILL); after any end
  the group is killed again, and (when it ran under its own user id) every process of that user,
  so a forked child that outlived its parent, or left the group, does not outlive the check.

A loop, a fork bomb, a memory bomb or a write outside the directory fails that program and nothing
else. This is containment for accidents of generated code, not a security boundary against code
written to escape (that takes a container or a VM).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

BOOT = Path(__file__).with_name("sandbox_boot.py")
UID_BASE = 1_900_000_000  # sandbox user ids: far above any real account's
_uids = itertools.count()
_uid_lock = threading.Lock()
OUTPUT_TAIL = 2000  # characters of stdout/stderr kept in a result


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0
    memory_bytes: int = 1 << 30  # address space; Python itself maps ~100 MiB
    open_files: int = 64
    processes: int = 16  # under its own user id: its processes and threads together
    file_bytes: int = 16 << 20  # any one file written, stdout and stderr included
    cpu_s: int | None = None  # default: the wall deadline rounded up, plus one

    def for_boot(self) -> dict:
        d = asdict(self)
        d["cpu_s"] = self.cpu_s or math.ceil(self.wall_s) + 1
        return d


@dataclass(frozen=True)
class Outcome:
    passed: bool
    kind: str  # passed | failed (an exception: see `error`) | timeout | killed | exit
    error: str | None  # the exception's type (AssertionError, MemoryError, ...) or the signal/exit
    seconds: float
    output: str  # the tail of stderr, then stdout


@functools.cache
def _boot_source() -> str:
    # Passed with -c, so the program's user id needs no read access to glmctl's install tree.
    return BOOT.read_text(encoding="utf-8")


def _next_uid() -> int:
    with _uid_lock:
        return UID_BASE + (os.getpid() % 10_000) * 10_000 + next(_uids) % 10_000


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def processes_of(uid: int) -> list[int]:
    """Live (not zombie) processes whose real user id is `uid`. /proc/PID/status, not the owner of
    /proc/PID: a process that changed its user id is not dumpable, and its /proc entry is root's."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", encoding="ascii", errors="replace") as fh:
                fields = dict(line.split(":", 1) for line in fh if ":" in line)
        except OSError:
            continue
        if fields.get("State", "").strip().startswith("Z"):
            continue
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            found.append(int(entry.name))
    return found


def _kill_user(uid: int) -> None:
    """SIGKILL every process running as `uid` (a sandbox's own id: nothing else runs as it)."""
    for _ in range(50):  # a fork in flight can add one more; repeat until none is left
        pids = processes_of(uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


def _tail(path: Path) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(max(0, path.stat().st_size - OUTPUT_TAIL))
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""


def run_program(source: str, limits: Limits = Limits()) -> Outcome:
    """Run `source` as a program under the limits above; its outcome, never an exception of its own."""
    root = os.geteuid() == 0
    uid = _next_uid()
    workdir = Path(tempfile.mkdtemp(prefix="glmctl-sandbox-"))
    private = Path(tempfile.mkdtemp(prefix="glmctl-sandbox-io-"))  # stdout/stderr: not in its reach by path
    try:
        program = workdir / "program.py"
        program.write_text(source, encoding="utf-8")
        if root:
            os.chown(workdir, uid, uid)
            os.chown(program, uid, uid)
        env = {"PATH": os.defpath, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": str(workdir),
               "TMPDIR": str(workdir)}
        read_fd, write_fd = os.pipe()
        config = {"program": str(program), "limits": limits.for_boot(), "uid": uid, "status_fd": write_fd}
        started = time.monotonic()
        with (private / "stdout").open("wb") as out, (private / "stderr").open("wb") as err:
            try:
                proc = subprocess.Popen([sys.executable, "-I", "-c", _boot_source(), json.dumps(config)], cwd=workdir,
                                        env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                        start_new_session=True, close_fds=True, pass_fds=(write_fd,))
            finally:
                os.close(write_fd)
            timed_out = False
            try:
                proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc.pid)
                proc.wait()
            seconds = time.monotonic() - started
            _kill_group(proc.pid)  # whatever it forked and left behind in its group
            if root:
                _kill_user(uid)
        os.set_blocking(read_fd, False)
        try:
            status = os.read(read_fd, 256).decode("utf-8", "replace")
        except BlockingIOError:  # a writer escaped the sweep (non-root, left its group): no status
            status = ""
        finally:
            os.close(read_fd)
        output = (_tail(private / "stderr") + _tail(private / "stdout"))[-OUTPUT_TAIL:]
        return _classify(proc.returncode, status, timed_out, round(seconds, 3), output)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(private, ignore_errors=True)


def _classify(returncode: int, status: str, timed_out: bool, seconds: float, output: str) -> Outcome:
    if timed_out:
        return Outcome(False, "timeout", "wall-clock deadline", seconds, output)
    if returncode == 0 and status == "passed":
        return Outcome(True, "passed", None, seconds, output)
    if returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else str(-returncode)
        return Outcome(False, "killed", name, seconds, output)  # SIGXCPU: the CPU limit
    if status and status != "passed":
        return Outcome(False, "failed", status, seconds, output)
    return Outcome(False, "exit", f"exit code {returncode} before the program's end", seconds, output)
