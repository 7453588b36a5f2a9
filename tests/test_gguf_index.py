"""The GGUF header cache (compiled_spec/models/gguf_index.py): a second load reads the config and
tensor table from index.json instead of parsing the file, and gets bit-identical weights; a
rewritten file or a damaged index is parsed again."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

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
