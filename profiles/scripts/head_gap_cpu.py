"""Issue 5: is the gap between the head's training accuracy and its engine acceptance a
train/inference mismatch, or only where the engine drafts? (CPU, fp32.)

python profiles/scripts/head_gap_cpu.py [--num-prompts 8] [--max-tokens 96] [--k-list 1 5]
                                [--set mt_bench|heldout]

For every prompt the engine (shipped ``smollm2-eagle3`` head, chain drafts, greedy) writes the
response; a hook around ``ModelRunner.execute`` records every drafting step: the sequence index p
that the first draft d_1 was proposed for, d_1 itself, and whether it was accepted. Then, on the
same final token sequences, the trainer's own feature path (``TargetFeaturizer`` + ``ttt_forward``
with the same draft module) gives the head's teacher-forced predictions: TTT position j reads
(t_{j+1}, aux_j) and predicts t_{j+2}, so the engine's step at p corresponds to j = p - 2.

Reported per k:
  engine_acc_drafted  engine first-draft acceptance (= a_1), over its drafting steps
  tf_acc_drafted      teacher-forced step-1 accuracy at exactly those positions
  d1_agree            engine d_1 == teacher-forced prediction there (1.0 = no mismatch at all)
  ds_agree_when_prefix_correct  [rate, count] per draft s: engine d_s == TTT step-s prediction
                      at the same position, over steps where d_1..d_{s-1} were the true tokens
  tf_acc_all          teacher-forced step-1 accuracy over all response positions
  tf_trainer_metric   the trainer's accuracy (draft argmax == target argmax *over the draft
                      vocab*, per TTT step 1..5) over the response positions, as in heldout.py
With --trainer-eval N: the trainer's own held-out loss/accuracy (``heldout.evaluate``) on N
held-out prompts answered as the trainer answers them, to compare with the logged val_acc.
Accuracy everywhere else is "the draft's token == the target's greedy token", what the engine
accepts.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch

from compiled_spec import LLM, SamplingParams
from compiled_spec.bench.prompts import load_mt_bench, mt_bench_prompts
from compiled_spec.train.data import load_prompts
from compiled_spec.train.features import TargetFeaturizer
from compiled_spec.train.heldout import split_prompts
from compiled_spec.train.ttt import label_mask, ttt_forward


def hook_drafting_steps(llm: LLM) -> dict[int, list[tuple[int, int, int, int]]]:
    """Wrap the runner's execute: per req_id a list of (p, accepted drafts, d_1, target token
    at p, [d_1..d_k]) for every verification that carried drafts."""
    runner = llm.engine.runner
    log: dict[int, list[tuple[int, int, int, int]]] = defaultdict(list)
    orig = runner.execute

    def execute(reqs, num_new):
        pre = [(r.req_id, r.num_tokens, runner._draft_row.get(r.req_id)) for r in reqs]
        drafts = None if runner._drafts is None else runner._drafts.clone()
        out = orig(reqs, num_new)
        for (rid, p, row), k_d, toks in zip(pre, out.num_draft, out.new_tokens):
            if k_d > 0:
                log[rid].append((p, len(toks) - 1, int(drafts[row, 0]), int(toks[0]),
                                 drafts[row, :k_d].tolist()))
        return out

    runner.execute = execute
    return log


@torch.no_grad()
def teacher_forced(llm: LLM, seq: list[int], num_steps: int = 5) -> dict[str, torch.Tensor]:
    """The trainer's path on one sequence: per position j, the step-s draft token (target ids)
    and the target's argmax over the draft vocab / over the full vocab at j+1."""
    draft, target = llm.engine.draft, llm.engine.model
    dev = target.lm_head.weight.device
    vocab_ids = draft.draft_to_target(torch.arange(draft.config.draft_vocab_size, device=dev))
    feats = TargetFeaturizer(target, draft.aux_layer_ids, vocab_ids)
    ids = torch.tensor([seq], dtype=torch.int64, device=dev)
    aux, tlogits = feats(ids, torch.tensor([len(seq)], device=dev))  # [1,S,3h], [1,S,V_draft]
    # the same lines as ttt_loss
    n_aux = len(draft.aux_layer_ids)
    hidden = draft.combine_aux(list(aux.chunk(n_aux, dim=-1)))
    draft_in = torch.nn.functional.pad(ids[:, 1:], (0, 1))
    positions = torch.arange(len(seq), device=dev).expand(1, len(seq))
    outs = ttt_forward(draft, draft_in, hidden, positions, num_steps)
    pred = torch.stack([draft.draft_to_target(draft.compute_logits(f).argmax(-1))[0]
                        for _, f in outs])  # [steps, S] target ids: prediction for t_{j+2}
    labels = torch.nn.functional.pad(tlogits[:, 1:], (0, 0, 0, 1))[0]  # [S, V_draft]
    # full-vocab target argmax at j+1 (the engine's greedy token at j+2), from the same features
    full = torch.nn.functional.pad(_full_logits(feats, target, ids)[1:], (0, 0, 0, 1))
    return {"pred": pred.cpu(), "target_top_draft_vocab": vocab_ids[labels.argmax(-1)].cpu(),
            "target_top": full.argmax(-1).cpu()}


