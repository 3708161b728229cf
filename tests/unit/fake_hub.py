"""A local stand-in for the Hugging Face Hub, for tests only (a test fixture, not a product).

It serves repositories laid out on disk (`ROOT/OWNER/NAME/<files>`) through the subset of the
Hub's HTTP API that huggingface_hub's download path uses:

  GET  /api/models/OWNER/NAME[/revision/REV]      repo info (sha = the fake commit id)
  GET  /api/models/OWNER/NAME/tree/REV?recursive  file listing: size, git blob oid, LFS sha256
  HEAD/GET /OWNER/NAME/resolve/REV/PATH           file bytes with X-Repo-Commit, ETag,
                                                  X-Linked-Etag/X-Linked-Size; Range requests
Errors are answered with the Hub's X-Error-Code header (RepoNotFound, GatedRepo,
RevisionNotFound, EntryNotFound), so huggingface_hub raises its real exception types.

Knobs for tests: `gated` repo ids answer GatedRepo; `cut_after[path] = [N, times]` makes the
next `times` whole-file GETs stop after N bytes (interrupted transfers; ranged GETs are served
in full); `faults` maps "info" (repo info), "tree" (the listing) or "file:PATH" to "500",
"garbage" (200, not JSON), "missing" (200, an empty JSON object) or "hang" (no answer for
`hang_s`); `requests` records (method, path, Range header).
Files whose name ends in .safetensors are served as LFS files (sha256 oid), the rest as git blobs.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def git_oid(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()  # noqa: S324


class FakeHub:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.gated: set[str] = set()
        # path in repo -> [bytes served before the connection drops, how many more times to drop]
        self.cut_after: dict[str, list[int]] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        self.faults: dict[str, str] = {}
        self.hang_s = 30.0
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FakeHub:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep test output clean
                pass

            def _error(self, status: int, code: str) -> None:
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _json(self, payload) -> None:
                body = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _repo(self, owner: str, name: str) -> Path | None:
                repo = f"{owner}/{name}"
                if repo in hub.gated:
                    self._error(403, "GatedRepo")
                    return None
                path = hub.root / owner / name
                if not path.is_dir():
                    self._error(404, "RepoNotFound")
                    return None
                return path

            def _fault(self, key: str) -> bool:
                fault = hub.faults.get(key)
                if fault == "500":
                    self._error(500, "InternalError")
                elif fault == "garbage":
                    body = b"<html>upstream error</html>"
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                elif fault == "missing":
                    self._json({})
                elif fault == "hang":
                    import time

                    time.sleep(hub.hang_s)
                    self.close_connection = True
                else:
                    return False
                return True

            def do_HEAD(self):
                self._route(head=True)

            def do_GET(self):
                self._route(head=False)

            def _route(self, head: bool) -> None:
                url = urlparse(self.path)
                parts = [unquote(p) for p in url.path.strip("/").split("/")]
                hub.requests.append((self.command, url.path, self.headers.get("Range")))
                if parts[:2] == ["api", "models"] and len(parts) == 4:  # repo info at the default branch
                    if self._fault("info"):
                        return
                    if self._repo(parts[2], parts[3]) is not None:
                        self._json({"id": f"{parts[2]}/{parts[3]}", "sha": COMMIT, "siblings": []})
                    return
                if parts[:2] == ["api", "models"] and len(parts) >= 6:
                    repo = self._repo(parts[2], parts[3])
                    if repo is None:
                        return
                    if parts[5] not in ("main", COMMIT):
                        return self._error(404, "RevisionNotFound")
                    if self._fault("info" if parts[4] == "revision" else "tree"):
                        return
                    if parts[4] == "revision":
                        return self._json({"id": f"{parts[2]}/{parts[3]}", "sha": COMMIT, "siblings": []})
                    if parts[4] == "tree":
                        return self._json(self._tree(repo))
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo = self._repo(parts[0], parts[1])
                    if repo is None:
                        return
                    if parts[3] not in ("main", COMMIT):
                        return self._error(404, "RevisionNotFound")
                    rel = "/".join(parts[4:])
                    if not head and self._fault(f"file:{rel}"):
                        return
                    return self._file(repo, rel, head)
                self._error(404, "EntryNotFound")

            def _tree(self, repo: Path) -> list[dict]:
                out = []
                for f in sorted(p for p in repo.rglob("*") if p.is_file()):
                    data = f.read_bytes()
                    rel = str(f.relative_to(repo))
                    entry = {"type": "file", "path": rel, "size": len(data), "oid": git_oid(data)}
                    if rel.endswith(".safetensors"):
                        entry["size"] = 134  # a pointer file's size, like the Hub reports for LFS
                        entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                    out.append(entry)
                return out

            def _file(self, repo: Path, rel: str, head: bool) -> None:
                path = repo / rel
                if not path.is_file():
                    return self._error(404, "EntryNotFound")
                data = path.read_bytes()
                etag = hashlib.sha256(data).hexdigest() if rel.endswith(".safetensors") else git_oid(data)
                start = 0
                rng = self.headers.get("Range")
                if rng and rng.startswith("bytes="):
                    start = int(rng[6:].split("-")[0] or 0)
                body = data[start:]
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", f'"{etag}"')
                if rel.endswith(".safetensors"):
                    self.send_header("X-Linked-Etag", f'"{etag}"')
                    self.send_header("X-Linked-Size", str(len(data)))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                if head:
                    return
                cut = hub.cut_after.get(rel) if not start else None
                if cut is not None and cut[1] > 0:
                    cut[1] -= 1
                    self.wfile.write(body[: cut[0]])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)  # drop mid-body: an interrupted transfer
                    return
                self.wfile.write(body)

        return Handler
