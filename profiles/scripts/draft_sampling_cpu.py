"""Argmax drafts vs drafts sampled from q (probabilities kept for the acceptance test), at T > 0.

CPU, a tiny bigram target and an EAGLE-3 head trained on it for 150 steps (as in the tests).
Run: python profiles/scripts/draft_sampling_cpu.py  (from the repository root)
"""
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from compiled_spec import LLM, SamplingParams  # noqa: E402
from compiled_spec.models.gguf_loader import find_default_gguf  # noqa: E402
from compiled_spec.train import TrainConfig, train  # noqa: E402
from tests.spec_models import write_bigram_target, write_id_prompts  # noqa: E402

root = Path(tempfile.mkdtemp())
tok = find_default_gguf()
target = write_bigram_target(root / "target", vocab=32, layers=2)
head = str(train(TrainConfig(
    target=target, prompts=write_id_prompts(root / "p.jsonl", 32, vocab=32), out=str(root / "head"),
    tokenizer=tok, draft_vocab_size=24, ttt_steps=3, steps=150, batch_size=8, lr=5e-3,
    warmup_steps=10, max_seq_len=64, max_new_tokens=40, ignore_eos=True,
    log_every=50, save_every=0, seed=0)))
rng = random.Random(123)
prompts = [[rng.randrange(31) for _ in range(rng.randint(1, 8))] for _ in range(64)]
print(f"{'T':>4s} {'k':>2s} {'drafts':>7s} {'tau':>6s}  per-position acceptance")
for temp in (0.5, 1.0):
    for k in (3, 5):
        for mode in ("argmax", "sample"):
            llm = LLM(model=target, tokenizer=tok, draft=head, num_speculative_tokens=k,
                      draft_sampling=mode, max_model_len=128, max_num_seqs=64)
            sps = [SamplingParams(max_tokens=48, temperature=temp, seed=s, ignore_eos=True)
                   for s in range(len(prompts))]
            llm.generate(prompts, sps)
            st = llm.stats.spec
            rates = " ".join(f"{x:.2f}" for x in st.acceptance_rate_per_position)
            print(f"{temp:4.1f} {k:2d} {mode:>7s} {st.mean_acceptance_length:6.3f}  [{rates}]", flush=True)
