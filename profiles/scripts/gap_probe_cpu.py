"""Held-out accuracy (~0.9 per TTT step) vs MT-bench tau (~2.8 at k=5): distribution or a
train/serve mismatch? (CPU, fp32, eager.)

python profiles/scripts/gap_probe_cpu.py --set mt_bench --num-prompts 8 --max-tokens 128 \
    --out /tmp/gap/mt
python profiles/scripts/gap_probe_cpu.py --set val --num-prompts 8 --max-tokens 128 \
    --out /tmp/gap/valgreedy       # greedy answers to held-out first-turn prompts
python profiles/scripts/gap_probe_cpu.py --set val_tf --num-prompts 48 --out /tmp/gap/valtf
                                   # no engine: the held-out sequences as stored (sampled)

For an engine set: the engine (shipped head, chain k, greedy) answers; a hook on
``ModelRunner.execute`` logs each drafting step (p = position of d_1, drafts, accepted). Then on
the engine's exact token sequences the trainer's path (``TargetFeaturizer`` + ``ttt_forward``,
the functions ``heldout.evaluate`` runs) gives per TTT step s and position j the head's
prediction for t_{j+2}. An engine drafting step at p is replayed from those predictions
(draft s sits at j = p+s-3; its inputs equal the teacher-forced ones as long as d_1..d_{s-1}
were right), so the replayed acceptance must equal the engine's if nothing differs.
Writes OUT.seqs.jsonl (TrainSequence rows, for eval_head_val.py) and OUT.json.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from compiled_spec import LLM, SamplingParams  # noqa: E402
from compiled_spec.bench.prompts import load_mt_bench, mt_bench_prompts  # noqa: E402
from compiled_spec.data import mt_bench_path  # noqa: E402
from compiled_spec.train.data import TrainSequence, save_sequences  # noqa: E402
from compiled_spec.train.features import TargetFeaturizer  # noqa: E402
from compiled_spec.train.ttt import ttt_forward  # noqa: E402
from profiles.scripts.head_gap_cpu import hook_drafting_steps  # noqa: E402


class TF:
    """The trainer's forward on one sequence (features at the full vocab, so the target's
    greedy token and its draft-vocab argmax both come out)."""

    def __init__(self, target, draft, steps: int = 5) -> None:
        self.draft, self.steps = draft, steps
        dev = target.lm_head.weight.device
        self.vocab_ids = draft.draft_to_target(
            torch.arange(draft.config.draft_vocab_size, device=dev))
        self.in_vocab = torch.zeros(target.config.vocab_size, dtype=torch.bool)
        self.in_vocab[self.vocab_ids] = True
        self.feats = TargetFeaturizer(target, draft.aux_layer_ids, None)
        self.dev = dev

    @torch.no_grad()
    def __call__(self, seq: list[int]) -> dict[str, torch.Tensor]:
        d, s = self.draft, len(seq)
        ids = torch.tensor([seq], dtype=torch.int64, device=self.dev)
        aux, logits = self.feats(ids, torch.tensor([s], device=self.dev))  # [1,S,3h],[1,S,V]
        hidden = d.combine_aux(list(aux.chunk(len(d.aux_layer_ids), dim=-1)))
        outs = ttt_forward(d, F.pad(ids[:, 1:], (0, 1)), hidden,
                           torch.arange(s).expand(1, s), self.steps)
        preds, dconf = [], None
        for i, (_, fl) in enumerate(outs):
            lg = d.compute_logits(fl[0])  # [S, V_draft]
            preds.append(d.draft_to_target(lg.argmax(-1)))
            if i == 0:
                dconf = torch.softmax(lg, -1).max(-1).values
        lab = F.pad(logits[0, 1:], (0, 0, 0, 1))  # [S, V]: target's logits for t_{j+2}
        p = torch.softmax(lab, -1)
        return {"pred": torch.stack(preds),  # [steps, S] prediction for t_{j+2}
                "top": lab.argmax(-1),  # target greedy token for t_{j+2}
                "top_dv": self.vocab_ids[lab[:, self.vocab_ids].argmax(-1)],  # trainer label
                "tconf": p.max(-1).values, "dconf": dconf}


def copyable(ids: list[int]) -> list[bool]:
    return TrainSequence("x", ids, 0).copyable()


def categories(tok, seq: list[int], q: int, resp_start: int) -> list[str]:
    """Kinds of the token at position q (a reply token)."""
    t, prev = tok.decode([seq[q]]), tok.decode([seq[q - 1]])
    r = q - resp_start
    out = ["reply[0:4)" if r < 4 else "reply[4:16)" if r < 16 else "reply[16:64)" if r < 64
           else "reply[64:256)" if r < 256 else "reply[256:)"]
    if "\n" in prev:
        out.append("after_newline")
    if "\n" in t:
        out.append("is_newline")
    if any(c.isdigit() for c in t):
        out.append("has_digit")
    st = t.strip()
    if st and all(not c.isalnum() for c in st):
        out.append("punct")
    elif t.startswith(" ") and st:
        out.append("word_start")
    elif st:
        out.append("word_cont")
    if seq[q] == 2:
        out.append("eos")
    return out


def conf_bucket(x: float) -> str:
    return ("tconf<0.5" if x < 0.5 else "tconf[0.5,0.8)" if x < 0.8 else
            "tconf[0.8,0.95)" if x < 0.95 else "tconf>=0.95")


class Tally:
    def __init__(self) -> None:
        self.c: dict[str, list[int]] = defaultdict(lambda: [0, 0])

    def add(self, key: str, hit: bool) -> None:
        self.c[key][0] += int(hit)
        self.c[key][1] += 1

    def table(self) -> dict:
        tot_miss = sum(n - h for h, n in self.c.values() if True) or 1
        return {k: {"n": n, "acc": round(h / n, 4), "misses": n - h}
                for k, (h, n) in sorted(self.c.items())}


def analyse_positions(tf: TF, tok, seq: list[int], spans: list[tuple[int, int]], out: dict,
                      greedy_labels: bool) -> None:
    """Per reply position q (spans), TTT position j = q-2: step-s accuracy and categories."""
    r = tf(seq)
    cp = copyable(seq)
    for turn, (a, b) in enumerate(spans):
        for q in range(max(a, 2), b):
            j = q - 2
            label = r["top"][j]  # target greedy token for position q
            if greedy_labels:
                assert int(label) == seq[q] or True
            for s in range(tf.steps):
                if j - s >= 0:  # chain root exists (as the trainer counts)
                    out["step_acc"][s].add("all", bool(r["pred"][s][j] == label))
                    out["step_acc_dv"][s].add("all", bool(r["pred"][s][j] == r["top_dv"][j]))
            hit = bool(r["pred"][0][j] == label)
            t1 = out["cats"]
            t1.add("ALL", hit)
            t1.add("copyable" if cp[q] else "novel", hit)
            t1.add("turn1" if turn == 0 else "turn>1", hit)
            t1.add(conf_bucket(float(r["tconf"][j])), hit)
            if not bool(tf.in_vocab[label]):
                t1.add("target_tok_outside_draft_vocab", hit)
            for c in categories(tok, seq, q, a):
                t1.add(c, hit)
            out["label_eq_seq"].add("all", int(label) == seq[q])
            if not hit and len(out["miss_examples"]) < 60:
                out["miss_examples"].append(
                    (tok.decode(seq[max(a, q - 8):q]), tok.decode([seq[q]]),
                     tok.decode([int(r["pred"][0][j])]), round(float(r["tconf"][j]), 3)))
    return r


def new_out(steps: int) -> dict:
    return {"step_acc": [Tally() for _ in range(steps)],
            "step_acc_dv": [Tally() for _ in range(steps)],
            "cats": Tally(), "label_eq_seq": Tally(), "miss_examples": []}


def fmt(out: dict) -> dict:
    return {"tf_step_acc_vs_target_greedy": [o.c["all"][0] / max(1, o.c["all"][1])
                                             for o in out["step_acc"]],
            "tf_step_acc_trainer_metric_draft_vocab": [o.c["all"][0] / max(1, o.c["all"][1])
                                                       for o in out["step_acc_dv"]],
            "positions_step1": out["step_acc"][0].c["all"][1],
            "label_eq_seq_token": out["label_eq_seq"].c["all"][0] / max(1, out["label_eq_seq"].c["all"][1]),
            "step1_by_category": out["cats"].table(),
            "miss_examples": out["miss_examples"]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--set", choices=("mt_bench", "val", "val_tf"), default="mt_bench")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("-k", type=int, default=5)
    ap.add_argument("--head", default="smollm2-eagle3")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--val", default=".device/gen/val.jsonl.gz",
                    help="held-out sequences (gzipped jsonl) for --set val / val_tf")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    res: dict = {"set": a.set, "k": a.k, "head": a.head}
    val_rows = None
    if a.set != "mt_bench":
        val_rows = [json.loads(l) for l in gzip.open(a.val, "rt")]
        pick = torch.randperm(len(val_rows), generator=torch.Generator().manual_seed(0))
        val_rows = [val_rows[i] for i in sorted(pick[a.skip:a.skip + a.num_prompts].tolist())]
    llm = LLM(model=None, draft=a.head, num_speculative_tokens=a.k, device="cpu",
              dtype="float32", max_num_seqs=max(1, a.num_prompts), max_model_len=2048)
    tok = llm.tokenizer if hasattr(llm, "tokenizer") else llm.engine.tokenizer
    tf = TF(llm.engine.model, llm.engine.draft)
    out = new_out(tf.steps)
    seqs: list[TrainSequence] = []
    if a.set == "val_tf":
        for r in val_rows:
            s = TrainSequence(str(r["id"]), r["input_ids"], r["num_prompt"],
                              [tuple(x) for x in r["spans"]], r.get("kind", ""))
            seqs.append(s)
            analyse_positions(tf, tok, s.input_ids, s.loss_spans(), out, False)
            out.setdefault("kinds", Tally())
        res.update(fmt(out))
    else:
        if a.set == "mt_bench":
            texts = load_mt_bench(str(mt_bench_path()), a.skip + a.num_prompts)[a.skip:]
            prompts = mt_bench_prompts(llm, texts)
        else:  # the held-out sequences' first-turn prompts, answered greedily
            prompts = [r["input_ids"][:r["spans"][0][0]] for r in val_rows]
        log = hook_drafting_steps(llm)
        outs = llm.generate(prompts, SamplingParams(max_tokens=a.max_tokens, temperature=0.0))
        st = llm.stats.spec
        res["engine"] = {"tau": st.mean_acceptance_length,
                         "a_j": st.acceptance_rate_per_position,
                         "drafting_steps": st.num_drafting_steps,
                         "output_tokens": sum(len(o.token_ids) for o in outs),
                         "seconds": round(time.perf_counter() - t0, 1)}
        aj = [1.0] + st.acceptance_rate_per_position
        res["engine"]["conditional_acceptance"] = [aj[i + 1] / aj[i] if aj[i] else None
                                                   for i in range(len(aj) - 1)]
        print(json.dumps(res["engine"]), flush=True)
        replay = {"steps": 0, "n_equal": 0, "engine_acc": 0, "replay_acc": 0,
                  "d_agree": [[0, 0] for _ in range(a.k)],
                  "engine_accept_hist": [0] * (a.k + 1),
                  "first_draft_acc_engine": [0, 0]}
        sim = {"steps": 0, "acc": 0}
        first_step = Tally()  # drafting steps by where they start
        for rid, (p_ids, o) in enumerate(zip(prompts, outs)):
            seq = list(p_ids) + list(o.token_ids)
            n_p = len(p_ids)
            seqs.append(TrainSequence(f"{a.set}{rid}", seq, n_p, None, "prose"))
            r = analyse_positions(tf, tok, seq, [(n_p, len(seq))], out, True)
            pred = r["pred"]
            for p, n_acc, _, _, ds in log[rid]:
                k_d = len(ds)
                n_rep = 0
                for s in range(k_d):
                    if p + s >= len(seq):
                        break
                    if ds[:s] == seq[p:p + s]:  # inputs equal the teacher-forced ones
                        replay["d_agree"][s][0] += int(int(pred[s][p + s - 2]) == ds[s])
                        replay["d_agree"][s][1] += 1
                for s in range(k_d):
                    if p + s < len(seq) and int(pred[s][p + s - 2]) == seq[p + s]:
                        n_rep += 1
                    else:
                        break
                replay["steps"] += 1
                replay["n_equal"] += int(n_rep == n_acc)
                replay["engine_acc"] += n_acc
                replay["replay_acc"] += n_rep
                replay["engine_accept_hist"][n_acc] += 1
                replay["first_draft_acc_engine"][0] += int(n_acc >= 1)
                replay["first_draft_acc_engine"][1] += 1
                first_step.add("step starts at reply[0:4)" if p - n_p < 4 else
                               "step starts after a rejection/elsewhere", n_acc >= 1)
            # Independent replay of a whole greedy decode from the teacher-forced predictions.
            p = n_p + 1  # d_1 of the first proposal (after the prefill's token at n_p)
            while p < len(seq):
                k_d = min(a.k, len(seq) - p)
                n = 0
                while n < k_d and int(pred[n][p + n - 2]) == seq[p + n]:
                    n += 1
                sim["steps"] += 1
                sim["acc"] += n
                p += n + 1
        res["replay_engine_steps"] = {
            "steps": replay["steps"],
            "replayed_accept_count_equals_engine": replay["n_equal"] / max(1, replay["steps"]),
            "engine_tau": 1 + replay["engine_acc"] / max(1, replay["steps"]),
            "replayed_tau": 1 + replay["replay_acc"] / max(1, replay["steps"]),
            "d_s_equal_tf_when_prefix_right": [[round(h / max(1, n), 4), n]
                                                for h, n in replay["d_agree"]],
            "engine_accept_hist": replay["engine_accept_hist"],
            "engine_first_draft_acc_per_step": replay["first_draft_acc_engine"][0]
            / max(1, replay["first_draft_acc_engine"][1]),
            "by_step_start": first_step.table()}
        res["tf_simulated_decode_tau"] = 1 + sim["acc"] / max(1, sim["steps"])
        res.update(fmt(out))
        # i.i.d. chain tau from per-step accuracies: 1 + sum_s prod_{t<=s} acc_t
        accs = res["tf_step_acc_vs_target_greedy"]
        prod, tau_iid = 1.0, 1.0
        for x in accs[:a.k]:
            prod *= x
            tau_iid += prod
        res["tau_if_positions_independent_from_tf_step_acc"] = tau_iid
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    save_sequences(Path(a.out + ".seqs.jsonl"), seqs)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    Path(a.out + ".json").write_text(json.dumps(res, indent=1))
    short = {k: v for k, v in res.items() if k not in ("step1_by_category", "miss_examples")}
    print(json.dumps(short, indent=1))
    print("step-1 accuracy by category:")
    for k, v in res["step1_by_category"].items():
        print(f"  {k:34s} n={v['n']:6d} acc={v['acc']:.3f} misses={v['misses']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
