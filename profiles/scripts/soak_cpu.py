"""Issue 17: a 1,000-request soak on the CPU, vanilla and EAGLE-3, on tiny synthetic checkpoints.

Mixed sampling parameters (greedy, temperature, top-k/p, min-p, stop ids, stop strings, n > 1,
speculate=False, numpy / tuple prompts) from tests/fuzz_requests.py, a few injected bad requests (refused by
validation, then the call is resubmitted without them) and a few injected faults (a request
whose step raises inside the runner). Requests go in as calls of ``--chunk`` prompts, with a KV
pool small enough to preempt. Reports, per engine: requests served / refused / aborted, KV
blocks back in the pool after every call, RSS (after warm-up, peak, end), and whether every
served output equals the same request run alone afterwards.

python profiles/scripts/soak_cpu.py [--requests 1000] [--chunk 50] [--seed 0] [--engines vanilla eagle3]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from compiled_spec import LLM, SamplingParams  # noqa: E402
from compiled_spec.models.gguf_loader import find_default_gguf  # noqa: E402
from tests.fuzz_requests import FuzzRequest, inject_faults, random_request  # noqa: E402

VOCAB, MAX_LEN = 32, 64


def rss_mib() -> tuple[float, float]:
    """(current, peak) resident set size of this process, MiB, from /proc/self/status."""
    vals = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                vals[line.split(":")[0]] = int(line.split()[1]) / 1024
    return vals.get("VmRSS", float("nan")), vals.get("VmHWM", float("nan"))


def build_fixtures(root: Path, trained: bool) -> tuple[str, str]:
    """A bigram target and an EAGLE-3 head for it: trained for 150 steps as in
    tests/conftest.py's trained_eagle3_pair (so drafts are accepted and the verify paths run;
    a minute or two on the CPU), or random with ``trained=False``."""
    from compiled_spec.draft.testing import write_eagle3_head
    from compiled_spec.models.config import ModelConfig
    from tests.spec_models import write_bigram_target, write_id_prompts

    target = write_bigram_target(root / "target", vocab=VOCAB, layers=2)
    if not trained:
        cfg = ModelConfig.from_hf_dict(json.loads((root / "target" / "config.json").read_text()))
        return target, write_eagle3_head(str(root / "head"), cfg, draft_vocab_size=24,
                                         aux_layer_ids=(0, 1, 1))
    from compiled_spec.train import TrainConfig, train

    prompts = write_id_prompts(root / "prompts.jsonl", 32, vocab=VOCAB)
    out = train(TrainConfig(
        target=target, prompts=prompts, out=str(root / "head"), tokenizer=find_default_gguf(),
        draft_vocab_size=24, ttt_steps=3, steps=150, batch_size=8, lr=5e-3, warmup_steps=10,
        max_seq_len=64, max_new_tokens=40, ignore_eos=True, log_every=50, save_every=0, seed=0))
    return target, str(out)


def make_requests(n: int, seed: int, p_bad: float = 0.02,
                  p_fault: float = 0.01) -> list[FuzzRequest]:
    """``n`` requests, ~2% refused by validation, ~1% with an injected fault; every valid one
    seeded (or greedy), so a solo rerun must give the same tokens."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        r = random_request(rng, VOCAB, MAX_LEN, p_bad=p_bad, p_fault=p_fault)
        if r.params is not None and not r.bad and r.params.seed is None:
            r.params.seed = 10_000 + i
        reqs.append(r)
    return reqs


def soak(kind: str, target: str, head: str, reqs: list[FuzzRequest], chunk: int,
         solo: bool = True) -> dict:
    kw = dict(model=target, tokenizer=find_default_gguf(), max_model_len=MAX_LEN, page_size=4,
              max_num_seqs=8, num_kv_blocks=64)
    if kind == "eagle3":
        kw.update(draft=head, num_speculative_tokens=3)
    llm = LLM(**kw)
    inject_faults(llm)
    alloc = llm.engine.allocator
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))  # warm-up
    rss0 = rss_mib()[0]
    res = dict(engine=kind, requests=len(reqs), refused=0, refused_calls=0, served=0,
               aborted_faults=0, faults_not_hit=0, calls=0, blocks_total=alloc.num_blocks,
               calls_with_blocks_missing=0, leftover_requests=0, tokens=0)
    served: list[tuple[FuzzRequest, list[int]]] = []
    rss_max = rss0
    t0 = time.perf_counter()
    for s in range(0, len(reqs), chunk):
        part = reqs[s:s + chunk]
        if any(r.bad for r in part):
            try:
                if any(r.params is None for r in part):
                    raise ValueError("refused at construction")
                llm.generate([r.prompt for r in part], [r.params for r in part])
                raise AssertionError("a call with a bad request was not refused")
            except ValueError:
                res["refused_calls"] += 1
            res["refused"] += sum(r.bad for r in part)
            part = [r for r in part if not r.bad]
        outs = llm.generate([r.prompt for r in part], [r.params for r in part])
        res["calls"] += 1
        for r, o in zip(part, outs):
            if o.finish_reason == "abort":
                assert r.fault and "injected fault" in (o.outputs[0].error or ""), o
                res["aborted_faults"] += 1
            elif r.fault:
                res["faults_not_hit"] += 1  # its last step came before the faulty call
            else:
                assert o.finish_reason in ("stop", "length"), o
                res["served"] += 1
                res["tokens"] += sum(len(c.token_ids) for c in o.outputs)
                served.append((r, [c.token_ids for c in o.outputs]))
        if alloc.num_free != alloc.num_blocks or alloc.tables:
            res["calls_with_blocks_missing"] += 1
        res["leftover_requests"] += int(llm.engine.has_unfinished())
        rss_max = max(rss_max, rss_mib()[0])
    res["soak_s"] = round(time.perf_counter() - t0, 1)
    res["blocks_free_at_end"] = alloc.num_free
    res["num_step_faults"] = llm.stats.num_step_faults
    res["num_preemptions"] = llm.stats.num_preemptions
    if kind == "eagle3":
        res["mean_acceptance_length"] = round(llm.stats.spec.mean_acceptance_length or 0.0, 3)
        res["requests_without_speculation"] = llm.stats.num_requests_without_speculation
    res["rss_mib_after_warmup"] = round(rss0, 1)
    res["rss_mib_max_during"] = round(rss_max, 1)
    res["rss_mib_end"] = round(rss_mib()[0], 1)
    if solo:
        t0 = time.perf_counter()
        mismatches = [i for i, (r, toks) in enumerate(served)
                      if [c.token_ids for c in llm.generate([r.prompt], r.params)[0].outputs]
                      != toks]
        res["solo_checked"] = len(served)
        res["solo_mismatches"] = len(mismatches)
        res["solo_s"] = round(time.perf_counter() - t0, 1)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--chunk", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engines", nargs="+", default=["vanilla", "eagle3"])
    ap.add_argument("--no-solo", action="store_true", help="skip the solo reruns")
    ap.add_argument("--random-head", action="store_true", help="skip training the head")
    a = ap.parse_args(argv)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        target, head = build_fixtures(Path(tmp), trained=not a.random_head)
        for kind in a.engines:
            res = soak(kind, target, head, make_requests(a.requests, a.seed), a.chunk,
                       solo=not a.no_solo)
            print(json.dumps(res), flush=True)
            ok &= (res["calls_with_blocks_missing"] == 0 and res["leftover_requests"] == 0
                   and res.get("solo_mismatches", 0) == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
