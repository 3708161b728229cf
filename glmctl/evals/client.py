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

import httpx

from glmctl.errors import GlmctlError, UsageError


class ServerUnreachable(GlmctlError):
    """Nothing answers at the URL (refused, timed out, DNS)."""


class ServerError(GlmctlError):
    """The server answered, but not with what an OpenAI-compatible (vLLM) server would."""


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


def _error_detail(response: httpx.Response) -> str:
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

    def __init__(self, base_url: str, model: str | None = None, *, timeout: float = 600.0,
                 api_key: str | None = None) -> None:
        self.base_url = normalize_base_url(base_url)
        self.requested_model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = httpx.Timeout(timeout, connect=10.0)
        self.headers = headers
        self._http = httpx.Client(base_url=self.base_url, timeout=self.timeout, headers=headers)
        self.model: ServedModel | None = None

    # -- plumbing ---------------------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> OpenAIServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, json: Any = None) -> httpx.Response:
        try:
            response = self._http.request(method, path, json=json)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise ServerUnreachable(
                f"no server answers at {self.base_url} ({type(exc).__name__}: {exc})",
                hint="start one (glmctl serve --profile NAME) or pass the right --url",
            ) from exc
        except httpx.TimeoutException as exc:
            raise ServerUnreachable(
                f"{self.base_url}{path} did not answer within {self.timeout.read:.0f} s",
                hint="the server may be overloaded or stuck; check its log",
            ) from exc
        except httpx.HTTPError as exc:
            raise ServerUnreachable(f"talking to {self.base_url}{path} failed: {exc}") from exc
        return response

    def _json(self, method: str, path: str, json: Any = None, *, what: str) -> Any:
        response = self._request(method, path, json)
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
            raise ServerError(f"{self.base_url}{path} answered with something that is not JSON") from exc

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
        body = self._json("GET", "/v1/models", what="listing the served models")
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list):
            raise ServerError(f"{self.base_url}/v1/models did not return a model list")
        return [
            ServedModel(id=str(card["id"]), max_model_len=card.get("max_model_len"), root=card.get("root"))
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
        return [int(t) for t in body["tokens"]]

    def tokenize_chat(self, messages: list[dict], *, template_kwargs: dict | None = None) -> list[int]:
        """The token IDs the server's chat template makes of `messages` (with the generation prompt)."""
        payload: dict[str, Any] = {"model": self.model_id, "messages": messages, "add_generation_prompt": True}
        if template_kwargs:
            payload["chat_template_kwargs"] = template_kwargs
        body = self._json("POST", "/tokenize", payload, what="rendering the chat template")
        return [int(t) for t in body["tokens"]]

    def detokenize(self, ids: list[int]) -> str:
        body = self._json("POST", "/detokenize", {"model": self.model_id, "tokens": list(ids)},
                          what="detokenizing with the server's tokenizer")
        return str(body["prompt"])

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
                    f"(sent {token}, got {sorted(entry)[:3] if isinstance(entry, dict) else entry})"
                )
            value = float(item["logprob"] if isinstance(item, dict) else item)
            # vLLM clamps -inf to -9999 in some paths; either way it is a token the model rules out.
            out.append(value if math.isfinite(value) else -9999.0)
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
        response = self._request("GET", "/metrics")
        if response.status_code >= 400:
            raise ServerError(
                f"{self.base_url}/metrics answered HTTP {response.status_code}",
                hint="bench reads vLLM's Prometheus counters; is this a vLLM server?",
            )
        return response.text


def _answer(body: Any, *, chat: bool) -> Answer:
    try:
        choice = body["choices"][0]
        message = choice["message"] if chat else {}
        text = message.get("content") if chat else choice["text"]
    except (KeyError, IndexError, TypeError) as exc:
        raise ServerError("the server's answer has no choices[0]") from exc
    usage = body.get("usage") or {}
    reasoning = message.get("reasoning_content") or message.get("reasoning") if chat else None
    return Answer(text=text or "", completion_tokens=usage.get("completion_tokens"),
                  finish_reason=choice.get("finish_reason"), reasoning=reasoning,
                  prompt_tokens=usage.get("prompt_tokens"))
