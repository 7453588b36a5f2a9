"""Issue 5: the trainer's held-out TTT loss and per-step accuracy for any head on a saved set of
sequences (the trainer's own ``val.jsonl``), so the head as trained (fp32, ``HEAD_DIR/best``) and
as exported (bf16) can be compared on exactly the data the training log scored.

python profiles/scripts/eval_head_val.py --model ~/m/model.gguf --head HEAD --val HEAD_DIR/val.jsonl

On the GPU the trainer's packed step scores the batches; on the CPU the padded reference does (a
dense [T, 5T] mask over a packed batch would not fit). ``--sample N`` scores a seeded random N.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from compiled_spec.draft.loader import load_draft  # noqa: E402
from compiled_spec.heads import resolve_draft  # noqa: E402
from compiled_spec.models.loader import load_model  # noqa: E402
from compiled_spec.train.config import TrainConfig  # noqa: E402
from compiled_spec.train.data import load_sequences  # noqa: E402
from compiled_spec.train.features import TargetFeaturizer  # noqa: E402
from compiled_spec.train.heldout import evaluate  # noqa: E402
from compiled_spec.train.step import TTTStep  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--head", required=True)
    ap.add_argument("--val", required=True, help="sequences file (the trainer's val.jsonl)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--ttt-steps", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=4, help="padded: sequences per batch")
    ap.add_argument("--batch-tokens", type=int, default=32768, help="packed: tokens per batch")
    ap.add_argument("--impl", choices=("packed", "padded"), default=None,
                    help="default: packed on the GPU, padded on the CPU")
    ap.add_argument("--sample", type=int, default=None, help="a seeded random N sequences")
    a = ap.parse_args()
    dev = torch.device(a.device)
    t0 = time.perf_counter()
    target_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # as the trainer
    target, _ = load_model(a.model, target_dtype, dev)
    # The head in fp32 whatever its file holds, under bf16 autocast on the GPU: how the trainer
    # evaluates, so only the weights' values differ between a trained and an exported head.
    draft = load_draft(resolve_draft(a.head), target, torch.float32, dev)
    draft_ids = draft.draft_to_target(torch.arange(draft.config.draft_vocab_size, device=dev))
    feats = TargetFeaturizer(target, draft.aux_layer_ids, draft_ids)
    seqs = load_sequences(Path(a.val))
    if a.sample is not None and a.sample < len(seqs):
        pick = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(0))[:a.sample]
        seqs = [seqs[i] for i in sorted(pick.tolist())]
    impl = a.impl or ("packed" if dev.type == "cuda" else "padded")
    # The trainer's own config with its defaults (plain weights, labels at T = 1): every head
    # is scored alike whatever options trained it, and new TTT options need no mirror here.
    cfg = TrainConfig(target=a.model, prompts="-", out="-", batch_size=a.batch_size,
                      ttt_steps=a.ttt_steps, ttt_impl=impl, batch_tokens=a.batch_tokens,
                      max_seq_len=2048)
    ev = evaluate(draft, TTTStep(feats, cfg), seqs)
    print(json.dumps({"head": a.head, "val": a.val, "sequences": len(seqs), "impl": impl,
                      "val_loss": round(ev.loss, 4), "val_acc": [round(x, 4) for x in ev.accuracy],
                      "val_acc_by_kind": {k: [round(x, 4) for x in v]
                                          for k, v in ev.accuracy_by_kind.items()},
                      "val_acc_novel": [round(x, 4) for x in ev.accuracy_novel],
                      "seconds": round(time.perf_counter() - t0, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
