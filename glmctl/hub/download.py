"""Download an artifact from the Hugging Face Hub into a directory, then verify it.

Order of work, so that nothing is fetched that cannot be used:
  1. resolve the revision to a commit and list the files (the Hub's tree: sizes, LFS SHA-256);
  2. licence gate (the caller runs it with the listing in hand, before any byte moves);
  3. disk check: bytes still to download vs free space on the target filesystem;
  4. `huggingface_hub.snapshot_download` (parallel, resumes `.incomplete` files, its own bars);
  5. manifest written next to the files (for offline verification), then a full verify.
The token comes from huggingface_hub's usual places (HF_TOKEN, the stored login); it is never printed.

`timeout` bounds each request to the Hub and each stalled read of a download; the whole fetch is
bounded by the caller (glmctl.hub.fetching runs it under a deadline).
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import tempfile
from pathlib import Path

from pydantic import BaseModel

from glmctl.errors import GlmctlError, UsageError
from glmctl.hub.catalog import Artifact
from glmctl.hub.manifest import ExpectedFile, Manifest, now, read_manifest, write_manifest

DISK_MARGIN = 1.02  # 2% headroom for filesystem overhead and the manifest
DEFAULT_TIMEOUT_S = 60.0


class HubError(GlmctlError):
    """The Hub could not give us what was asked (network, access, missing repo)."""


class HubNotFound(UsageError):
    """The repository or revision does not exist (or is private without a token)."""


class DiskSpaceError(GlmctlError):
    """Not enough free space for what is about to be downloaded."""


class FetchPlan(BaseModel):
    artifact: str
    repo_id: str
    revision: str        # commit sha the listing came from
    requested_revision: str | None
    local_dir: str
    files: list[ExpectedFile]
    bytes_total: int
    bytes_to_download: int
    bytes_free: int


def _api():
    from huggingface_hub import HfApi

    return HfApi()


def _exception_names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


# Matched by class name: huggingface_hub 2.x raises httpx2's classes, 1.x httpx's.
UNREACHABLE = {"ConnectError", "ConnectTimeout", "OfflineModeIsEnabled", "ConnectionError"}
INTERRUPTED = {"RemoteProtocolError", "ReadError", "ReadTimeout", "TimeoutException", "NetworkError"}


def hub_errors(repo_id: str, revision: str | None):
    """Context manager translating huggingface_hub failures into glmctl errors with a next step."""
    import contextlib

    from huggingface_hub import errors as hf

    @contextlib.contextmanager
    def _guard():
        try:
            yield
        except hf.GatedRepoError as exc:
            from huggingface_hub import get_token

            login = "" if get_token() else " and log in (hf auth login, or set HF_TOKEN)"
            raise HubError(
                f"{repo_id} is gated: your account has not been granted access",
                hint=f"accept the terms on https://huggingface.co/{repo_id}{login}, then run the same command again",
            ) from exc
        except hf.RevisionNotFoundError as exc:
            raise HubNotFound(f"revision '{revision}' does not exist in {repo_id}", hint="check --revision") from exc
        except hf.RepositoryNotFoundError as exc:
            raise HubNotFound(
                f"repository {repo_id} was not found (or it is private and no valid token was sent)",
                hint="check the repo id; for a private repo log in with `hf auth login` or set HF_TOKEN",
            ) from exc
        except hf.HfHubHTTPError as exc:
            status = getattr(getattr(exc, "response", None), "status_code", "?")
            hint = "check your token (hf auth login / HF_TOKEN)" if status in (401, 403) else "try again later"
            raise HubError(f"the Hub answered HTTP {status} for {repo_id}", hint=hint) from exc
        except Exception as exc:
            names = _exception_names(exc)
            if names & UNREACHABLE:
                raise HubError(
                    f"cannot reach the Hugging Face Hub ({type(exc).__name__})",
                    hint="check the network or HF_ENDPOINT; to check files already on disk use: glmctl fetch --verify DIR",
                ) from exc
            if names & INTERRUPTED:
                raise HubError(
                    f"the download from {repo_id} was interrupted after several retries ({exc})",
                    hint="run the same command again: finished files are kept and not downloaded twice",
                ) from exc
            if isinstance(exc, ValueError | KeyError | TypeError | AttributeError):
                # huggingface_hub parses what it is sent without checking it: a proxy's error page,
                # a mirror speaking another API, a truncated answer
                from huggingface_hub import constants

                raise HubError(
                    f"the Hub at {constants.ENDPOINT} answered for {repo_id} with something that is not the "
                    f"Hub's API ({type(exc).__name__}: {str(exc)[:120]})",
                    hint="check HF_ENDPOINT and any proxy between here and the Hub, then try again",
                ) from exc
            raise

    return _guard()


def use_timeout(timeout: float) -> None:
    """Every read of a download and every metadata request stalls at most `timeout` seconds."""
    from huggingface_hub import constants

    constants.HF_HUB_DOWNLOAD_TIMEOUT = constants.HF_HUB_ETAG_TIMEOUT = max(1, round(timeout))


def list_remote(repo_id: str, revision: str | None, include: list[str], exclude: list[str],
                timeout: float = DEFAULT_TIMEOUT_S) -> tuple[str, list[ExpectedFile]]:
    """Resolve `revision` to a commit and list the repository's files that the globs select."""
    from huggingface_hub.hf_api import RepoFile

    api = _api()
    use_timeout(timeout)
    with hub_errors(repo_id, revision):
        info = api.repo_info(repo_id, revision=revision, timeout=timeout)
        sha = info.sha
        if not isinstance(sha, str) or not sha:
            raise HubError(f"the Hub's answer for {repo_id} names no commit", hint="try again later")
        entries = [e for e in api.list_repo_tree(repo_id, recursive=True, revision=sha) if isinstance(e, RepoFile)]
    if not entries:
        raise HubError(f"the Hub lists no files in {repo_id}@{sha[:10]}",
                       hint="check the repository on the Hub; try again later")
    files = []
    for e in entries:
        if include and not any(fnmatch.fnmatch(e.path, g) for g in include):
            continue
        if any(fnmatch.fnmatch(e.path, g) for g in exclude):
            continue
        if e.lfs is not None:
            files.append(ExpectedFile(path=e.path, size=e.lfs.size, sha256=e.lfs.sha256))
        else:
            files.append(ExpectedFile(path=e.path, size=e.size, git_oid=e.blob_id))
    if not files:
        raise UsageError(
            f"no file of {repo_id}@{sha[:10]} matches the selection",
            hint=f"include={include or ['*']} exclude={exclude}",
        )
    return sha, sorted(files, key=lambda f: f.path)


