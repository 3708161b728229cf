"""A small client for OpenAI-compatible servers, using vLLM's extensions where the server has them.

Only what the checks need: the served model and its `max_model_len` (`/v1/models`), the server's own
tokenizer (`/tokenize`, `/detokenize`: vLLM), prompt log-probabilities of a token-ID prompt
(`/v1/completions` with `prompt_logprobs`: vLLM), plain completions and chat completions, and the
Prometheus text of `/metrics`. Every failure becomes a `GlmctlError` that names the URL and the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from glmctl.errors import UsageError
from glmctl.evals.transport import (
    ApiKey,
    AuthError,
    Deadline,
    ServerError,
    ServerUnreachable,
    Transport,
    auth_hint,
)

__all__ = ["ApiKey", "AuthError", "ContextTooLong", "ModelMismatch", "OpenAIServer", "ServerError",
           "ServerUnreachable"]

# Discovery and scraping answer in milliseconds on a healthy server; they never wait the whole
# --timeout that a long prefill may need.
QUICK_TIMEOUT_S = 30.0


class ModelMismatch(UsageError):
    """The server serves a different model than the one asked for."""


class ContextTooLong(UsageError):
    """A request would not fit the server's max_model_len."""


@dataclass(frozen=True)
class ServedModel:
    id: str
    max_model_len: int | None  # vLLM reports it; other servers may not
    root: str | None = None  # vLLM: the checkpoint path or hub id the name stands for


@dataclass(frozen=True)
class Answer:
    text: str
    completion_tokens: int | None
    finish_reason: str | None
    reasoning: str | None = None  # a reasoning parser's separate channel (chat only), kept for the record
    prompt_tokens: int | None = None  # as the server counted them (usage)


