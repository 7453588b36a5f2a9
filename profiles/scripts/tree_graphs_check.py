"""Issue 7 on a GPU: draft trees through compile=True + CUDA graphs (strict capture) give the
eager tree engine's and vanilla decoding's exact output (fp32), at page 1 / 16, topk 2 / 4, with a
target whose attention matters, and seeded sampling.

python profiles/scripts/tree_graphs_check.py [--fixtures DIR] [--tokenizer GGUF_OR_DIR]

Fixtures: the bigram target and EAGLE-3 head the tests train (tests/conftest.py's
trained_eagle3_pair: 150 CPU-cheap steps), built into DIR on first use.
"""
import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from compiled_spec import LLM, SamplingParams  # noqa: E402
from compiled_spec.compile import CompileConfig  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--fixtures", default=".device/tc")
ap.add_argument("--tokenizer", default=os.path.expanduser("~/m/model.gguf"))
args = ap.parse_args()
FX = Path(args.fixtures)
if not (FX / "head" / "config.json").is_file():
    from compiled_spec.train import TrainConfig, train
    from tests.spec_models import write_bigram_target, write_id_prompts

    FX.mkdir(parents=True, exist_ok=True)
    target = write_bigram_target(FX / "target", vocab=32, layers=2)
    prompts = write_id_prompts(FX / "prompts.jsonl", 32, vocab=32)
    train(TrainConfig(target=target, prompts=prompts, out=str(FX / "head"),
                      tokenizer=args.tokenizer, draft_vocab_size=24, ttt_steps=3, steps=150,
                      batch_size=8, lr=5e-3, warmup_steps=10, max_seq_len=64,
                      max_new_tokens=40, ignore_eos=True, log_every=50, save_every=0, seed=0))
T, H = str(FX / "target"), str(FX / "head")
TOK = str(FX / "tok") if (FX / "tok").is_dir() else args.tokenizer
PROMPTS = [[3, 7, 1], [5], [9, 2, 4, 4, 8, 1, 2], [11, 12], [6, 6, 6, 1, 2, 30, 8, 8, 8, 1]]
SP = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
SPS = [SamplingParams(max_tokens=24, temperature=t, top_p=tp, seed=s, ignore_eos=True)
       for t, tp, s in ((0.8, 1.0, 1), (0.0, 1.0, 0), (1.2, 0.9, 5), (0.5, 1.0, 9), (1.0, 1.0, 3))]
kw = dict(model=T, tokenizer=TOK, max_model_len=128, max_num_seqs=4, dtype='float32', device='cuda')

def attn(llm):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in llm.engine.model.model.layers:
            w = layer.self_attn.o_proj.weight
            w.copy_((torch.randn(w.shape, generator=g) * 0.3).to(w.device))
    return llm

def ids(llm, sp=SP):
    return [o.token_ids for o in llm.generate(PROMPTS, sp)]

van = ids(LLM(**kw)); van_s = ids(LLM(**kw), SPS); van_a = ids(attn(LLM(**kw)))
for page, topk, budget, a in ((1, 2, 6, False), (16, 4, 12, False), (16, 2, 6, True)):
    tk = dict(page_size=page, draft=H, num_speculative_tokens=3, speculative_topk=topk,
              speculative_num_draft_tokens=budget)
    ref = van_a if a else van
    e = LLM(**kw, **tk)
    if a: attn(e)
    eo = ids(e); te = e.stats.spec.as_dict()
    t0 = time.time()
    c = LLM(**kw, **tk, compile=True, compile_config=CompileConfig(strict_capture=True))
    if a: attn(c)
    co = ids(c); tc = c.stats.spec.as_dict()
    st = c.compile_stats['cuda_graphs']
    print(f"page {page} topk {topk} budget {budget} attn {a}: eager==van {eo == ref} "
          f"compiled==van {co == ref} spec equal {te == tc} tau {te['mean_acceptance_length'] if 'mean_acceptance_length' in te else te}"
          f" startup {c.startup_s}", flush=True)
    print("  replayed", st['replayed'], "without_graph", st['without_graph'],
          {k: v['graph_replays'] for k, v in st['components'].items()}, flush=True)
    if not a and page == 16:
        so = ids(c, SPS)
        print("  seeded compiled==vanilla", so == van_s, flush=True)
