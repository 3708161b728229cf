"""The token plan of `glmctl eval kld` and its top-K tables: fetched from a server, or saved to disk.

The plan is perplexity's, exactly: the same text, tokenizer, cut, BOS policy and strided windows
(glmctl/evals/perplexity.py), so a KLD run scores the same tokens as a perplexity run and carries
the same `scored_ids_sha256`. A top-K table is, per scored position, the tokens the server listed
(its top K plus the actual token), their log-probabilities and the smallest top-K log-probability.

A saved reference (`--save-reference FILE`) is JSON Lines: a header with the plan and the server,
then one line per window, `positions` = [[cap_logprob, [ids...], [logprobs...]], ...]. It is
appended window by window, so an interrupted save resumes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel

from glmctl.errors import GlmctlError, UsageError
from glmctl.evals import jsonl_log
from glmctl.evals import perplexity as ppl
from glmctl.evals.client import OpenAIServer, ServerError
from glmctl.evals.corpus import SourceText
from glmctl.evals.kld_math import TopK
from glmctl.evals.results import SCHEMA_VERSION, ServerInfo, now, server_info
from glmctl.evals.tokenizer import Tokenizer

DEFAULT_TOP_K = 20  # vLLM's default --max-logprobs


class TopKShortfall(ServerError):
    """The server listed fewer alternatives than were asked for."""


@dataclass(frozen=True)
class TokenPlan:
    ids: list[int]
    prefix: list[int]
    windows: list[ppl.Window]
    text: ppl.TextInfo
    windowing: ppl.Windowing
    scored_ids_sha256: str

    @property
    def positions(self) -> int:
        return len(self.ids) - self.windows[0].score_from

    def window_ids(self, w: ppl.Window) -> list[int]:
        return self.prefix + self.ids[w.start:w.end]

    def scored_tokens(self, w: ppl.Window) -> list[int]:
        return self.ids[w.score_from:w.end]


def plan_tokens(servers: list[OpenAIServer], tokenizer: Tokenizer, source: SourceText, *,
                window: int | None, stride: int | None, bos: str, max_tokens: int) -> TokenPlan:
    """Perplexity's plan; the window must fit every server that will score it."""
    ids = tokenizer.encode(source.text)[:max_tokens]
    prefix = ppl.bos_prefix(tokenizer, bos)
    resolved: tuple[int, int] | None = None
    for server in servers:  # the first fixes the defaults; the rest check the fit
        w, s = ppl.resolve_window(server, window if resolved is None else resolved[0],
                                  stride if resolved is None else resolved[1], len(prefix), len(ids))
        resolved = resolved or (w, s)
    assert resolved is not None
    window, stride = resolved
    windows = ppl.plan_windows(len(ids), window, stride, has_prefix=bool(prefix))
    text_bytes = len(tokenizer.decode(ids).encode("utf-8"))
    return TokenPlan(
        ids=ids, prefix=prefix, windows=windows,
        text=ppl.TextInfo(origin=source.origin, files=list(source.files), python_version=source.python_version,
                          sha256=source.sha256, tokens=len(ids), bytes=text_bytes),
        windowing=ppl.Windowing(window=window, stride=stride, bos_policy=bos, prefix_ids=prefix,
                                windows=len(windows), first_scored_token=windows[0].score_from),
        scored_ids_sha256=ppl._ids_digest(ids, windows[0].score_from),
    )


def _to_topk(entry: dict[int, tuple[float, int]], actual: int, top_k: int, where: str) -> TopK:
    ranked = [(lp, tok) for tok, (lp, rank) in entry.items() if 1 <= rank <= top_k]
    if len(ranked) < top_k:
        raise TopKShortfall(
            f"{where}: asked for the top {top_k} alternatives, the server listed {len(ranked)}",
            hint=f"serve with --max-logprobs {top_k} (or -1), or pass --top-k {max(1, len(ranked))}; "
                 "a vocabulary smaller than --top-k lists fewer too")
    ids = np.fromiter(entry.keys(), dtype=np.int64, count=len(entry))
    lps = np.fromiter((lp for lp, _ in entry.values()), dtype=np.float64, count=len(entry))
    return TopK(ids=ids, logprobs=lps, cap_logprob=min(lp for lp, _ in ranked), actual=actual,
                top=int(ids[np.argmax(lps)]))


