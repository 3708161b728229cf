"""Needle in a haystack: cell design, placement, exact prompt recipes and scoring.

A *cell* is (prompt length in tokens, depth in percent of the haystack). Its needle is generated,
never a fixed sentence a model may have memorised: a random name keyed to a random 7-digit number
or UUID, written as one comment line. Distractor lines give other names other values, so an answer
that merely echoes "a code from the context" is caught. Every line is inserted at a line boundary of
the haystack (source code), at or just before the requested token depth.

The recipe of a cell holds everything that rebuilds its prompt exactly, without a tokenizer: the
haystack's character range in the source stream, the inserted lines and their character offsets,
the question, the API and its template arguments. Token positions are *measured* on the final
prompt (by the model's tokenizer) and recorded next to the recipe, so the depth a cell claims is the
depth its prompt has. Scoring is an exact substring match of the value in the answer: no judge.
"""

from __future__ import annotations

import hashlib
import random
import uuid
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel

from glmctl.errors import UsageError
from glmctl.evals.client import ServerError
from glmctl.evals.corpus import SourceText
from glmctl.evals.tokenizer import Tokenizer

NeedleKind = Literal["number", "uuid"]
Api = Literal["chat", "completion"]

DEFAULT_LENGTHS = (32_000, 128_000, 250_000)
DEFAULT_DEPTHS = (10.0, 50.0, 90.0)
INTRO = ("Below is a slice of Python source code. A few comment lines in it state the secret code "
         "of a person. Read all of it; a question follows.\n\n")
QUESTION = "\n\nWhat is the secret code of {key}? Answer with the code only."
ANSWER_PREFIX = "The secret code of {key} is"
NEEDLE_LINE = "# NOTE: the secret code of {key} is {value}.\n"
_SYLLABLES = ("ka", "lo", "mi", "ren", "sa", "tor", "vel", "qui", "bar", "zen", "dru", "fa", "gil",
              "hou", "ix", "jor", "mab", "nel", "ost", "pra", "rho", "sul", "tam", "ul", "wen", "yor")


class Placement(BaseModel):
    key: str
    value: str
    depth_percent: float  # requested, of the haystack's tokens
    char_offset: int  # where the line goes in the haystack text (a line start)

    @property
    def line(self) -> str:
        return NEEDLE_LINE.format(key=self.key, value=self.value)


class CellRecipe(BaseModel):
    """Everything that rebuilds a cell's prompt; the source text is checked by its hash."""

    length: int
    depth_percent: float
    seed: int
    kind: NeedleKind
    api: Api
    template_kwargs: dict | None
    max_answer_tokens: int
    source_sha256: str
    source_repeats: int  # the haystack stream is the source text repeated this many times
    haystack_chars: int  # the haystack is stream[0:haystack_chars] before insertion
    needle: Placement
    distractors: list[Placement]


class CellLayout(BaseModel):
    """Measured on the final prompt by the model's tokenizer."""

    prompt_tokens: int
    prompt_sha256: str  # of the token IDs (completion) or of the rendered chat IDs (chat)
    haystack_start_token: int
    haystack_tokens: int  # including the inserted lines
    needle_tokens: int  # of the needle line on its own
    needle_token_index: int  # its first token; depth = (this - haystack start) / (haystack - needle)
    requested_token_index: int
    actual_depth_percent: float


def cell_seed(seed: int, length: int, depth: float) -> int:
    """Per-cell seed: a cell's needle does not depend on which other cells the grid has."""
    digest = hashlib.sha256(f"{seed}:{length}:{depth:g}".encode()).digest()
    return int.from_bytes(digest[:6], "big")


def _name(rng: random.Random) -> str:
    def word() -> str:
        return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()
    return f"{word()} {word()}"


def _value(rng: random.Random, kind: NeedleKind) -> str:
    if kind == "number":
        return str(rng.randint(1_000_000, 9_999_999))
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _distractor_depths(rng: random.Random, depth: float, count: int) -> list[float]:
    """Depths at least 5 points from the needle's, so lines do not share a boundary when avoidable."""
    depths: list[float] = []
    while len(depths) < count:
        d = round(rng.uniform(0.0, 100.0), 1)
        if abs(d - depth) >= 5.0 or len(depths) > 50:
            depths.append(d)
    return depths


