"""The GGUF header cache (compiled_spec/models/gguf_index.py): a second load reads the config and
tensor table from index.json instead of parsing the file, and gets bit-identical weights; a
rewritten file or a damaged index is parsed again."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from compiled_spec.models import gguf_index
from compiled_spec.models.gguf_index import INDEX_VERSION, gguf_cache_dir, read_index
from compiled_spec.models.gguf_loader import config_from_gguf, load_gguf


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPILED_SPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_second_load_skips_the_parse_and_matches(cache, smollm2_gguf_path, monkeypatch):
    import gguf

    cold, cfg = load_gguf(smollm2_gguf_path, torch.float32)
    from pathlib import Path
    index_file = gguf_cache_dir(Path(smollm2_gguf_path), "gguf") / "index.json"
    assert json.loads(index_file.read_text())["version"] == INDEX_VERSION

    def no_parse(*a, **k):
        raise AssertionError("GGUFReader constructed on a cached load")

    monkeypatch.setattr(gguf, "GGUFReader", no_parse)
    monkeypatch.setattr(gguf_index, "fast_reader", lambda: no_parse)
    warm, cfg2 = load_gguf(smollm2_gguf_path, torch.float32)
    assert cfg2 == cfg
    a, b = cold.state_dict(), warm.state_dict()
    assert a.keys() == b.keys() and len(a) > 100
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_rewritten_file_or_a_damaged_index_is_parsed_again(cache, smollm2_gguf_path, tmp_path):
    g = tmp_path / "copy.gguf"
    shutil.copyfile(smollm2_gguf_path, g)

    def parse(reader):
        return config_from_gguf(reader, str(g))

    first = read_index(g, parse)
    assert not first.cached and read_index(g, parse).cached
    index_file = gguf_cache_dir(g, "gguf") / "index.json"
    index_file.write_text('{"version": 1, "config": {')  # a half-written index
    again = read_index(g, parse)
    assert not again.cached and again.config == first.config and again.tensors == first.tensors
    assert read_index(g, parse).cached  # rewritten whole
    st = g.stat()
    os.utime(g, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # the file changed
    assert not read_index(g, parse).cached


def test_the_fast_reader_parses_what_the_reader_parses(smollm2_gguf_path):
    """fast_reader() (a plain ndarray under the reader's views): every field's types, parts and
    values and every tensor's name, type, shape and bytes as gguf.GGUFReader has them."""
    import gguf
    import numpy as np

    ref, fast = gguf.GGUFReader(smollm2_gguf_path), gguf_index.fast_reader()(smollm2_gguf_path)
    assert type(fast.data) is np.ndarray and isinstance(fast.data.base, np.memmap)
    assert list(ref.fields) == list(fast.fields) and len(ref.fields) > 30
    for name, a in ref.fields.items():
        b = fast.fields[name]
        assert (a.offset, a.types, a.data, len(a.parts)) == (b.offset, b.types, b.data,
                                                            len(b.parts)), name
        assert all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a.parts, b.parts))
    assert len(ref.tensors) == len(fast.tensors) > 200
    for a, b in zip(ref.tensors, fast.tensors):
        assert (a.name, a.tensor_type, list(a.shape), a.data_offset) == \
            (b.name, b.tensor_type, list(b.shape), b.data_offset)
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name


def test_tokenizer_converted_through_the_fast_reader_is_transformers(cache, smollm2_gguf_path):
    """load_tokenizer's first conversion (through fast_reader) against transformers' own, on
    the reader it imports: the same vocabulary, special tokens and ids of a chat."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from compiled_spec.tokenizer import chat_ids, load_tokenizer

    p = Path(smollm2_gguf_path)
    ours = load_tokenizer(smollm2_gguf_path)
    assert (gguf_cache_dir(p, "tokenizers") / "tokenizer_config.json").exists()
    ref = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    assert ours.get_vocab() == ref.get_vocab() and len(ref.get_vocab()) > 49000
    assert (ours.eos_token_id, ours.bos_token_id) == (ref.eos_token_id, ref.bos_token_id)
    text = "Héllo wörld 123 — spéculative décoding, \\n\\t tabs & émojis 🙂"
    assert ours.encode(text) == ref.encode(text)
    chat = [{"role": "user", "content": text}]
    assert chat_ids(ours, chat) == chat_ids(ref, chat)