def _full_logits(feats: TargetFeaturizer, target, ids: torch.Tensor) -> torch.Tensor:
    head = feats.head
    feats.head = target.lm_head.weight
    try:
        return feats(ids, torch.tensor([ids.shape[1]], device=ids.device))[1][0]  # [S, V]
    finally:
        feats.head = head


def trainer_eval(a: argparse.Namespace) -> None:
    """The trainer's held-out numbers for this head, recomputed here: val sequences made with
    the trainer's ``generate_sequences`` (greedy, 256 new tokens, max_seq_len 768, as in
    profiles/scripts/train_h200.sh) from the first N held-out prompts, then ``heldout.evaluate`` with
    the draft's fp32 weights under the trainer's autocast (bf16 on CUDA with a bf16 target)."""
    from contextlib import nullcontext

    from compiled_spec.draft.loader import load_draft
    from compiled_spec.heads import resolve_draft
    from compiled_spec.train.multiturn import generate_sequences
    from compiled_spec.train.heldout import evaluate
    from compiled_spec.train.step import TTTStep
    from compiled_spec.train.trainer import TrainConfig

    t0 = time.perf_counter()
    _, val = split_prompts(load_prompts(a.train_prompts), 256, 0)
    llm = LLM(model=a.model, dtype=a.dtype, device=a.device, max_model_len=768,
              max_num_seqs=a.trainer_eval)
    seqs = generate_sequences(llm, val[:a.trainer_eval], max_new_tokens=256, max_seq_len=768,
                              batch_size=a.trainer_eval)
    target = llm.engine.model
    device = target.lm_head.weight.device
    draft = load_draft(resolve_draft(a.draft), target, torch.float32, device)  # fp32 master
    vocab_ids = draft.draft_to_target(torch.arange(draft.config.draft_vocab_size, device=device))
    feats = TargetFeaturizer(target, draft.aux_layer_ids, vocab_ids)
    cfg = TrainConfig(target="-", prompts="-", out="-", ttt_steps=5, batch_size=4,
                      ttt_impl="packed" if device.type == "cuda" else "padded",
                      batch_tokens=32768)
    backend = nullcontext()
    if a.sdpa_math:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = sdpa_kernel(SDPBackend.MATH)
    with backend:
        ev = evaluate(draft, TTTStep(feats, cfg), seqs)
        loss, acc = ev.loss, ev.accuracy
    print(json.dumps({"trainer_eval_prompts": len(seqs), "dtype": a.dtype, "device": a.device,
                      "sdpa_math": a.sdpa_math,
                      "response_tokens": sum(len(s.response_ids()) for s in seqs),
                      "val_loss": round(loss, 4), "val_acc": [round(x, 4) for x in acc],
                      "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    del llm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="target (default: the SmolLM2 GGUF)")
    ap.add_argument("--set", choices=["mt_bench", "heldout", "trained"], default="mt_bench")
    ap.add_argument("--prompts", default=None, help="default: the MT-bench file shipped in "
                    "compiled_spec/data")
    ap.add_argument("--train-prompts", default="../shared/data/train_prompts.jsonl")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k-list", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--draft", default="smollm2-eagle3")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--trainer-eval", type=int, default=0, metavar="N",
                    help="also run the trainer's own held-out evaluation (heldout.evaluate) on "
                         "N held-out prompts answered as the trainer does (greedy, 256 tokens)")
    ap.add_argument("--sdpa-math", action="store_true",
                    help="trainer-eval with torch's MATH SDPA backend forced (GPU check)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.trainer_eval:
        trainer_eval(a)
    if a.set == "mt_bench":
        from compiled_spec.data import mt_bench_path

        texts = load_mt_bench(a.prompts or str(mt_bench_path()), a.num_prompts)
    else:  # the trainer's split of the training prompts (seed 0, 256 held out)
        trained, val = split_prompts(load_prompts(a.train_prompts), 256, 0)
        texts = [r.text for r in (val if a.set == "heldout" else trained)[:a.num_prompts]]
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0)
    for k in a.k_list:
        t0 = time.perf_counter()
        llm = LLM(model=a.model, dtype=a.dtype, device=a.device, max_model_len=2048,
                  max_num_seqs=len(texts), draft=a.draft, num_speculative_tokens=k)
        log = hook_drafting_steps(llm)
        prompts = mt_bench_prompts(llm, texts)
        outs = llm.generate(prompts, sp)
        t_engine = time.perf_counter() - t0
        acc_e, acc_tf_d, agree, acc_tf_all = [], [], [], []
        steps_hits = [[0, 0] for _ in range(5)]  # trainer metric per TTT step
        pred_top_ok = [0, 0]  # target_top (features) == the engine's greedy token
        tf_acc_by_step_all = [[0, 0] for _ in range(5)]
        step_agree = [[0, 0] for _ in range(5)]  # engine d_s == TTT step s, inputs equal
        for req_id, (ids, out) in enumerate(zip(prompts, outs)):
            seq = list(ids) + list(out.token_ids)
            tf = teacher_forced(llm, seq)
            n_p, s = len(ids), len(seq)
            resp_j = torch.arange(n_p - 2, s - 2)  # j with t_{j+2} a response token
            t_next = torch.tensor(seq[2:])  # t_{j+2} for j = 0..S-3
            pred0 = tf["pred"][0]
            pred_top_ok[0] += int((tf["target_top"][resp_j] == t_next[resp_j]).sum())
            pred_top_ok[1] += len(resp_j)
            acc_tf_all += (pred0[resp_j] == t_next[resp_j]).tolist()
            mask = label_mask(torch.tensor([[False] * n_p + [True] * (s - n_p)]))[0]
            for st in range(5):
                m = mask & (torch.arange(s) >= st)
                steps_hits[st][0] += int(((tf["pred"][st] == tf["target_top_draft_vocab"]) & m).sum())
                steps_hits[st][1] += int(m.sum())
                mm = m[:s - 2]
                tf_acc_by_step_all[st][0] += int(((tf["pred"][st][:s - 2] == t_next) & mm).sum())
                tf_acc_by_step_all[st][1] += int(mm.sum())
            for p, n_acc, d1, tok, ds in log[req_id]:
                assert seq[p] == tok, (req_id, p)
                # Draft s (1-based) sits at TTT position j = p + s - 3 and predicts t_{p+s-1};
                # when d_1..d_{s-1} equal the true tokens its inputs are the teacher-forced ones.
                for st, d in enumerate(ds[:5]):
                    if ds[:st] != seq[p:p + st] or p + st >= s:
                        break
                    step_agree[st][0] += int(tf["pred"][st][p + st - 2] == d)
                    step_agree[st][1] += 1
                acc_e.append(n_acc >= 1)
                acc_tf_d.append(bool(pred0[p - 2] == seq[p]))
                agree.append(bool(pred0[p - 2] == d1))
        st = llm.stats.spec
        mean = lambda xs: round(sum(xs) / max(1, len(xs)), 4)  # noqa: E731
        row = {
            "set": a.set, "dtype": a.dtype, "k": k, "prompts": len(texts), "max_tokens": a.max_tokens,
            "output_tokens": sum(len(o.token_ids) for o in outs),
            "engine_tau": round(st.mean_acceptance_length, 4),
            "engine_per_position": [round(x, 4) for x in st.acceptance_rate_per_position],
            "drafting_steps": len(acc_e), "engine_steps_stats": st.num_drafting_steps,
            "engine_acc_drafted": mean(acc_e),
            "tf_acc_drafted": mean(acc_tf_d),
            "d1_agree": mean(agree),
            "ds_agree_when_prefix_correct": [[round(h / n, 4), n] for h, n in step_agree if n],
            "tf_acc_all": mean(acc_tf_all), "response_positions": len(acc_tf_all),
            "tf_acc_all_per_step": [round(h / max(1, n), 4) for h, n in tf_acc_by_step_all],
            "tf_trainer_metric_per_step": [round(h / max(1, n), 4) for h, n in steps_hits],
            "features_top_eq_engine_token": round(pred_top_ok[0] / max(1, pred_top_ok[1]), 4),
            "seconds": round(time.perf_counter() - t0, 1), "engine_seconds": round(t_engine, 1),
        }
        print(json.dumps(row), flush=True)
        del llm


if __name__ == "__main__":
    main()