def build_text(recipe: CellRecipe, source: SourceText) -> tuple[list[dict], str]:
    """(chat messages, answer prefix) of a cell, from its recipe and the source text alone."""
    if source.sha256 != recipe.source_sha256:
        raise UsageError("the source text differs from the one this recipe was made from "
                         f"({source.sha256[:12]} vs {recipe.source_sha256[:12]})",
                         hint="pass the same files (or the same Python version for the default text)")
    stream = source.text * recipe.source_repeats
    haystack = stream[: recipe.haystack_chars]
    # Lines sharing an offset keep their depth order, so a rebuild places them exactly as planned.
    placements = sorted([recipe.needle, *recipe.distractors], key=lambda p: (p.char_offset, p.depth_percent))
    pieces, last = [], 0
    for p in placements:
        pieces += [haystack[last:p.char_offset], p.line]
        last = p.char_offset
    pieces.append(haystack[last:])
    user = INTRO + "".join(pieces) + QUESTION.format(key=recipe.needle.key)
    return [{"role": "user", "content": user}], ANSWER_PREFIX.format(key=recipe.needle.key)


def prompt_ids(tokenizer: Tokenizer, recipe: CellRecipe, source: SourceText) -> list[int]:
    """The exact token IDs the model sees: the model's chat template, plus the answer prefix when the
    completion API continues the assistant turn itself."""
    messages, answer_prefix = build_text(recipe, source)
    ids = tokenizer.render_chat(messages, recipe.template_kwargs)
    return ids + tokenizer.encode(answer_prefix) if recipe.api == "completion" else ids