def fetch_window(server: OpenAIServer, plan: TokenPlan, w: ppl.Window, top_k: int) -> list[TopK]:
    """The server's top-K table over window `w`'s scored positions, in text order."""
    try:
        raw = server.prompt_top_logprobs(plan.window_ids(w), top_k)
    except ServerError as exc:
        if "logprobs" in exc.message and "max" in exc.message.lower():
            raise ServerError(exc.message, hint=f"serve with --max-logprobs {top_k} (or -1), or pass a "
                                                "smaller --top-k") from exc
        raise
    first = len(plan.prefix) + (w.score_from - w.start)
    tokens = plan.scored_tokens(w)
    return [_to_topk(entry, actual, top_k, f"{server.base_url} position {w.score_from + i}")  # type: ignore[arg-type]
            for i, (entry, actual) in enumerate(zip(raw[first:], tokens, strict=True))]


# -- saved reference tables --------------------------------------------------------------------


class ReferenceHeader(BaseModel):
    kind: Literal["kld-reference"] = "kld-reference"
    schema_version: int = SCHEMA_VERSION
    created: str
    server: ServerInfo
    tokenizer: str
    text: ppl.TextInfo
    windowing: ppl.Windowing
    top_k: int
    scored_ids_sha256: str

    def identity(self) -> dict:
        return {"model": self.server.model, "sha256": self.scored_ids_sha256, "top_k": self.top_k,
                "windowing": self.windowing.model_dump(), "text_sha256": self.text.sha256}


def reference_header(server: OpenAIServer, tokenizer: Tokenizer, plan: TokenPlan, top_k: int) -> ReferenceHeader:
    return ReferenceHeader(created=now(), server=server_info(server), tokenizer=tokenizer.source, text=plan.text,
                           windowing=plan.windowing, top_k=top_k, scored_ids_sha256=plan.scored_ids_sha256)


def encode_window(index: int, table: list[TopK]) -> dict:
    return {"kind": "kld-reference-window", "index": index,
            "positions": [[t.cap_logprob, t.ids.tolist(), t.logprobs.tolist()] for t in table]}


def decode_window(record: dict, tokens: list[int]) -> list[TopK]:
    positions = record["positions"]
    if len(positions) != len(tokens):
        raise ValueError(f"window {record['index']} holds {len(positions)} positions, the plan {len(tokens)}")
    out = []
    for (cap, ids, lps), actual in zip(positions, tokens, strict=True):
        ids_a, lps_a = np.asarray(ids, dtype=np.int64), np.asarray(lps, dtype=np.float64)
        if actual not in ids:
            raise ValueError(f"window {record['index']} does not list the text's token {actual}")
        out.append(TopK(ids=ids_a, logprobs=lps_a, cap_logprob=float(cap), actual=actual,
                        top=int(ids_a[np.argmax(lps_a)])))
    return out


