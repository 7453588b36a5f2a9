"""Step-1 teacher-forced accuracy on saved sequences (gap_probe_cpu.py's OUT.seqs.jsonl) by
MT-bench category, copyable x target-confidence strata, and the most missed target tokens.

python profiles/scripts/gap_breakdown_cpu.py /tmp/gap/mt80.seqs.jsonl [--mt-bench] [--limit N]
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from compiled_spec.bench.prompts import load_categories  # noqa: E402
from compiled_spec.data import mt_bench_path  # noqa: E402
from compiled_spec.draft.loader import load_draft  # noqa: E402
from compiled_spec.heads import resolve_draft  # noqa: E402
from compiled_spec.models.gguf_loader import find_default_gguf  # noqa: E402
from compiled_spec.models.loader import load_model  # noqa: E402
from compiled_spec.tokenizer import load_tokenizer  # noqa: E402
from compiled_spec.train.data import load_sequences  # noqa: E402
from gap_probe_cpu import TF, conf_bucket  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("seqs")
    ap.add_argument("--mt-bench", action="store_true")
    ap.add_argument("--limit", type=int, default=None)
    a = ap.parse_args()
    torch.set_num_threads(2)
    g = find_default_gguf()
    target, _ = load_model(g, torch.float32, "cpu")
    draft = load_draft(resolve_draft("smollm2-eagle3"), target, torch.float32, "cpu")
    tok = load_tokenizer(g)
    tf = TF(target, draft)
    seqs = load_sequences(Path(a.seqs))[:a.limit]
    cats = load_categories(str(mt_bench_path()), len(seqs)) if a.mt_bench else [s.kind for s in seqs]
    by = defaultdict(lambda: [0, 0])
    missed, missed_ctx = Counter(), Counter()
    for s, c in zip(seqs, cats):
        r = tf(s.input_ids)
        cp = s.copyable()
        for lo, hi in s.loss_spans():
            for q in range(max(lo, 2), hi):
                j = q - 2
                hit = bool(r["pred"][0][j] == r["top"][j])
                keys = [f"cat={c}", f"{'copy' if cp[q] else 'novel'} x {conf_bucket(float(r['tconf'][j]))}",
                        f"{'copy' if cp[q] else 'novel'}"]
                for k in keys:
                    by[k][0] += hit
                    by[k][1] += 1
                if not hit:
                    missed[tok.decode([s.input_ids[q]])] += 1
                    missed_ctx[tok.decode([s.input_ids[q - 1]])] += 1
    tot = sum(n for k, (h, n) in by.items() if k.startswith("cat="))
    for k, (h, n) in sorted(by.items()):
        print(f"  {k:34s} n={n:6d} ({n / tot:.3f})  acc={h / n:.3f}  misses={n - h}")
    print("most missed target tokens:", json.dumps(missed.most_common(30)))
    print("most common previous token at a miss:", json.dumps(missed_ctx.most_common(20)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