def plan_fetch(artifact: Artifact, local_dir: Path, revision: str | None,
               include: list[str] | None, exclude: list[str], timeout: float = DEFAULT_TIMEOUT_S) -> FetchPlan:
    assert artifact.repo_id is not None
    sha, files = list_remote(artifact.repo_id, revision, include or list(artifact.include), exclude, timeout)
    bytes_total = sum(f.size for f in files)
    # Complete files of the right size are not downloaded again (their hashes are checked after).
    remaining = sum(f.size for f in files if not _present_with_size(local_dir / f.path, f.size))
    return FetchPlan(
        artifact=artifact.name, repo_id=artifact.repo_id, revision=sha, requested_revision=revision,
        local_dir=str(local_dir), files=files, bytes_total=bytes_total, bytes_to_download=remaining,
        bytes_free=_free_bytes(local_dir),
    )


def check_disk(plan: FetchPlan) -> None:
    need = int(plan.bytes_to_download * DISK_MARGIN)
    if need > plan.bytes_free:
        raise DiskSpaceError(
            f"not enough disk space in {plan.local_dir}: {_gib(need)} GiB needed to download "
            f"{len(plan.files)} files, {_gib(plan.bytes_free)} GiB free",
            hint="free space or choose another --local-dir on a larger filesystem",
        )


def download(plan: FetchPlan, *, max_workers: int = 8, show_progress: bool = True,
             timeout: float = DEFAULT_TIMEOUT_S) -> None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    (enable_progress_bars if show_progress else disable_progress_bars)()
    local_dir = Path(plan.local_dir)
    local_dir.mkdir(parents=True, exist_ok=True)
    with hub_errors(plan.repo_id, plan.revision):
        snapshot_download(
            plan.repo_id, revision=plan.revision, local_dir=local_dir,
            allow_patterns=[f.path for f in plan.files], max_workers=max_workers, etag_timeout=timeout,
        )


def record_manifest(plan: FetchPlan, license_id: str | None) -> Path:
    local_dir = Path(plan.local_dir)
    previous = read_manifest(local_dir)
    files = {f.path: f for f in (previous.files if previous and previous.repo_id == plan.repo_id else [])}
    files.update({f.path: f for f in plan.files})  # a later, narrower fetch keeps earlier entries
    return write_manifest(local_dir, Manifest(
        repo_id=plan.repo_id, revision=plan.revision, artifact=plan.artifact, license=license_id,
        created=now(), files=sorted(files.values(), key=lambda f: f.path),
    ))


def redownload(repo_id: str, revision: str, local_dir: Path, files: list[ExpectedFile], *,
               show_progress: bool, timeout: float = DEFAULT_TIMEOUT_S) -> list[str]:
    """Fetch these files again (used by --repair): each into a temporary directory beside the
    download, checked against its expected size and hash, and only then renamed over the damaged
    one. A failed or wrong download leaves the old file where it was. Returns the paths replaced."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    from glmctl.hub.manifest import MANIFEST_DIR, hash_file

    (enable_progress_bars if show_progress else disable_progress_bars)()
    use_timeout(timeout)
    staging_root = local_dir / MANIFEST_DIR
    staging_root.mkdir(parents=True, exist_ok=True)
    replaced = []
    with tempfile.TemporaryDirectory(prefix="repair-", dir=staging_root) as staging:
        for expected in files:
            with hub_errors(repo_id, revision):
                fresh = Path(hf_hub_download(repo_id, expected.path, revision=revision, local_dir=staging,
                                             force_download=True, etag_timeout=timeout))
            size = fresh.stat().st_size
            if size != expected.size:
                raise HubError(f"the Hub sent {size:,} bytes for {expected.path}, {expected.size:,} expected; "
                               "the damaged file was left as it was", hint="try again later")
            want = expected.sha256 or expected.git_oid
            if want is not None and hash_file(fresh, expected) != want:
                raise HubError(f"the file the Hub sent for {expected.path} does not match its recorded hash; "
                               "the damaged file was left as it was", hint="try again later")
            target = local_dir / expected.path
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(fresh, target)  # same filesystem: the swap is atomic
            replaced.append(expected.path)
    return replaced


def _present_with_size(path: Path, size: int) -> bool:
    return path.is_file() and path.stat().st_size == size


def _free_bytes(local_dir: Path) -> int:
    probe = local_dir
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f}"
