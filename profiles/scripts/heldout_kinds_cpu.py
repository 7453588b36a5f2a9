"""Issue 14's held-out mix of prompt kinds (prose, code, math, QA, summarisation): the first user
turn of each held-out sequence of the self-distilled data (``val.jsonl.gz``: never trained on,
not MT-bench), sorted into kinds by keyword rules, up to 24 per kind (seeded), written as an
MT-bench-style question file whose ``category`` is the kind. ``compiled-spec acceptance`` then
reports tau per kind.

python profiles/scripts/heldout_kinds_cpu.py .device/gen/val.jsonl.gz OUT.jsonl
compiled-spec acceptance --draft smollm2-eagle3 --prompts OUT.jsonl --num-prompts 1000 \
    --max-tokens 192 --k-list 5 --max-num-seqs 128 --max-model-len 2048
"""
import gzip
import json
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from compiled_spec.models.gguf_loader import find_default_gguf  # noqa: E402
from compiled_spec.tokenizer import load_tokenizer  # noqa: E402

PER_KIND = 24
CODE = re.compile(r"\b(python|java|javascript|c\+\+|sql|function|code|program|script|html|css|"
                  r"regex|algorithm|class|array|compile|bash)\b", re.I)
MATH = re.compile(r"(\d+\s*[\+\-\*/x×^]\s*\d+|\bcalculate|\bsolve|\bequation|\bsum of|"
                  r"\bprobability|\bpercent|\bhow many|\barea of|\bderivative|\bintegral)", re.I)
SUMMARY = re.compile(r"\b(summar|tl;dr|condense|in one sentence|main points|key points)", re.I)
PROSE = re.compile(r"^(write|compose|create|draft|generate)\b.*\b(story|poem|essay|letter|email|"
                   r"blog|article|speech|paragraph|description|review|song|dialogue|tweet|post)",
                   re.I | re.S)
QA = re.compile(r"^(what|who|when|where|why|how|which|is|are|can|does|do|name|explain|describe)"
                r"\b.*\?\s*$", re.I | re.S)


ORDER = ("code", "math", "summarisation", "prose", "qa")


def kind_of(text: str) -> str | None:
    """First rule that matches, in ORDER (a code question about sums is code)."""
    for name, rule in zip(ORDER, (CODE, MATH, SUMMARY, PROSE, QA)):
        if rule.search(text):
            return name
    return None


def main() -> None:
    src, dst = sys.argv[1], sys.argv[2]
    tok = load_tokenizer(find_default_gguf())
    kinds: dict[str, list[tuple[str, str]]] = {}
    seen: set[str] = set()
    for line in gzip.open(src, "rt"):
        row = json.loads(line)
        m = re.search(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", tok.decode(row["input_ids"]), re.S)
        text = m.group(1).strip() if m else ""
        kind = kind_of(text) if text and len(text) <= 1500 and text not in seen else None
        if kind:
            seen.add(text)
            kinds.setdefault(kind, []).append((row["id"], text))
    random.seed(0)
    with open(dst, "w") as f:
        for kind in ORDER:
            rows = kinds.get(kind, [])
            print(f"{kind}: {len(rows)} held-out prompts, {min(PER_KIND, len(rows))} kept")
            for i, text in random.sample(rows, min(PER_KIND, len(rows))):
                f.write(json.dumps({"question_id": f"val-{i}", "category": kind,
                                    "turns": [text]}) + "\n")


if __name__ == "__main__":
    main()
