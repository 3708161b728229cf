"""The tiny checkpoint's tokenizer: byte-level BPE trained offline on Python's own standard library.

No download: the corpus is a fixed, ordered list of standard-library modules that every CPython
3.11+ ships (code plus docstrings, so the vocabulary covers both Python and English prose). The
corpus's sha256 is recorded, so two builds that differ can be told apart from two Pythons that differ.

Special tokens follow GLM's chat format (`[gMASK]<sop>`, `<|system|>`, `<|user|>`, `<|assistant|>`,
`<|observation|>`, `<think>`/`</think>`, `<|endoftext|>`); they take the first ids so every id of the
real chat format is stable across vocabulary sizes. Generation stops at `<|endoftext|>`, `<|user|>`
or `<|observation|>`, as in GLM's generation config.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from glmctl.errors import GlmctlError

# Present and stable from CPython 3.11 through 3.14 (none are packages that moved, none deprecated).
CORPUS_MODULES = (
    "argparse.py", "textwrap.py", "string.py", "functools.py", "dataclasses.py", "difflib.py",
    "shlex.py", "heapq.py", "bisect.py", "fractions.py", "statistics.py", "calendar.py", "csv.py",
    "enum.py", "inspect.py", "typing.py", "json/decoder.py", "json/encoder.py", "json/__init__.py",
    "contextlib.py", "tokenize.py", "pprint.py", "random.py", "configparser.py",
)

SPECIAL_TOKENS = (
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>", "</think>",
)
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|endoftext|>"
STOP_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")

# GLM-style chat template: "[gMASK]<sop>" once, then "<|role|>\n" + content per message; the
# OpenAI "tool" role is GLM's "observation". Content given as a list of text parts is joined.
CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- for message in messages -%}"
    "{%- set role = 'observation' if message['role'] == 'tool' else message['role'] -%}"
    "{%- if message['content'] is string -%}{%- set content = message['content'] -%}"
    "{%- else -%}{%- set content = message['content'] | map(attribute='text') | join('') -%}{%- endif -%}"
    "{{ '<|' + role + '|>\\n' + content }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)


@dataclass(frozen=True)
class TokenizerInfo:
    vocab_size: int
    special_ids: dict[str, int]
    eos_token_id: int
    pad_token_id: int
    stop_token_ids: list[int]
    corpus_files: int
    corpus_bytes: int
    corpus_sha256: str


def corpus_paths() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paths = [stdlib / rel for rel in CORPUS_MODULES]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise GlmctlError(
            f"the tokenizer corpus needs these standard-library files, which are missing: {', '.join(missing)}",
            hint="use a full CPython install (some distributions split the standard library into packages)",
        )
    return paths


def train_tokenizer(out_dir: Path, vocab_size: int, model_max_length: int) -> TokenizerInfo:
    """Train the BPE and write tokenizer.json + tokenizer_config.json into `out_dir`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    texts = [p.read_text(encoding="utf-8") for p in corpus_paths()]
    digest = hashlib.sha256()
    for rel, text in zip(CORPUS_MODULES, texts, strict=True):
        digest.update(rel.encode() + b"\0" + text.encode() + b"\0")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    # to_str() writes the vocabulary in id order and merges in rank order: stable bytes.
    (out_dir / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")

    special_ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "padding_side": "left",
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)],
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return TokenizerInfo(
        vocab_size=tok.get_vocab_size(),
        special_ids=special_ids,
        eos_token_id=special_ids[EOS_TOKEN],
        pad_token_id=special_ids[PAD_TOKEN],
        stop_token_ids=[special_ids[t] for t in STOP_TOKENS],
        corpus_files=len(texts),
        corpus_bytes=sum(len(t.encode()) for t in texts),
        corpus_sha256=digest.hexdigest(),
    )
