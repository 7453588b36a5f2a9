"""Data shipped with the package, so a fresh machine needs nothing beside the repository.

``mt_bench_question.jsonl`` is MT-bench's question file (80 two-turn questions, Apache-2.0, from
lm-sys/FastChat ``fastchat/llm_judge/data/mt_bench/question.jsonl``), the evaluation prompts of
``compiled-spec bench / acceptance / parity / profile`` and of the tests. Its name keeps
"mt_bench" so that ``train.data.load_prompts`` refuses to train on it.
"""
from __future__ import annotations

from pathlib import Path

_MT_BENCH = "mt_bench_question.jsonl"


def mt_bench_path() -> Path:
    """Path of the shipped MT-bench question file (a real file: package data is installed as files)."""
    return Path(__file__).resolve().with_name(_MT_BENCH)


__all__ = ["mt_bench_path"]
