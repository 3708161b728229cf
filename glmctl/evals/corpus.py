"""Source text for the checks: a fixed slice of Python's own standard library, or the user's files.

The default text is the same on every machine that runs the same Python minor version: the files
below, read from the interpreter's stdlib directory, in this order, each after a one-line header.
They were picked because each has been a single module file (not a package) since 3.8 and none is
generated at build time. The text's SHA-256 and the Python version go into every result, and
comparisons refuse to pair results whose texts differ.
"""

from __future__ import annotations

import hashlib
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from glmctl.errors import UsageError

# Order matters: perplexity scores a prefix of this text; haystacks cycle through all of it.
STDLIB_FILES = (
    "textwrap.py", "heapq.py", "shlex.py", "fractions.py", "bisect.py", "csv.py", "calendar.py",
    "functools.py", "statistics.py", "dataclasses.py", "configparser.py", "ast.py", "difflib.py",
    "argparse.py", "subprocess.py", "tarfile.py", "enum.py", "typing.py", "inspect.py", "pickle.py",
    "locale.py", "gettext.py", "tokenize.py", "_pydecimal.py",
)
TEXT_SUFFIXES = {".py", ".md", ".txt", ".rst", ".c", ".h", ".cc", ".cpp", ".cu", ".rs", ".go", ".js",
                 ".ts", ".java", ".sh", ".yaml", ".yml", ".toml", ".json", ".jsonl"}


@dataclass(frozen=True)
class SourceText:
    text: str
    origin: str  # "python-stdlib" or "files"
    files: tuple[str, ...]
    python_version: str | None  # set for the stdlib text: it is what makes the text reproducible

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    def describe(self) -> str:
        if self.origin == "python-stdlib":
            return f"Python {self.python_version} standard library ({len(self.files)} files from {self.files[0]})"
        return f"{len(self.files)} file(s) from {self.files[0]}" if self.files else "no files"


def _header(name: str) -> str:
    return f"# ---- {name} ----\n"


def stdlib_text() -> SourceText:
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, found = [], []
    for name in STDLIB_FILES:
        path = root / name
        if not path.is_file():  # a trimmed Python install; the hash and file list record it
            continue
        parts.append(_header(name) + path.read_text(encoding="utf-8"))
        found.append(name)
    if not found:
        raise UsageError(f"none of the standard-library source files is present under {root}",
                         hint="pass text files or directories explicitly")
    return SourceText("".join(parts), "python-stdlib", tuple(found), platform.python_version())


def files_text(paths: list[Path]) -> SourceText:
    """The given files, and the text files under the given directories, in sorted order."""
    chosen: list[Path] = []
    for path in paths:
        if path.is_dir():
            chosen.extend(sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES))
        elif path.is_file():
            chosen.append(path)
        else:
            raise UsageError(f"{path} does not exist")
    if not chosen:
        raise UsageError(f"no text files under {', '.join(map(str, paths))}",
                         hint=f"files with these suffixes are read: {' '.join(sorted(TEXT_SUFFIXES))}")
    parts = []
    for path in chosen:
        try:
            parts.append(_header(str(path)) + path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            raise UsageError(f"{path} is not UTF-8 text ({exc.reason})") from exc
    return SourceText("".join(parts), "files", tuple(str(p) for p in chosen), None)


def load_text(paths: list[Path] | None) -> SourceText:
    return files_text(paths) if paths else stdlib_text()


def read_prompt_dir(directory: Path) -> list[tuple[str, str]]:
    """(name, text) of every text file under `directory`: real prompts for the bench."""
    if not directory.is_dir():
        raise UsageError(f"--prompts {directory} is not a directory")
    source = files_text([directory])
    return [(name, Path(name).read_text(encoding="utf-8")) for name in source.files]