def ids_digest(ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()


def first_token_covering(tokenizer: Tokenizer, ids: list[int], char_offset: int,
                         memo: dict[int, int] | None = None) -> int:
    """Index of the token whose decoded text covers `char_offset` of decode(ids) (binary search;
    `memo` keeps decoded prefix lengths across searches over the same ids)."""
    memo = {} if memo is None else memo

    def chars(k: int) -> int:
        if k not in memo:
            memo[k] = len(tokenizer.decode(ids[:k]))
        return memo[k]

    lo, hi = 0, len(ids)  # invariant: chars(lo) <= char_offset < chars(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if chars(mid) <= char_offset:
            lo = mid
        else:
            hi = mid
    return lo


def locate(tokenizer: Tokenizer, ids: list[int], recipe: CellRecipe) -> tuple[int, int, int]:
    """(haystack start, haystack end, needle) token indices in the final prompt, by decoding it."""
    rendered = tokenizer.decode(ids)
    memo = {len(ids): len(rendered)}
    hay_start = rendered.find(INTRO) + len(INTRO)
    needle_at = rendered.find(recipe.needle.line.rstrip("\n"))
    hay_end = rendered.find(QUESTION.format(key=recipe.needle.key))
    if min(hay_start - len(INTRO), needle_at, hay_end) < 0:
        raise ServerError("the tokenizer does not give back the prompt it was given: decoding the encoded "
                          "needle prompt lost its haystack, needle or question",
                          hint="the server's /tokenize and /detokenize disagree; pass --tokenizer DIR (the "
                               "checkpoint's own tokenizer)")
    return tuple(first_token_covering(tokenizer, ids, c, memo) for c in (hay_start, hay_end, needle_at))  # type: ignore[return-value]


@dataclass
class HaystackStream:
    """The source text, repeated as needed, and the char offset of any token prefix of it."""

    source: SourceText
    tokenizer: Tokenizer
    repeats: int = 1
    ids: list[int] | None = None
    _chars: dict[int, int] = field(default_factory=dict)  # token prefix length -> chars

    def ensure_tokens(self, n: int) -> None:
        """Tokenise enough of the stream for `n` tokens (call once, with the longest cell)."""
        chars = max(4 * n, 4096)
        while True:
            self.repeats = max(1, -(-chars // len(self.source.text)))
            self.ids = self.tokenizer.encode((self.source.text * self.repeats)[:chars])
            self._chars.clear()
            if len(self.ids) > n + 8:
                return
            chars *= 2

    def chars_of(self, n_tokens: int) -> int:
        assert self.ids is not None
        if n_tokens not in self._chars:
            self._chars[n_tokens] = len(self.tokenizer.decode(self.ids[:n_tokens]))
        return self._chars[n_tokens]

    def line_start_at_or_before(self, char_offset: int) -> int:
        text = self.source.text * self.repeats
        return text.rfind("\n", 0, char_offset) + 1


def plan_cell(length: int, depth: float, *, seed: int, kind: NeedleKind, api: Api, distractors: int,
              template_kwargs: dict | None, max_answer_tokens: int, stream: HaystackStream,
              tokenizer: Tokenizer) -> tuple[CellRecipe, CellLayout]:
    rng = random.Random(cell_seed(seed, length, depth))
    keys: list[str] = []
    while len(keys) < 1 + distractors:
        if (name := _name(rng)) not in keys:
            keys.append(name)
    values: list[str] = []
    while len(values) < len(keys):
        if (v := _value(rng, kind)) not in values:
            values.append(v)
    depths = [depth, *_distractor_depths(rng, depth, distractors)]

    line_tokens = [len(tokenizer.encode(NEEDLE_LINE.format(key=k, value=v))) for k, v in zip(keys, values, strict=True)]
    order = sorted(range(len(keys)), key=lambda i: (depths[i], i))  # insertion order along the haystack

    def raw_token_index(i: int, haystack_tokens: int) -> int:
        # Depth is of the final haystack (source text plus the inserted lines); the lines inserted
        # before this one push it back, so aim that much earlier in the source text.
        before = sum(line_tokens[j] for j in order[: order.index(i)])
        span = haystack_tokens + sum(line_tokens) - line_tokens[i]  # 100% = the haystack's last line
        target = round(depths[i] / 100.0 * span) - before
        return max(0, min(haystack_tokens, target))

    def recipe_for(haystack_tokens: int) -> CellRecipe:
        end = stream.line_start_at_or_before(stream.chars_of(haystack_tokens)) if haystack_tokens else 0
        placed = [Placement(key=keys[i], value=values[i], depth_percent=depths[i],
                            char_offset=min(end, stream.line_start_at_or_before(
                                stream.chars_of(raw_token_index(i, haystack_tokens)))))
                  for i in range(len(keys))]
        return CellRecipe(length=length, depth_percent=depth, seed=seed, kind=kind, api=api,
                          template_kwargs=template_kwargs, max_answer_tokens=max_answer_tokens,
                          source_sha256=stream.source.sha256, source_repeats=stream.repeats,
                          haystack_chars=end, needle=placed[0], distractors=placed[1:])

    overhead = len(prompt_ids(tokenizer, recipe_for(0), stream.source))
    budget = length - overhead
    if budget < 16:
        raise UsageError(f"a {length:,}-token prompt leaves no room for a haystack: the template, question "
                         f"and {1 + distractors} needle lines take {overhead:,} tokens")
    for _ in range(6):  # cutting at line ends and BPE seams moves the total by a few tokens; settle it
        recipe = recipe_for(budget)
        ids = prompt_ids(tokenizer, recipe, stream.source)
        if len(ids) <= length:
            break
        budget -= len(ids) - length
    hay_start, hay_end, needle = locate(tokenizer, ids, recipe)
    hay_tokens = max(1, hay_end - hay_start)
    span = max(1, hay_tokens - line_tokens[0])  # depth 0% = the first line, 100% = the last line
    requested = hay_start + round(depth / 100.0 * span)
    layout = CellLayout(prompt_tokens=len(ids), prompt_sha256=ids_digest(ids), haystack_start_token=hay_start,
                        haystack_tokens=hay_tokens, needle_tokens=line_tokens[0], needle_token_index=needle,
                        requested_token_index=requested,
                        actual_depth_percent=round(100.0 * (needle - hay_start) / span, 2))
    return recipe, layout


@dataclass(frozen=True)
class Score:
    correct: bool  # the needle's value appears verbatim in the answer
    distractor: bool  # a distractor's value appears instead (or as well)


def score_answer(answer: str, recipe: CellRecipe) -> Score:
    return Score(correct=recipe.needle.value in answer,
                 distractor=any(d.value in answer for d in recipe.distractors))


def parse_lengths(spec: str) -> list[int]:
    """'32k,128k,250000' -> [32000, 128000, 250000] (k = 1,000, as the report counts tokens)."""
    out = []
    for part in spec.split(","):
        part = part.strip().lower()
        if not part:
            continue
        try:
            value = int(float(part[:-1]) * 1000) if part.endswith("k") else int(part)
        except ValueError as exc:
            raise UsageError(f"cannot read {part!r} as a token count", hint="e.g. 32k,128k,250k") from exc
        if value <= 0:
            raise UsageError(f"lengths must be positive, got {part!r}")
        out.append(value)
    if not out:
        raise UsageError("no lengths given")
    return sorted(set(out))


def parse_depths(spec: str) -> list[float]:
    try:
        depths = sorted({float(p) for p in spec.split(",") if p.strip()})
    except ValueError as exc:
        raise UsageError(f"cannot read depths {spec!r}", hint="percent of the haystack, e.g. 10,50,90") from exc
    if not depths or any(not 0.0 <= d <= 100.0 for d in depths):
        raise UsageError(f"depths must be percentages between 0 and 100, got {spec!r}")
    return depths

