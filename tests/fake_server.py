"""An in-process stand-in for a vLLM OpenAI server, for tests and for trying the checks without one.

It speaks the endpoints the checks use, with vLLM's shapes: /v1/models (with max_model_len),
/tokenize and /detokenize, /v1/completions (token-ID or text prompts, `prompt_logprobs`, streaming
with `token_ids` and a final usage chunk), /v1/chat/completions, and /metrics in Prometheus text
with vLLM's metric names. Its "model" is arithmetic, so tests can compute the expected answers:

- tokenizer: one token per character (id = code point + 16); specials 1 EOS, 2 BOS, 3 user,
  4 assistant; BOS is added only when asked (`add_special_tokens`), as a Llama tokenizer does;
- log p(token | previous) = `logprob(prev, token)` below, minus `logprob_shift`;
- answers: the value of the needle the question asks about (or "I do not know" with retrieve=False);
- engine: one prefill at a time at `prefill_tok_s` (prompt tokens counted when a prefill ends, as
  vLLM does), then `decode_tok_s` tokens per second per request; `max_num_seqs` running at most.

Misbehaviour for tests of every failure path: `faults` maps a path (or "stream", the streamed
completions the bench sends) to one of FAULTS; `api_key` makes every endpoint but /health answer
401 without that bearer token, as `vllm serve --api-key` does.
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SPECIALS = {1: "<|endoftext|>", 2: "<|bos|>", 3: "<|user|>", 4: "<|assistant|>"}
OFFSET = 16

FAULTS = {
    "500": "HTTP 500 with vLLM's error body",
    "garbage": "HTTP 200 with a body that is not JSON (or not Prometheus text)",
    "missing": "HTTP 200 with an empty JSON object: every expected field missing",
    "hang": "accept the request and never answer",
    "trickle": "send headers, then one byte of the body every `trickle_s` seconds",
    "nan": "prompt log-probabilities of NaN (or NaN counters in /metrics)",
    "clamped": "prompt log-probabilities of -9999 (vLLM's clamp of -inf)",
    "half": "every second request answers HTTP 500 (streams: every second session)",
    "empty": "a stream that ends without a token",
    "cut": "a stream that stops halfway, without its finish reason (as when the server dies)",
}


def encode(text: str) -> list[int]:
    return [ord(c) + OFFSET for c in text]


def decode(ids: list[int]) -> str:
    return "".join(SPECIALS.get(i, "") if i < OFFSET else chr(i - OFFSET) for i in ids)


def logprob(prev: int, token: int) -> float:
    return -(0.5 + ((token * 7919 + prev * 104729) % 1000) / 400.0)


class FakeEngine:
    def __init__(self, *, model: str = "fake-model", max_model_len: int = 8192, decode_tok_s: float = 400.0,
                 prefill_tok_s: float = 50_000.0, max_num_seqs: int = 64, retrieve: bool = True,
                 logprob_shift: float = 0.0, faults: dict[str, str] | None = None,
                 api_key: str | None = None, trickle_s: float = 0.5, hang_s: float = 120.0) -> None:
        self.model, self.max_model_len = model, max_model_len
        self.decode_tok_s, self.prefill_tok_s = decode_tok_s, prefill_tok_s
        self.max_num_seqs, self.retrieve, self.logprob_shift = max_num_seqs, retrieve, logprob_shift
        self.lock = threading.Lock()
        self.prefill_lock = threading.Lock()
        self.slots = threading.Semaphore(max_num_seqs)
        self.counters = {"vllm:generation_tokens": 0, "vllm:prompt_tokens": 0, "vllm:num_preemptions": 0,
                         "vllm:request_success": 0}
        self.running = 0
        self.waiting = 0
        self.requests: list[dict] = []  # every JSON body received, for tests to inspect
        self.request_headers: list[dict] = []  # the headers of each, in the same order
        self.faults = dict(faults or {})
        unknown = set(self.faults.values()) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; known: {sorted(FAULTS)}")
        self.api_key, self.trickle_s, self.hang_s = api_key, trickle_s, hang_s
        self.seen: dict[str, int] = {}  # requests per fault key, for "half"

    # -- the "model" ------------------------------------------------------------------------

    def prompt_logprobs(self, ids: list[int]) -> list[dict | None]:
        fault = self.faults.get("/v1/completions")
        out: list[dict | None] = [None]
        for prev, tok in zip(ids, ids[1:], strict=False):
            value = logprob(prev, tok) - self.logprob_shift
            if fault in ("nan", "clamped") and len(out) == len(ids) // 2:
                value = float("nan") if fault == "nan" else -9999.0
            out.append({str(tok): {"logprob": value, "rank": 1, "decoded_token": decode([tok])}})
        return out

    def prompt_top_logprobs(self, ids: list[int], top_k: int) -> list[dict | None]:
        """`prompt_logprobs: top_k`: the actual token only here; a subclass may list alternatives."""
        return self.prompt_logprobs(ids)

    def answer(self, prompt_text: str) -> str:
        asked = re.findall(r"What is the secret code of ([^?]+)\?", prompt_text)
        if not asked or not self.retrieve:
            return "I do not know."
        found = re.search(rf"secret code of {re.escape(asked[-1])} is ([^\s.]+)\.", prompt_text)
        return f" {found.group(1)}" if found else "I do not know."

    def render_chat(self, messages: list[dict]) -> list[int]:
        ids: list[int] = []
        for m in messages:
            ids += [3 if m.get("role") == "user" else 4] + encode(str(m.get("content", "")))
        return ids + [4]

    # -- the "engine" -----------------------------------------------------------------------

    def generate(self, prompt_len: int, max_tokens: int):
        """Yield once per generated token, with the counters and gauges kept like vLLM's."""
        with self.lock:
            self.waiting += 1
        self.slots.acquire()
        try:
            with self.prefill_lock:
                with self.lock:
                    self.waiting -= 1
                    self.running += 1
                time.sleep(prompt_len / self.prefill_tok_s)
                with self.lock:
                    self.counters["vllm:prompt_tokens"] += prompt_len
            for i in range(max_tokens):
                if i:
                    time.sleep(1.0 / self.decode_tok_s)
                with self.lock:
                    self.counters["vllm:generation_tokens"] += 1
                yield i
            with self.lock:
                self.counters["vllm:request_success"] += 1
        finally:
            with self.lock:
                self.running -= 1
            self.slots.release()

    def metrics_text(self) -> str:
        labels = f'engine="0",model_name="{self.model}"'
        with self.lock:
            lines = []
            for name, value in self.counters.items():
                lines += [f"# HELP {name} fake", f"# TYPE {name} counter", f"{name}_total{{{labels}}} {float(value)}"]
            for name, value in (("vllm:num_requests_running", self.running),
                                ("vllm:num_requests_waiting", self.waiting),
                                ("vllm:kv_cache_usage_perc", min(1.0, self.running / self.max_num_seqs))):
                if self.faults.get("/metrics") == "nan":
                    value = float("nan")
                lines += [f"# HELP {name} fake", f"# TYPE {name} gauge", f"{name}{{{labels}}} {float(value)}"]
        return "\n".join(lines) + "\n"


