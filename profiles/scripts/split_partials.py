"""Gather self-distilled sequences from generation shards into the trainer's data.jsonl and
val.jsonl: each shard's data.jsonl / val.jsonl, or its data.partial.jsonl where the process was
stopped before writing them (the chunks it finished). Held-out ids come from the trainer's own
seeded split, rebuilt from a shard's train_config.json (prompts, ShareGPT file, held-out count,
seed); a sequence seen twice is kept once.
Usage: python profiles/scripts/split_partials.py OUT_DIR TRAIN_CONFIG_JSON FILE..."""
import json
import sys
from pathlib import Path

from compiled_spec.train.corpus import load_rows
from compiled_spec.train.data import load_sequences, save_sequences
from compiled_spec.train.heldout import split_prompts
from compiled_spec.train.trainer import TrainConfig

out, config, *parts = sys.argv[1:]
cfg = TrainConfig(**json.loads(Path(config).read_text()))
_, val_rows = split_prompts(load_rows(cfg), cfg.val_prompts, cfg.seed)
val_ids = {r.id for r in val_rows}
seqs = list({s.id: s for p in reversed(parts)
             for s in load_sequences(Path(p), strict=False)}.values())
val = [s for s in seqs if s.id in val_ids]
train = [s for s in seqs if s.id not in val_ids]
save_sequences(Path(out) / "data.jsonl", train)
save_sequences(Path(out) / "val.jsonl", val)
print(f"{len(train)} training and {len(val)} held-out sequences")
