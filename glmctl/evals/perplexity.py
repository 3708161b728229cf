"""Token perplexity and bits per byte of a text, scored from a server's prompt log-probabilities.

Method (it is printed in every report header, because perplexities from different windowings are
not comparable: lm-eval scores disjoint windows, llama.cpp the second half of disjoint chunks, the
HF guide a strided sliding window):

- The text is tokenised once with the model's tokenizer, without added special tokens, and cut to
  its first `max_tokens` tokens.
- **Strided sliding window.** Windows hold `window` text tokens and advance by `stride`; each
  window scores only the tokens no earlier window scored, so every token is scored once, with at
  least `window - stride` tokens of context (the first window: whatever precedes it). The last
  window is aligned to the end of the text, so it too is full length.
- **BOS policy.** `auto`: every window starts with the special tokens the tokenizer itself would
  put before a text (a Llama BOS, say), never scored. Any other text (e.g. GLM's `[gMASK]<sop>`,
  which GLM's chat template puts first and its tokenizer does not add) is tokenised and used the
  same way. `none`, or a tokenizer that adds nothing: windows start with text, and the text's first
  token, having no context, is not scored.
- Each window is one `/v1/completions` request with the token IDs as the prompt and
  `prompt_logprobs: 0` (vLLM): the server's log p(token | everything before it in the window).

Perplexity = exp(mean NLL over scored tokens); bits per byte = total NLL / ln 2 / UTF-8 bytes of the
scored tokens (independent of the tokenizer); the standard error is by batch means (stats.py).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import BaseModel

from glmctl.errors import UsageError
from glmctl.evals import stats
from glmctl.evals.client import OpenAIServer, ServerError
from glmctl.evals.corpus import SourceText
from glmctl.evals.results import SCHEMA_VERSION, ServerInfo, now, server_info
from glmctl.evals.tokenizer import Tokenizer

DEFAULT_MAX_TOKENS = 30_000
DEFAULT_WINDOW = 4096


@dataclass(frozen=True)
class Window:
    """Text tokens [start, end) are sent; tokens [score_from, end) are scored."""

    start: int
    end: int
    score_from: int


def plan_windows(n_tokens: int, window: int, stride: int, *, has_prefix: bool) -> list[Window]:
    """The strided sliding windows over `n_tokens` text tokens (see the module doc)."""
    first_scored = 0 if has_prefix else 1
    if window < 1 + (0 if has_prefix else 1):
        raise UsageError(f"--window {window} is too small: a window needs a token to score"
                         + ("" if has_prefix else " and one token of context before it (no BOS)"))
    if not 1 <= stride <= window:
        raise UsageError(f"--stride {stride} must be between 1 and the window ({window})")
    if not has_prefix and stride == window:
        raise UsageError(
            f"--stride {stride} equal to --window leaves the first token of every window without "
            "context, and this tokenizer adds no BOS to condition it on",
            hint=f"use --stride {window - 1} or less (or --bos auto with a tokenizer that has a BOS)",
        )
    if n_tokens <= first_scored:
        raise UsageError(f"the text has {n_tokens} token(s); nothing to score")
    windows = [Window(0, min(window, n_tokens), first_scored)]
    while windows[-1].end < n_tokens:
        scored_until = windows[-1].end
        end = min(scored_until + stride, n_tokens)
        windows.append(Window(max(0, end - window), end, scored_until))
    return windows


class TextInfo(BaseModel):
    origin: str
    files: list[str]
    python_version: str | None
    sha256: str  # of the whole source text before the cut
    tokens: int  # after the cut: what was scored over
    bytes: int  # UTF-8 bytes of those tokens


class Windowing(BaseModel):
    method: Literal["strided-sliding-window"] = "strided-sliding-window"
    window: int
    stride: int
    bos_policy: str  # "auto", "none", or the literal text used as the prefix
    prefix_ids: list[int]
    windows: int
    first_scored_token: int

    def describe(self) -> str:
        what = "the tokenizer's special prefix" if self.bos_policy == "auto" else repr(self.bos_policy)
        bos = (f"each window starts with {what} = ids {self.prefix_ids} (not scored)" if self.prefix_ids
               else "no BOS: windows start with text; the text's first token is not scored")
        return (f"strided sliding window: {self.windows} window(s) of {self.window:,} tokens, stride "
                f"{self.stride:,} (each scores only its new tokens, with >= {self.window - self.stride:,} "
                f"tokens of context after the first); {bos}")


class Comparison(BaseModel):
    baseline_file: str
    baseline_model: str
    baseline_perplexity: float
    relative_change_percent: float
    ci95_low_percent: float
    ci95_high_percent: float
    tokens_paired: int
    method: str

    def describe(self) -> str:
        return (f"{self.relative_change_percent:+.2f}% (95% CI {self.ci95_low_percent:+.2f}% .. "
                f"{self.ci95_high_percent:+.2f}%) vs {self.baseline_perplexity:.4f} ({self.baseline_model})")


class PerplexityResult(BaseModel):
    kind: Literal["perplexity"] = "perplexity"
    schema_version: int = SCHEMA_VERSION
    created: str
    server: ServerInfo
    tokenizer: str
    text: TextInfo
    windowing: Windowing
    tokens_scored: int
    bytes_scored: int
    mean_nll: float  # nats per token
    nll_stderr: float
    perplexity: float
    perplexity_stderr: float  # delta method: ppl * stderr(mean NLL)
    bits_per_byte: float
    stderr_method: str
    scored_ids_sha256: str  # the token IDs and first scored position: what pairs two runs
    logprobs: list[float]  # per scored token, in text order
    comparison: Comparison | None = None


def _ids_digest(ids: list[int], first_scored: int) -> str:
    h = hashlib.sha256(f"{first_scored}:".encode())
    h.update(np.asarray(ids, dtype=np.int64).tobytes())
    return h.hexdigest()


def bos_prefix(tokenizer: Tokenizer, bos: str) -> list[int]:
    if bos == "auto":
        return tokenizer.special_prefix()
    if bos == "none":
        return []
    ids = tokenizer.encode(bos)
    if not ids:
        raise UsageError(f"--bos {bos!r} tokenizes to nothing")
    return ids


def resolve_window(server: OpenAIServer, window: int | None, stride: int | None, prefix_len: int,
                   n_tokens: int) -> tuple[int, int]:
    """Defaults (4,096 and half of it, within max_model_len) and the fit check with the numbers."""
    limit = server.max_model_len
    if window is None:
        window = DEFAULT_WINDOW if limit is None else min(DEFAULT_WINDOW, limit - prefix_len - 1)
        window = max(2, min(window, max(n_tokens, 2)))
    server.check_fits(
        prefix_len + window + 1, f"a window of {window:,} text tokens (+{prefix_len} prefix +1 generated)",
        hint=f"pass --window {max(2, (limit or 0) - prefix_len - 1)} or less",
    )
    return window, (stride if stride is not None else max(1, window // 2))


def score(server: OpenAIServer, prefix: list[int], ids: list[int], windows: list[Window],
          on_window: Callable[[int], None] | None = None) -> np.ndarray:
    """Log-probabilities of tokens [windows[0].score_from, len(ids)) in text order."""
    out: list[float] = []
    for w in windows:
        logprobs = server.prompt_logprobs(prefix + ids[w.start:w.end])
        first = len(prefix) + (w.score_from - w.start)
        scored = logprobs[first:]
        if any(v is None for v in scored):  # vLLM leaves only position 0 empty, which is never scored
            raise ServerError(f"{server.base_url} returned no log-probability for a token that has context "
                              f"(window at tokens {w.start:,}..{w.end:,})",
                              hint="perplexity needs vLLM's prompt_logprobs for every position but the first")
        out.extend(scored)  # type: ignore[arg-type]
        if on_window:
            on_window(w.end - w.score_from)
    return np.asarray(out, dtype=np.float64)


def measure(server: OpenAIServer, tokenizer: Tokenizer, source: SourceText, *, window: int | None = None,
            stride: int | None = None, bos: str = "auto", max_tokens: int = DEFAULT_MAX_TOKENS,
            on_start: Callable[[int], None] | None = None,
            on_window: Callable[[int], None] | None = None) -> PerplexityResult:
    ids = tokenizer.encode(source.text)[:max_tokens]
    prefix = bos_prefix(tokenizer, bos)
    window, stride = resolve_window(server, window, stride, len(prefix), len(ids))
    windows = plan_windows(len(ids), window, stride, has_prefix=bool(prefix))
    first_scored = windows[0].score_from
    if on_start:
        on_start(len(ids) - first_scored)
    logprobs = score(server, prefix, ids, windows, on_window)
    nll = -logprobs
    text_bytes = len(tokenizer.decode(ids).encode("utf-8"))
    unscored_bytes = len(tokenizer.decode(ids[:first_scored]).encode("utf-8"))
    bytes_scored = max(1, text_bytes - unscored_bytes)
    mean_nll = float(nll.mean())
    se = stats.batch_means_stderr(nll)
    if mean_nll > 700:  # exp() overflows a float: a model this wrong has no perplexity worth a number
        raise ServerError(f"the mean log-probability is {-mean_nll:.1f} nats per token: the perplexity overflows",
                          hint="the model's output is broken; check the checkpoint and the server's tokenizer")
    ppl = math.exp(mean_nll)
    return PerplexityResult(
        created=now(), server=server_info(server), tokenizer=tokenizer.source,
        text=TextInfo(origin=source.origin, files=list(source.files), python_version=source.python_version,
                      sha256=source.sha256, tokens=len(ids), bytes=text_bytes),
        windowing=Windowing(window=window, stride=stride, bos_policy=bos, prefix_ids=prefix,
                            windows=len(windows), first_scored_token=first_scored),
        tokens_scored=len(nll), bytes_scored=bytes_scored, mean_nll=mean_nll, nll_stderr=se,
        perplexity=ppl, perplexity_stderr=ppl * se, bits_per_byte=float(nll.sum()) / math.log(2) / bytes_scored,
        stderr_method=stats.stderr_method(len(nll)), scored_ids_sha256=_ids_digest(ids, first_scored),
        logprobs=[float(v) for v in logprobs],
    )


def compare(result: PerplexityResult, baseline: PerplexityResult, baseline_file: str) -> Comparison:
    """Paired relative change of perplexity against a run over exactly the same tokens and windows."""
    same_windows = (result.windowing.window, result.windowing.stride, result.windowing.prefix_ids) == (
        baseline.windowing.window, baseline.windowing.stride, baseline.windowing.prefix_ids)
    if not same_windows:
        b = baseline.windowing
        raise UsageError(
            f"baseline {baseline_file} used window {b.window}, stride {b.stride}, prefix {b.prefix_ids}; "
            f"this run used {result.windowing.window}, {result.windowing.stride}, {result.windowing.prefix_ids}",
            hint=f"pass --window {b.window} --stride {b.stride} --bos {b.bos_policy} to compare like with like",
        )
    if result.scored_ids_sha256 != baseline.scored_ids_sha256:
        raise UsageError(
            f"baseline {baseline_file} scored different tokens (text {baseline.text.sha256[:12]}, "
            f"{baseline.text.tokens:,} tokens, tokenizer {baseline.tokenizer}) than this run "
            f"(text {result.text.sha256[:12]}, {result.text.tokens:,} tokens)",
            hint="a paired comparison needs the same text, tokenizer and --max-tokens"
                 + (" (the default text is Python's stdlib: use the same Python minor version)"
                    if result.text.origin == "python-stdlib" else ""),
        )
    change = stats.relative_change(-np.asarray(result.logprobs), -np.asarray(baseline.logprobs))
    return Comparison(
        baseline_file=baseline_file, baseline_model=baseline.server.model,
        baseline_perplexity=baseline.perplexity, relative_change_percent=change.percent,
        ci95_low_percent=change.ci95_low_percent, ci95_high_percent=change.ci95_high_percent,
        tokens_paired=change.tokens_paired, method=change.method,
    )
