"""Benchmark prompts: MT-bench first turns (or any JSONL with ``turns`` or ``prompt``)."""
from __future__ import annotations

import json
from pathlib import Path

from compiled_spec.data import mt_bench_path


def _rows(path: str, n: int) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"prompt file {path!r} not found (MT-bench ships with the package: "
                                f"{mt_bench_path()})")
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()][:n]


def load_mt_bench(path: str, n: int) -> list[str]:
    return [r["turns"][0] if "turns" in r else r["prompt"] for r in _rows(path, n)]


def load_categories(path: str, n: int) -> list[str]:
    """The ``category`` of each of the first ``n`` rows ("" where a row has none): MT-bench's
    writing, roleplay, reasoning, math, coding, extraction, stem and humanities."""
    return [str(r.get("category", "")) for r in _rows(path, n)]


def mt_bench_prompts(llm, texts: list[str]) -> list[list[int]]:  # noqa: ANN001 - an LLM
    """Each question as a one-turn chat with the model's template, as token ids."""
    return [llm.encode_chat([{"role": "user", "content": t}]) for t in texts]


def encode_chat(tokenizer, texts: list[str]) -> list[list[int]]:  # noqa: ANN001
    """``mt_bench_prompts`` without an engine: a tokenizer's chat template, as token ids."""
    from compiled_spec.tokenizer import chat_ids

    return [chat_ids(tokenizer, [{"role": "user", "content": t}]) for t in texts]
