"""Library errors from reading a checkpoint file, re-raised as ValueError naming the file.

safetensors and gguf (numpy underneath) report a truncated or corrupt file as "incomplete
metadata" or "cannot reshape array of size ..." without saying which file; with several shards,
a draft head and a target that is no help.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def reading(path: str | Path, what: str = "checkpoint file") -> Iterator[None]:
    """Errors raised inside become ``ValueError("<path>: cannot read this <what> ...")``; a
    FileNotFoundError, and any error whose message already names the path, pass unchanged."""
    try:
        yield
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - the libraries raise many kinds; all mean "bad file"
        if str(path) in str(e):
            raise
        raise ValueError(f"{path}: cannot read this {what} ({type(e).__name__}: {e}); is it "
                         "truncated or corrupt?") from e