class _Handler(BaseHTTPRequestHandler):
    engine: FakeEngine

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _send(self, code: int, body: Any, content_type: str = "application/json") -> None:
        data = (json.dumps(body) if content_type == "application/json" else body).encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, message: str, code: int = 400) -> None:
        self._send(code, {"error": {"message": message, "type": "BadRequestError", "code": code}})

    def _misbehave(self, key: str) -> bool:
        """Apply the fault configured for `key`; True when the request is answered (or dropped)."""
        e = self.engine
        if e.api_key is not None and self.path != "/health" and \
                self.headers.get("Authorization") != f"Bearer {e.api_key}":
            self._send(401, {"error": "Unauthorized"})
            return True
        fault = e.faults.get(key)
        with e.lock:
            e.seen[key] = n = e.seen.get(key, 0) + 1
        if fault == "500" or (fault == "half" and n % 2 == 0):
            self._error("EngineCore encountered an issue", 500)
        elif fault == "garbage":
            self._send(200, "<html><body>502 Bad Gateway</body></html>\n# TYPE {{{", "text/html")
        elif fault == "missing":
            self._send(200, {})
        elif fault == "hang":
            time.sleep(e.hang_s)
            self.close_connection = True
        elif fault == "trickle":
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "100000")
            self.end_headers()
            end = time.monotonic() + e.hang_s
            try:
                while time.monotonic() < end:
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(e.trickle_s)
            except OSError:
                pass  # the client gave up: what a deadline is for
            self.close_connection = True
        else:
            return False
        return True

    def do_GET(self) -> None:
        e = self.engine
        if self._misbehave(self.path):
            return
        if self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [
                {"id": e.model, "object": "model", "root": "/fake/" + e.model, "max_model_len": e.max_model_len}]})
        elif self.path == "/metrics":
            self._send(200, e.metrics_text(), "text/plain; version=0.0.4")
        elif self.path == "/health":
            self._send(200, {})
        else:
            self._error("not found", 404)

    def do_POST(self) -> None:
        e = self.engine
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        with e.lock:
            e.requests.append({"path": self.path, **body})
            e.request_headers.append({k.lower(): v for k, v in self.headers.items()})
        stream_fault = body.get("stream") and "stream" in e.faults
        if self._misbehave("stream" if stream_fault else self.path):
            return
        if body.get("model") not in (None, e.model):
            return self._error(f"The model `{body.get('model')}` does not exist.", 404)
        if self.path == "/tokenize":
            ids = (e.render_chat(body["messages"]) if "messages" in body else
                   ([2] if body.get("add_special_tokens", True) else []) + encode(body["prompt"]))
            return self._send(200, {"count": len(ids), "max_model_len": e.max_model_len, "tokens": ids})
        if self.path == "/detokenize":
            return self._send(200, {"prompt": decode(body["tokens"])})
        if self.path == "/v1/chat/completions":
            ids = e.render_chat(body["messages"])
            return self._complete(ids, body, chat=True)
        if self.path == "/v1/completions":
            prompt = body["prompt"]
            ids = list(prompt) if isinstance(prompt, list) else [2] + encode(prompt)
            return self._complete(ids, body, chat=False)
        self._error("not found", 404)

    def _complete(self, ids: list[int], body: dict, *, chat: bool) -> None:
        e = self.engine
        max_tokens = int(body.get("max_tokens") or 16)
        stop = body.get("stop")
        if isinstance(stop, list) and len(stop) > 4:  # vLLM's OpenAI server validates as the API does
            return self._error(f"body.stop: List should have at most 4 items after validation, not {len(stop)}")
        if len(ids) + max_tokens > e.max_model_len:
            return self._error(f"This model's maximum context length is {e.max_model_len} tokens. However, "
                               f"you requested {len(ids) + max_tokens} tokens.")
        if body.get("stream"):
            return self._stream(ids, body, max_tokens)
        text = e.answer(decode(ids))
        finish = "length" if len(text) > max_tokens else "stop"
        text = text[:max_tokens]  # one token per character
        for _ in e.generate(len(ids), len(text)):
            pass
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
            if body.get("prompt_logprobs") is not None:
                choice["prompt_logprobs"] = e.prompt_top_logprobs(ids, int(body["prompt_logprobs"]))
        self._send(200, {"object": "chat.completion" if chat else "text_completion", "choices": [choice],
                         "usage": {"prompt_tokens": len(ids), "completion_tokens": len(encode(text))}})

    def _stream(self, ids: list[int], body: dict, max_tokens: int) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        fault = self.engine.faults.get("stream")
        if fault == "empty":
            max_tokens = 0
        for i in self.engine.generate(len(ids), max_tokens):
            if fault == "cut" and i == max_tokens // 2:
                self.close_connection = True
                return
            last = i == max_tokens - 1
            choice = {"index": 0, "text": "x", "finish_reason": "length" if last else None}
            if body.get("return_token_ids"):
                choice["token_ids"] = [OFFSET + ord("x")]
            self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            self.wfile.flush()
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": len(ids), "completion_tokens": max_tokens}
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


class FakeServer:
    """`with FakeServer(engine) as url:` serves on 127.0.0.1 at a free port in a thread."""

    def __init__(self, engine: FakeEngine | None = None) -> None:
        self.engine = engine or FakeEngine()
        handler = type("Handler", (_Handler,), {"engine": self.engine})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
