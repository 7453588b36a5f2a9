"""What the GGUF loader needs from a file's header (the model config and the tensor table),
cached so that a second load skips ``gguf.GGUFReader``'s parse.

The reader builds a numpy view for every element of every metadata array: SmolLM2's 49k-token
vocabulary and merges made that ~5 s of a ~9 s CPU load (H200 host: a few of the 4-5 s warm
start-up load), every time, although the loader reads none of it. The first load parses with the
reader as before and writes ``index.json`` (config + per tensor: type, GGUF shape, absolute byte
offset and the reader's view dtype and shape) under the same per-file key as the converted
tokenizer (path, size, mtime); later loads memory-map the file and cut the same views at the same
offsets, so the weights are bit-identical. Dequantizing stays ``gguf.quants``' job. A stale or
unreadable index is ignored (parsed again); writing it is best effort.

The first parse itself (a cold start's, and transformers' tokenizer conversion) goes through
``fast_reader()``: the same reader on a plain ndarray view of its memory map.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from compiled_spec.models.config import ModelConfig

INDEX_VERSION = 1  # bump when the entry layout or the config mapping changes


@functools.cache
def fast_reader() -> type:
    """``gguf.GGUFReader`` slicing a plain ndarray view of its memory map: the same fields and
    tensors, element for element. Why: each of the ~250k views the parse cuts from a
    ``np.memmap`` runs the subclass's Python ``__getitem__`` and ``__array_finalize__``; 6.1 s of
    SmolLM2's parse on CI's CPU were 2.4 s without them (forty-second session). The map stays
    open as the view's base."""
    import gguf  # lazy: only GGUF users need it

    class FastGGUFReader(gguf.GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain_data

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return FastGGUFReader


def gguf_cache_dir(gguf: Path, kind: str) -> Path:
    """``$COMPILED_SPEC_CACHE`` (else ~/.cache/compiled_spec) / kind / key of this file's
    resolved path, size and mtime: any rewrite of the file is a new key."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    root = Path(os.environ.get("COMPILED_SPEC_CACHE", Path.home() / ".cache" / "compiled_spec"))
    return root / kind / key


@dataclass(frozen=True)
class TensorEntry:
    name: str  # the GGUF name (blk.N.attn_q.weight)
    tensor_type: int  # gguf.GGMLQuantizationType value
    shape: tuple[int, ...]  # GGUF order (innermost first)
    offset: int  # absolute byte offset of the data in the file
    view_dtype: str  # numpy dtype of the reader's data view (uint8 for block formats)
    view_shape: tuple[int, ...]  # the reader's data view shape, which dequantize expects

    def view(self, mm: np.ndarray) -> np.ndarray:
        """This tensor's bytes in the memory-mapped file ``mm`` (uint8), as the reader views them."""
        dt = np.dtype(self.view_dtype)
        count = int(np.prod(self.view_shape, dtype=np.int64))
        return mm[self.offset:self.offset + count * dt.itemsize].view(dt).reshape(self.view_shape)


@dataclass
class GGUFIndex:
    config: ModelConfig
    tensors: list[TensorEntry]
    cached: bool  # True: read from index.json, the file's header was not parsed


def _from_reader(reader: Any) -> list[TensorEntry]:
    return [TensorEntry(t.name, int(t.tensor_type), tuple(int(d) for d in t.shape),
                        int(t.data_offset), t.data.dtype.str, tuple(int(d) for d in t.data.shape))
            for t in reader.tensors]


def _load(path: Path) -> GGUFIndex | None:
    try:
        raw = json.loads(path.read_text())
        if raw.get("version") != INDEX_VERSION:
            return None
        cfg = ModelConfig(**raw["config"])
        entries = [TensorEntry(e["name"], e["tensor_type"], tuple(e["shape"]), e["offset"],
                               e["view_dtype"], tuple(e["view_shape"])) for e in raw["tensors"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing, half-written or from another layout: parse the file again
    return GGUFIndex(cfg, entries, cached=True)


def _save(path: Path, index: GGUFIndex) -> None:
    if index.config.rope_scaling is not None:  # not JSON as is; GGUF configs never have one
        return
    body = {"version": INDEX_VERSION, "config": dataclasses.asdict(index.config),
            "tensors": [dataclasses.asdict(e) for e in index.tensors]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(body))
        tmp.replace(path)  # atomic: a concurrent loader sees the old state or the whole file
    except OSError:
        pass  # a read-only home only costs the parse next time


def read_index(gguf_path: Path, parse_config: Callable[[Any], ModelConfig]) -> GGUFIndex:
    """The file's config and tensor table: from the cache, else parsed by ``gguf.GGUFReader``
    (``parse_config(reader)`` maps its metadata; its errors propagate and nothing is cached)."""
    cache = gguf_cache_dir(gguf_path, "gguf") / "index.json"
    hit = _load(cache)
    if hit is not None:
        return hit
    reader = fast_reader()(str(gguf_path))  # memory-maps the file; tensors are read lazily
    config = parse_config(reader)
    index = GGUFIndex(config, _from_reader(reader), cached=False)
    _save(cache, index)
    return index
