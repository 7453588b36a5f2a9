"""Tokenizer loading through transformers' AutoTokenizer, for Hugging Face directories and GGUF files.

Building a fast tokenizer from GGUF metadata takes seconds, so the converted tokenizer is saved
once under ~/.cache/compiled_spec (keyed by the file's path, size and mtime) and reloaded from there.
"""
from __future__ import annotations

from pathlib import Path
from unittest import mock

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from compiled_spec.models.gguf_index import fast_reader, gguf_cache_dir


def _cache_dir(gguf: Path) -> Path:
    return gguf_cache_dir(gguf, "tokenizers")


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        cached = _cache_dir(p)
        if (cached / "tokenizer_config.json").exists():
            return AutoTokenizer.from_pretrained(str(cached))
        import gguf

        # transformers imports gguf.GGUFReader when it converts: the faster reader parses
        # (gguf_index.fast_reader; 9.8 s -> 5.3 s cold on CI's CPU)
        with mock.patch.object(gguf, "GGUFReader", fast_reader()):
            tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        try:
            tok.save_pretrained(str(cached))
        except OSError:
            pass  # a read-only home only costs the conversion next time
        return tok
    if p.is_dir():
        return AutoTokenizer.from_pretrained(str(p))
    raise FileNotFoundError(f"tokenizer path {path!r} is neither a model directory nor a .gguf file")


def chat_ids(tokenizer: PreTrainedTokenizerBase, conversation: list[dict]) -> list[int]:
    """A conversation through the tokenizer's chat template (generation prompt added), as ids;
    transformers returns either a list or a BatchEncoding depending on version and tokenizer."""
    check_conversation(conversation)
    out = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)


def chat_ids_batch(tokenizer: PreTrainedTokenizerBase,
                   conversations: list[list[dict]]) -> list[list[int]]:
    """``chat_ids`` of each conversation, the same ids: every template is rendered, then one
    batched encode tokenizes them all on the Rust tokenizer's threads (encoding whole
    conversations one call at a time was most of self-distillation's host time)."""
    for c in conversations:
        check_conversation(c)
    if not conversations:
        return []
    out = tokenizer.apply_chat_template(conversations, add_generation_prompt=True, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return [list(ids) for ids in out]


def check_conversation(conversation: object) -> None:
    """A list of ``{"role": str, "content": str}`` messages; anything else is a ValueError naming
    the message (the template would fail with a jinja error that names nothing)."""
    if not isinstance(conversation, list) or not conversation:
        raise ValueError(f"a conversation must be a non-empty list of messages, got "
                         f"{str(conversation)[:80]!r}")
    for i, m in enumerate(conversation):
        if not isinstance(m, dict):
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise ValueError(f"message {i} {m!r}: '{key}' must be a string")
