"""Issue 5: the trainer's held-out TTT loss and per-step accuracy for any head on a saved set of
sequences (the trainer's own ``val.jsonl``), so the head as trained (fp32, ``HEAD_DIR/best``) and
as exported (bf16) can be compared on exactly the data the training log scored.

python profiles/scripts/eval_head_val.py --model ~/m/model.gguf --head HEAD --val HEAD_DIR/val.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from compiled_spec.draft.loader import load_draft  # noqa: E402
from compiled_spec.heads import resolve_draft  # noqa: E402
from compiled_spec.models.loader import load_model  # noqa: E402
from compiled_spec.train.data import load_sequences  # noqa: E402
from compiled_spec.train.features import TargetFeaturizer  # noqa: E402
from compiled_spec.train.heldout import evaluate  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--head", required=True)
    ap.add_argument("--val", required=True, help="sequences file (the trainer's val.jsonl)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--ttt-steps", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=32)
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
    cfg = SimpleNamespace(batch_size=a.batch_size, ttt_steps=a.ttt_steps, ttt_decay=0.8)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda"
                else nullcontext())
    ev = evaluate(draft, feats, seqs, cfg, autocast)
    print(json.dumps({"head": a.head, "val": a.val, "sequences": len(seqs),
                      "val_loss": round(ev.loss, 4), "val_acc": [round(x, 4) for x in ev.accuracy],
                      "val_acc_by_kind": {k: [round(x, 4) for x in v]
                                          for k, v in ev.accuracy_by_kind.items()},
                      "seconds": round(time.perf_counter() - t0, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
