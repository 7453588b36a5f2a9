"""How much of the target's text a context lookup predicts (``TrainSequence.copyable``: the
bigram before a token occurred earlier in the sequence, followed by the same token), per kind of
a sequences file (the trainer's val.jsonl / data.jsonl) and, with --mt-bench N, over the target's
greedy answers to the first N MT-bench first turns (CPU, fp32).

  python profiles/scripts/copy_rate.py --val HEAD_DIR/val.jsonl [--mt-bench 16 --max-tokens 256]

A small target's long greedy replies loop; the held-out accuracy of a head is then mostly the
accuracy on loops, which MT-bench answers have fewer of.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from compiled_spec.train.data import TrainSequence, load_sequences  # noqa: E402


def rate(seqs: list[TrainSequence]) -> dict[str, dict[str, float]]:
    by: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for s in seqs:
        copy = s.copyable()
        hits = sum(copy[p] for a, b in s.loss_spans() for p in range(max(a, 2), b))
        total = sum(b - max(a, 2) for a, b in s.loss_spans() if b > max(a, 2))
        for k in (s.kind or "unknown", "all"):
            by[k][0] += hits
            by[k][1] += total
            by[k][2] += 1
    return {k: {"sequences": n, "reply_tokens": t, "copyable": round(h / max(t, 1), 3)}
            for k, (h, t, n) in sorted(by.items())}


def mt_bench(n: int, max_tokens: int) -> list[TrainSequence]:
    import torch

    from compiled_spec import LLM, SamplingParams
    from compiled_spec.bench.prompts import load_mt_bench
    from compiled_spec.data import mt_bench_path

    torch.set_num_threads(1)
    llm = LLM(dtype="float32", device="cpu", max_model_len=1024, max_num_seqs=n)
    ids = [llm.encode_chat([{"role": "user", "content": t}])
           for t in load_mt_bench(str(mt_bench_path()), n)]
    outs = llm.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return [TrainSequence(str(i), p + list(o.outputs[0].token_ids), len(p), kind="mt_bench")
            for i, (p, o) in enumerate(zip(ids, outs))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--val", default=None, help="a sequences file (val.jsonl, data.jsonl)")
    ap.add_argument("--mt-bench", type=int, default=0, metavar="N")
    ap.add_argument("--max-tokens", type=int, default=256)
    a = ap.parse_args()
    out = {}
    if a.val:
        out["file"] = rate(load_sequences(Path(a.val)))
    if a.mt_bench:
        out["mt_bench_greedy"] = rate(mt_bench(a.mt_bench, a.max_tokens))
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