class ReferenceFile:
    """A saved reference: its header and the windows it holds so far (index -> record)."""

    def __init__(self, path: Path | None, header: ReferenceHeader | None, windows: dict[int, dict]) -> None:
        # path None: a reference read from a server and kept in memory only (not --save-reference)
        self.path, self.header, self.windows = path, header, windows

    @classmethod
    def read(cls, path: Path) -> ReferenceFile:
        records = jsonl_log.read_records(path, "kld reference")
        if records and records[0].get("kind") != "kld-reference":
            raise UsageError(f"{path} is not a kld reference (its first line is a {records[0].get('kind')!r})",
                             hint="pass a file written by `glmctl eval kld --save-reference`")
        header = ReferenceHeader.model_validate(records[0]) if records else None
        windows = {int(r["index"]): r for r in records[1:] if r.get("kind") == "kld-reference-window"}
        return cls(path, header, windows)

    def check_matches(self, plan: TokenPlan, top_k: int, tokenizer: str) -> None:
        """Refuse a reference over other tokens, windows or K than this run's."""
        h = self.header
        if h is None:
            raise UsageError(f"--reference {self.path} is empty or does not exist")
        if h.scored_ids_sha256 != plan.scored_ids_sha256:
            raise UsageError(
                f"--reference {self.path} scored other tokens (text {h.text.sha256[:12]}, {h.text.tokens:,} "
                f"tokens, tokenizer {h.tokenizer}) than this run (text {plan.text.sha256[:12]}, "
                f"{plan.text.tokens:,} tokens, tokenizer {tokenizer})",
                hint="the same text, tokenizer and --max-tokens as when the reference was saved"
                     + (" (the default text is Python's stdlib: use the same Python minor version)"
                        if plan.text.origin == "python-stdlib" else ""))
        hw, pw = h.windowing, plan.windowing
        if (hw.window, hw.stride, hw.prefix_ids) != (pw.window, pw.stride, pw.prefix_ids):
            raise UsageError(f"--reference {self.path} used window {hw.window}, stride {hw.stride}, "
                             f"prefix {hw.prefix_ids}; this run {pw.window}, {pw.stride}, {pw.prefix_ids}",
                             hint=f"pass --window {hw.window} --stride {hw.stride} --bos {hw.bos_policy}")
        if top_k > h.top_k:
            raise UsageError(f"--reference {self.path} holds the top {h.top_k}, fewer than --top-k {top_k}",
                             hint=f"pass --top-k {h.top_k} or save the reference again")
        missing = [i for i in range(len(plan.windows)) if i not in self.windows]
        if missing:
            raise UsageError(f"--reference {self.path} is incomplete: {len(missing)} of {len(plan.windows)} "
                             "window(s) missing (an interrupted --save-reference)",
                             hint=f"run the same --save-reference {self.path} again to finish it")

    def table(self, plan: TokenPlan, index: int, top_k: int) -> list[TopK]:
        w = plan.windows[index]
        try:
            table = decode_window(self.windows[index], plan.scored_tokens(w))
        except (KeyError, ValueError, TypeError) as exc:
            raise GlmctlError(f"--reference {self.path}: window {index} is damaged ({exc})",
                              hint="save the reference again") from exc
        return [truncate(t, top_k) for t in table] if top_k < self.header.top_k else table  # type: ignore[union-attr]


def truncate(t: TopK, top_k: int) -> TopK:
    """The same report as if only the top `top_k` had been asked for (plus the actual token)."""
    order = np.argsort(-t.logprobs, kind="stable")
    keep = set(order[:top_k].tolist()) | set(np.flatnonzero(t.ids == t.actual).tolist())
    idx = np.array(sorted(keep))
    return TopK(ids=t.ids[idx], logprobs=t.logprobs[idx], cap_logprob=float(t.logprobs[order[top_k - 1]]),
                actual=t.actual, top=t.top)


def open_reference_for_saving(path: Path, header: ReferenceHeader, restart: bool) -> ReferenceFile:
    """The file to append the reference's windows to: resumed when its settings match."""
    existing = None if restart else ReferenceFile.read(path)
    if existing is None or existing.header is None:
        jsonl_log.start(path, header)
        return ReferenceFile(path, header, {})
    jsonl_log.check_identity(path, existing.header.identity(), header.identity(), "kld reference")
    jsonl_log.drop_cut_tail(path)
    return existing


def reference_table(ref_file: ReferenceFile, index: int, plan: TokenPlan, top_k: int,
                    server: OpenAIServer | None) -> list[TopK]:
    """Window `index` of the reference: from the file where it is there, else from the server
    (and appended to the file, when saving)."""
    if index in ref_file.windows:
        return ref_file.table(plan, index, top_k)
    if server is None:
        raise AssertionError("checked by ReferenceFile.check_matches")
    table = fetch_window(server, plan, plan.windows[index], top_k)
    if ref_file.path is not None:
        record = encode_window(index, table)
        jsonl_log.append(ref_file.path, record)
        ref_file.windows[index] = record
    return table
