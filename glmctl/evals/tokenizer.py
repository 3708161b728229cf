"""The model's tokenizer, as the checks use it: from the server (default) or from a model directory.

Both sources encode text *without* added special tokens, so no BOS or template token ever lands
inside a haystack or a perplexity text (the BOS-leakage failure of needle harnesses). The special
tokens the tokenizer would add (`special_prefix`) are found by asking it both ways and are used
deliberately, where a check says so.

    server       vLLM's /tokenize and /detokenize: exactly the tokenizer that serves the model
    HF directory transformers' AutoTokenizer from a local checkpoint (for servers without /tokenize)
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from glmctl.errors import UsageError, require_module
from glmctl.evals.client import OpenAIServer


class Tokenizer(Protocol):
    source: str  # said in every report header: which tokenizer produced the token counts

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def special_prefix(self) -> list[int]: ...

    def render_chat(self, messages: list[dict], template_kwargs: dict | None = None) -> list[int]: ...


def prefix_added(with_special: list[int], without: list[int]) -> list[int]:
    """The tokens a tokenizer puts *before* the text when asked to add special tokens.

    `with_special` is `prefix + without + suffix`; a suffix (an EOS some tokenizers append) is
    ignored, because a scored window never ends the document.
    """
    n = len(without)
    for start in range(len(with_special) - n + 1):
        if with_special[start:start + n] == without:
            return with_special[:start]
    return []


class ServerTokenizer:
    def __init__(self, server: OpenAIServer) -> None:
        self.server = server
        self.source = f"server /tokenize ({server.model_id})"
        self._prefix: list[int] | None = None

    def encode(self, text: str) -> list[int]:
        return self.server.tokenize(text, add_special_tokens=False) if text else []

    def decode(self, ids: list[int]) -> str:
        return self.server.detokenize(ids) if ids else ""

    def special_prefix(self) -> list[int]:
        if self._prefix is None:
            probe = "def f(x):\n    return x\n"
            self._prefix = prefix_added(self.server.tokenize(probe, add_special_tokens=True),
                                        self.server.tokenize(probe, add_special_tokens=False))
        return list(self._prefix)

    def render_chat(self, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
        return self.server.tokenize_chat(messages, template_kwargs=template_kwargs)


class HFTokenizer:
    """transformers' tokenizer of a local checkpoint directory (no network: local files only)."""

    def __init__(self, directory: Path) -> None:
        if not Path(directory).is_dir():
            raise UsageError(f"--tokenizer {directory} is not a directory",
                             hint="pass the checkpoint directory that holds tokenizer.json")
        transformers = require_module("transformers", "cpu", "--tokenizer DIR")
        try:
            self._tok = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot load a tokenizer from {directory}: {exc}") from exc
        self.source = f"HF tokenizer from {directory}"

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False)) if text else []

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def special_prefix(self) -> list[int]:
        probe = "def f(x):\n    return x\n"
        return prefix_added(list(self._tok.encode(probe, add_special_tokens=True)), self.encode(probe))

    def render_chat(self, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
        ids = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            **(template_kwargs or {}))
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]


def open_tokenizer(server: OpenAIServer, directory: Path | None) -> Tokenizer:
    return HFTokenizer(directory) if directory is not None else ServerTokenizer(server)