def normalize_base_url(url: str) -> str:
    """`http://h:8000`, `http://h:8000/` and `http://h:8000/v1` all mean the same server."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


def _error_detail(response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:300].strip()
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message") or err)[:500]
        return str(err)[:500]
    return str(body)[:300]


class OpenAIServer:
    """One served model behind an OpenAI-compatible base URL.

    `model` is the served model name to use; None takes the only model the server serves. Call
    `connect()` (or use the server through `glmctl.evals.target.open_server`) before anything else.
    """

    def __init__(self, base_url: str, model: str | None = None, *, timeout: float | None = 600.0,
                 api_key: ApiKey | str | None = None, deadline: Deadline | None = None) -> None:
        self.base_url = normalize_base_url(base_url)
        self.requested_model = model
        self.api_key = ApiKey(api_key, "--api-key") if isinstance(api_key, str) else api_key
        self.headers = {"Authorization": f"Bearer {self.api_key.value}"} if self.api_key else {}
        self.request_timeout = timeout
        """Seconds one request may take in all (connect and every byte of the answer)."""
        self.deadline = deadline or Deadline(None)
        self._http = Transport(self.base_url, timeout=timeout, headers=self.headers, deadline=self.deadline)
        self.model: ServedModel | None = None

    # -- plumbing ---------------------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> OpenAIServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, json: Any = None, *, quick: bool = False):
        timeout = self.request_timeout
        if quick:
            timeout = QUICK_TIMEOUT_S if timeout is None else min(timeout, QUICK_TIMEOUT_S)
        response = self._http.request(method, path, json, timeout=timeout)
        if response.status_code in (401, 403):
            raise AuthError(f"{self.base_url}{path} answered HTTP {response.status_code} "
                            f"({'no API key was sent' if self.api_key is None else 'API key refused'})",
                            hint=auth_hint(self.api_key))
        return response

    def _json(self, method: str, path: str, json: Any = None, *, what: str, quick: bool = False) -> Any:
        response = self._request(method, path, json, quick=quick)
        if response.status_code == 404:
            raise ServerError(
                f"{self.base_url} has no {path} endpoint (HTTP 404), needed for {what}",
                hint="glmctl's checks need a vLLM server (or pass --tokenizer DIR where offered)",
            )
        if response.status_code >= 400:
            raise ServerError(
                f"{self.base_url}{path} refused the request for {what}: HTTP {response.status_code}: "
                f"{_error_detail(response)}"
            )
        try:
            return response.json()
        except ValueError as exc:
            raise ServerError(f"{self.base_url}{path} answered with something that is not JSON "
                              f"({what}): {response.text[:120]!r}") from exc

    @property
    def model_id(self) -> str:
        if self.model is None:
            raise RuntimeError("call connect() first")
        return self.model.id

    @property
    def max_model_len(self) -> int | None:
        return None if self.model is None else self.model.max_model_len

    # -- discovery --------------------------------------------------------------------------

    def models(self) -> list[ServedModel]:
        body = self._json("GET", "/v1/models", what="listing the served models", quick=True)
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list):
            raise ServerError(f"{self.base_url}/v1/models did not return a model list")
        return [
            ServedModel(id=str(card["id"]), max_model_len=_positive_int(card.get("max_model_len")),
                        root=card.get("root") if isinstance(card.get("root"), str) else None)
            for card in data
            if isinstance(card, dict) and "id" in card
        ]

    def connect(self) -> ServedModel:
        """Find the served model; a wrong `--model` is a usage error that lists what is served."""
        served = self.models()
        names = [m.id for m in served]
        if not served:
            raise ServerError(f"{self.base_url} serves no model")
        if self.requested_model is None:
            if len(served) > 1:
                raise UsageError(
                    f"{self.base_url} serves {len(served)} models ({', '.join(names)})",
                    hint="pick one with --model NAME",
                )
            self.model = served[0]
        else:
            match = [m for m in served if m.id == self.requested_model]
            if not match:
                raise ModelMismatch(
                    f"{self.base_url} serves {', '.join(repr(n) for n in names)}, "
                    f"not {self.requested_model!r}",
                    hint=f"pass --model {names[0]} (or point --url at the server you meant)",
                )
            self.model = match[0]
        return self.model

    def check_fits(self, tokens: int, what: str, *, hint: str | None = None) -> None:
        """Refuse early, with both numbers, what the server would refuse later."""
        limit = self.max_model_len
        if limit is not None and tokens > limit:
            raise ContextTooLong(
                f"{what} needs {tokens:,} tokens, more than the server's max_model_len of {limit:,} "
                f"({self.model_id} at {self.base_url})",
                hint=hint or "use a shorter length, or serve the model with a larger --max-model-len",
            )

    # -- tokenizer --------------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        body = self._json(
            "POST", "/tokenize",
            {"model": self.model_id, "prompt": text, "add_special_tokens": add_special_tokens},
            what="tokenizing with the server's tokenizer",
        )
        return self._token_ids(body, "/tokenize")

    def tokenize_chat(self, messages: list[dict], *, template_kwargs: dict | None = None) -> list[int]:
        """The token IDs the server's chat template makes of `messages` (with the generation prompt)."""
        payload: dict[str, Any] = {"model": self.model_id, "messages": messages, "add_generation_prompt": True}
        if template_kwargs:
            payload["chat_template_kwargs"] = template_kwargs
        body = self._json("POST", "/tokenize", payload, what="rendering the chat template")
        return self._token_ids(body, "/tokenize")

    def _token_ids(self, body: Any, path: str) -> list[int]:
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise ServerError(f"{self.base_url}{path} answered without a `tokens` list of token IDs",
                              hint="glmctl reads vLLM's /tokenize; pass --tokenizer DIR for other servers")
        return tokens

    def detokenize(self, ids: list[int]) -> str:
        body = self._json("POST", "/detokenize", {"model": self.model_id, "tokens": list(ids)},
                          what="detokenizing with the server's tokenizer")
        text = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(text, str):
            raise ServerError(f"{self.base_url}/detokenize answered without a `prompt` string")
        return text

    # -- scoring and generation -------------------------------------------------------------

    def prompt_logprobs(self, ids: list[int]) -> list[float | None]:
        """log p(ids[i] | ids[:i]) for every position (None at 0), read from vLLM's prompt_logprobs.

        The prompt is sent as token IDs, so nothing is added (no BOS, no template). vLLM reports,
        per position, a dict keyed by token ID that holds the actual token; it is checked to be the
        one that was sent, so a server that re-tokenised or shifted the prompt is caught.
        """
        payload = {
            "model": self.model_id, "prompt": list(ids), "max_tokens": 1, "temperature": 0.0,
            "prompt_logprobs": 0,
        }
        body = self._json("POST", "/v1/completions", payload, what="scoring prompt log-probabilities")
        try:
            raw = body["choices"][0]["prompt_logprobs"]
        except (KeyError, IndexError, TypeError) as exc:
            raise ServerError(f"{self.base_url} returned no choices[0].prompt_logprobs") from exc
        if raw is None:
            raise ServerError(
                f"{self.base_url} ignores `prompt_logprobs` (it returned none)",
                hint="perplexity needs vLLM's prompt_logprobs extension of /v1/completions",
            )
        if len(raw) != len(ids):
            raise ServerError(f"sent {len(ids)} tokens, got {len(raw)} prompt log-probabilities back")
        out: list[float | None] = []
        for pos, (token, entry) in enumerate(zip(ids, raw, strict=True)):
            if entry is None:
                out.append(None)
                continue
            item = entry.get(str(token), entry.get(token)) if isinstance(entry, dict) else None
            if item is None:
                raise ServerError(
                    f"the server scored a different token than was sent at position {pos} "
                    f"(sent {token}, got {sorted(map(str, entry))[:3] if isinstance(entry, dict) else entry})"
                )
            out.append(self._logprob(item, pos, token))
        return out

    def prompt_top_logprobs(self, ids: list[int], top_k: int) -> list[dict[int, tuple[float, int]] | None]:
        """Per position (None at 0): {token id: (logprob, rank)} for the server's top `top_k` tokens
        and the token that was sent, from vLLM's `prompt_logprobs: top_k` (glmctl eval kld).

        Checked here: one entry per position, and the sent token among them. How many alternatives
        came back is for the caller to judge.
        """
        payload = {"model": self.model_id, "prompt": list(ids), "max_tokens": 1, "temperature": 0.0,
                   "prompt_logprobs": top_k}
        body = self._json("POST", "/v1/completions", payload, what=f"top-{top_k} prompt log-probabilities")
        try:
            raw = body["choices"][0]["prompt_logprobs"]
        except (KeyError, IndexError, TypeError) as exc:
            raise ServerError(f"{self.base_url} returned no choices[0].prompt_logprobs") from exc
        if raw is None:
            raise ServerError(f"{self.base_url} ignores `prompt_logprobs` (it returned none)",
                              hint="eval kld needs vLLM's prompt_logprobs extension of /v1/completions")
        if len(raw) != len(ids):
            raise ServerError(f"sent {len(ids)} tokens, got {len(raw)} prompt log-probabilities back")
        out: list[dict[int, tuple[float, int]] | None] = []
        for pos, (token, entry) in enumerate(zip(ids, raw, strict=True)):
            if entry is None:
                out.append(None)
                continue
            if not isinstance(entry, dict) or str(token) not in entry:
                raise ServerError(
                    f"the server scored a different token than was sent at position {pos} "
                    f"(sent {token}, got {sorted(entry)[:3] if isinstance(entry, dict) else entry})")
            parsed = {}
            for key, item in entry.items():
                value = float(item["logprob"])
                parsed[int(key)] = (value if math.isfinite(value) else -9999.0, int(item.get("rank") or 0))
            out.append(parsed)
        return out

    def _logprob(self, item: Any, pos: int, token: int) -> float:
        value = item.get("logprob") if isinstance(item, dict) else item
        try:
            value = float(value)
        except (TypeError, ValueError) as exc:
            raise ServerError(f"{self.base_url} returned a log-probability that is not a number at "
                              f"position {pos}: {value!r}") from exc
        # vLLM clamps -inf to -9999; either is a token the model rules out, and NaN is a broken
        # forward pass: no perplexity can be computed from either, so none is reported.
        if math.isnan(value) or value > 1e-6:
            raise ServerError(f"{self.base_url} returned log p = {value} for token {token} at position {pos}: "
                              "the model's output is broken (NaN or above 0)",
                              hint="check the server's log and the checkpoint (glmctl quantize verify, "
                                   "glmctl fetch --verify)")
        if value <= -9999.0:
            raise ServerError(f"{self.base_url} gave token {token} at position {pos} log p = {value} (ruled "
                              "out: vLLM clamps -inf to -9999): the perplexity is unbounded",
                              hint="the model cannot have written this text; check the checkpoint and the "
                                   "tokenizer the server uses")
        return value

    def complete(self, prompt: str | list[int], *, max_tokens: int, extra: dict | None = None) -> Answer:
        payload = {"model": self.model_id, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                   **(extra or {})}
        body = self._json("POST", "/v1/completions", payload, what="a completion")
        return _answer(body, chat=False)

    def chat(self, messages: list[dict], *, max_tokens: int, template_kwargs: dict | None = None,
             extra: dict | None = None) -> Answer:
        payload: dict[str, Any] = {"model": self.model_id, "messages": messages, "max_tokens": max_tokens,
                                   "temperature": 0.0, **(extra or {})}
        if template_kwargs:
            payload["chat_template_kwargs"] = template_kwargs
        body = self._json("POST", "/v1/chat/completions", payload, what="a chat completion")
        return _answer(body, chat=True)

    def metrics_text(self) -> str:
        response = self._request("GET", "/metrics", quick=True)
        if response.status_code >= 400:
            raise ServerError(
                f"{self.base_url}/metrics answered HTTP {response.status_code}",
                hint="bench reads vLLM's Prometheus counters; is this a vLLM server?",
            )
        return response.text


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _answer(body: Any, *, chat: bool) -> Answer:
    choices = body.get("choices") if isinstance(body, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices else None
    message = choice.get("message") if chat and isinstance(choice, dict) else {}
    text = message.get("content") if chat and isinstance(message, dict) else \
        choice.get("text") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or not isinstance(message, dict) or not isinstance(text, str | None):
        raise ServerError("the server's answer has no choices[0]" + (".message" if chat else ".text"),
                          hint="glmctl's checks need an OpenAI-compatible (vLLM) server")
    usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
    reasoning = (message.get("reasoning_content") or message.get("reasoning")) if chat else None
    return Answer(text=text or "", completion_tokens=_positive_int(usage.get("completion_tokens")),
                  finish_reason=choice.get("finish_reason"), reasoning=reasoning if isinstance(reasoning, str) else None,
                  prompt_tokens=_positive_int(usage.get("prompt_tokens")))
