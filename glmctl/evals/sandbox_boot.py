"""The first code of a sandboxed program (glmctl/evals/sandbox.py starts it; it is not imported).

Run as `python -I -c "$(cat sandbox_boot.py)" CONFIG_JSON` in the program's own directory and session. Before
the program's first line it: sets the resource limits, drops root to the sandbox's own user id
(root ignores RLIMIT_NPROC, a user id of its own makes that limit count only this program's
processes; it keeps the right to read, not to write), refuses writes outside the directory (an audit hook, so a stray `open('/x', 'w')` or
`shutil.rmtree` fails the program, not the machine), then runs the program as `__main__`. The
outcome goes to the parent through a pipe of its own (`status_fd`): "passed" only when the program
ran to its end, else the exception's type. An exit of any kind before the end (`sys.exit(0)` in
a completion, `os._exit`) is therefore never a pass.

Only the standard library is imported here: `-I` keeps glmctl, the user's site and PYTHON*
variables out of the program's process.
"""

import json
import os
import resource
import sys
import traceback

PR_SET_KEEPCAPS, PR_SET_NO_NEW_PRIVS = 8, 38  # <linux/prctl.h>
CAP_DAC_READ_SEARCH = 2  # <linux/capability.h>: read any file, search any directory; no writes
LINUX_CAPABILITY_VERSION_3 = 0x20080522
WRITE_EVENTS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link",
                "os.symlink", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "os.chflags"}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _limit(name: str, value: int) -> None:
    kind = getattr(resource, name)
    _, hard = resource.getrlimit(kind)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(kind, (value, value))


def _drop_root(uid: int) -> None:
    """Become `uid`, keeping only CAP_DAC_READ_SEARCH: the interpreter may live where only root can
    read (a Python under /root), and a non-root user id is what makes RLIMIT_NPROC apply. Without
    the means (no CAP_SETUID: a container), the program runs as root, its forks bounded by the
    deadline alone."""
    if os.geteuid() != 0:
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0) != 0:
        return
    try:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    except OSError:
        return

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    keep = 1 << CAP_DAC_READ_SEARCH
    data = (Data * 2)(Data(keep, keep, 0), Data(0, 0, 0))
    if libc.capset(ctypes.byref(Header(LINUX_CAPABILITY_VERSION_3, 0)), data) != 0:
        raise SystemExit("sandbox: cannot set capabilities after dropping root")
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # no setuid binary gives root back


def _guard_writes(root: str) -> None:
    root = os.path.realpath(root)

    def inside(path) -> bool:
        if isinstance(path, int):  # an fd the program already holds
            return True
        full = os.path.realpath(os.path.join(root, os.fsdecode(path)))
        return full == root or full.startswith(root + os.sep) or full == os.devnull

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                      (isinstance(flags, int) and flags & WRITE_FLAGS)
            if writing and path is not None and not inside(path):
                raise PermissionError(f"sandbox: no writing outside the program's directory ({path!r})")
        elif event in WRITE_EVENTS:
            for path in args[:2] if event in ("os.rename", "os.link", "os.symlink", "shutil.move") else args[:1]:
                if path is not None and not inside(path):
                    raise PermissionError(f"sandbox: no changes outside the program's directory ({path!r})")

    sys.addaudithook(hook)


def _report(fd: int, outcome: str) -> None:
    os.write(fd, outcome.encode()[:200])
    os.close(fd)


def main() -> None:
    config = json.loads(sys.argv[1])
    status_fd = config["status_fd"]
    os.set_inheritable(status_fd, False)
    limits = config["limits"]
    _limit("RLIMIT_AS", limits["memory_bytes"])
    _limit("RLIMIT_CPU", limits["cpu_s"])
    _limit("RLIMIT_NOFILE", limits["open_files"])
    _limit("RLIMIT_FSIZE", limits["file_bytes"])
    _limit("RLIMIT_CORE", 0)
    _drop_root(config["uid"])
    _limit("RLIMIT_NPROC", limits["processes"])  # after the drop: it counts the new user's processes
    sys.dont_write_bytecode = True
    sys.argv = [config["program"]]
    _guard_writes(os.getcwd())
    import runpy

    try:
        runpy.run_path(config["program"], run_name="__main__")
    except SystemExit as exc:
        _report(status_fd, f"SystemExit({exc.code!r})")
        os._exit(1)
    except BaseException as exc:  # the program's failure: report its type, exit 1
        traceback.print_exc(limit=-3)
        sys.stderr.flush()
        _report(status_fd, type(exc).__name__)
        os._exit(1)
    _report(status_fd, "passed")


if __name__ == "__main__":  # `-c` runs it as __main__ too
    main()
