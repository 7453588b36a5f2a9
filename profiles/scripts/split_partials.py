"""Gather self-distilled sequences from generation shards into the trainer's data.jsonl and
val.jsonl: each shard's data.jsonl / val.jsonl, or its data.partial.jsonl where the process was
stopped before writing them (the chunks it finished). Held-out ids come from the trainer's seeded
split (600 held-out prompts, seed 0, 3 turns: train_sharegpt_h200.sh's settings); a sequence
seen twice is kept once.
Usage: python profiles/scripts/split_partials.py OUT_DIR PROMPTS SHAREGPT FILE..."""
import sys
from pathlib import Path

from compiled_spec.train.corpus import load_rows
from compiled_spec.train.data import load_sequences, save_sequences
from compiled_spec.train.heldout import split_prompts
from compiled_spec.train.trainer import TrainConfig

out, prompts, sharegpt, *parts = sys.argv[1:]
cfg = TrainConfig(target="x", prompts=prompts, sharegpt=sharegpt, max_turns=3, out=out)
_, val_rows = split_prompts(load_rows(cfg), 600, 0)
val_ids = {r.id for r in val_rows}
seqs = list({s.id: s for p in reversed(parts)
             for s in load_sequences(Path(p), strict=False)}.values())
val = [s for s in seqs if s.id in val_ids]
train = [s for s in seqs if s.id not in val_ids]
save_sequences(Path(out) / "data.jsonl", train)
save_sequences(Path(out) / "val.jsonl", val)
print(f"{len(train)} training and {len(val)} held-out sequences")
