"""EAGLE-3 trainer: draft-vocab selection, the TTT attention mask against paged inference, end to end
training on a bigram target (loss falls, the head loads and speculates losslessly with tau >= 2),
and resuming."""
from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open

from compiled_spec import LLM, SamplingParams
from compiled_spec.draft import load_draft
from compiled_spec.draft.testing import write_eagle3_head
from compiled_spec.engine.batch import Span, build_metadata
from compiled_spec.kv_cache import BlockAllocator, allocate_kv_pair
from compiled_spec.models import load_model
from compiled_spec.train.checkpoint import export_head
from compiled_spec.train.data import load_prompts, load_sequences
from compiled_spec.train.heldout import split_prompts
from compiled_spec.train.multiturn import chat_jobs
from compiled_spec.train.trainer import TrainConfig, read_log, train
from compiled_spec.train.ttt import label_mask, ttt_attention_mask, ttt_forward
from compiled_spec.train.vocab import draft_ids_from_d2t, select_draft_vocab, vocab_maps
from tests.spec_models import write_bigram_target, write_id_prompts


# --- (a) draft vocabulary --------------------------------------------------------------------------
def test_vocab_selection_ties_fill_and_round_trip():
    resp = Counter({7: 5, 3: 5, 9: 2, 1: 2, 4: 1})
    # top 4: counts 5,5 (ids 3,7) then the 2s (1 before 9); sorted by id
    assert select_draft_vocab(resp, 4, 16).tolist() == [1, 3, 7, 9]
    # more slots than response tokens: prompt tokens by frequency (ties -> lower id), then low ids
    prompt = Counter({12: 3, 2: 1, 11: 1, 7: 9})
    ids = select_draft_vocab(resp, 9, 16, prompt)
    assert ids.tolist() == sorted([7, 3, 9, 1, 4, 12, 2, 11, 0])
    assert select_draft_vocab({}, 3, 16).tolist() == [0, 1, 2]
    d2t, t2d = vocab_maps(ids, 16)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.shape == (16,)
    assert (torch.arange(9) + d2t).tolist() == ids.tolist()
    assert draft_ids_from_d2t(d2t).tolist() == ids.tolist()
    assert t2d.nonzero().flatten().tolist() == ids.tolist()
    with pytest.raises(ValueError):
        select_draft_vocab(resp, 17, 16)
    with pytest.raises(ValueError):
        vocab_maps(torch.tensor([3, 2]), 16)


# --- (b) the TTT mask equals paged inference -------------------------------------------------------
def test_ttt_mask_layout():
    m = ttt_attention_mask(5, 3)  # [5, 15]
    j = 4  # chain root 2: step-1 keys 0..2, step-2 key 3, step-3 key 4
    assert m[j, :5].tolist() == [True, True, True, False, False]
    assert m[j, 5:10].nonzero().flatten().tolist() == [3]
    assert m[j, 10:].nonzero().flatten().tolist() == [4]
    assert torch.equal(ttt_attention_mask(5, 1), torch.ones(5, 5, dtype=torch.bool).tril())
    lm = label_mask(torch.tensor([[False, False, True, True, True, False]]))
    assert lm.tolist() == [[True, True, True, False, False, False]]


@pytest.fixture(scope="module")
def small_target(tmp_path_factory):
    d = tmp_path_factory.mktemp("tgt")
    write_bigram_target(d, vocab=48, hidden=32, layers=4, seed=3)
    return load_model(str(d), torch.float32, "cpu")


@pytest.mark.parametrize("num_layers", [1, 2])
def test_ttt_equals_paged_inference(small_target, tmp_path, num_layers):
    target, tcfg = small_target
    path = write_eagle3_head(str(tmp_path / "head"), tcfg, num_layers=num_layers,
                             draft_vocab_size=20, aux_layer_ids=(0, 2, 4), seed=num_layers)
    draft = load_draft(path, target, torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    S, K = 11, 3
    inp = torch.randint(0, 48, (2, S), generator=g)  # draft input at j: t_{j+1}
    aux = torch.randn(2, S, 3 * tcfg.hidden_size, generator=g)
    hidden = draft.combine_aux(list(aux.chunk(3, dim=-1)))  # [2, S, h]
    pos = torch.arange(S).expand(2, S)
    with torch.no_grad():
        outs = ttt_forward(draft, inp, hidden, pos, K)
        dense = draft.forward_dense(inp, hidden, pos)
    torch.testing.assert_close(outs[0][0], dense[0], atol=1e-5, rtol=0)  # step 1 == dense
    torch.testing.assert_close(outs[0][1], dense[1], atol=1e-5, rtol=0)

    # Paged inference, exactly as EagleProposer chains it: a first pass over the accepted positions
    # 0..i, then steps 2..K one token at a time feeding back the draft's own hidden state.
    page = 4
    caches = [allocate_kv_pair(8, page, draft.config.num_key_value_heads,
                               draft.config.head_dim, torch.float32, torch.device("cpu"))
              for _ in range(num_layers)]
    draft.bind_kv_cache(caches)
    checked = 0
    for b in range(2):
        for root in range(S - K + 1):
            alloc = BlockAllocator(8, page)
            alloc.grow(0, S)
            p, meta = build_metadata(alloc, [Span(0, 0, root + 1)], torch.device("cpu"))
            metas = {n: meta for n in draft.layer_names}
            with torch.no_grad():
                feed, fl = draft(inp[b, :root + 1], hidden[b, :root + 1], p, metas)
            feed = feed[-1:]
            for step in range(2, K + 1):
                j = root + step - 1
                p, meta = build_metadata(alloc, [Span(0, j, 1)], torch.device("cpu"))
                with torch.no_grad():
                    feed, fl = draft(inp[b, j:j + 1], feed, p,
                                     {n: meta for n in draft.layer_names})
                torch.testing.assert_close(outs[step - 1][0][b, j], feed[0], atol=1e-5, rtol=0)
                torch.testing.assert_close(outs[step - 1][1][b, j], fl[0], atol=1e-5, rtol=0)
                checked += 1
    assert checked == 2 * (S - K + 1) * (K - 1)


# --- (c) end to end on a bigram target ---------------------------------------------------------------
@pytest.fixture(scope="module")
def bigram_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target = write_bigram_target(root / "target", vocab=32, layers=2)
    prompts = write_id_prompts(root / "prompts.jsonl", 32, vocab=32)
    return root, target, prompts


def _cfg(root, target, prompts, tok, out, **kw) -> TrainConfig:
    base = dict(target=target, prompts=prompts, out=str(root / out), tokenizer=tok,
                draft_vocab_size=24, ttt_steps=3, steps=150, batch_size=8, lr=5e-3,
                warmup_steps=10, max_seq_len=64, max_new_tokens=40,
                ignore_eos=True, log_every=1, save_every=0, seed=0)
    base.update(kw)
    return TrainConfig(**base)


def test_train_end_to_end(bigram_setup, smollm2_gguf_path):
    root, target, prompts = bigram_setup
    out = train(_cfg(root, target, prompts, smollm2_gguf_path, "e2e", val_prompts=4,
                     eval_every=50))
    rows = read_log(out)
    assert [r["step"] for r in rows] == list(range(1, 151))
    # Held-out loss measured every 50 steps on the 4 held-out prompts, falling; best/ holds the
    # head of the lowest one and loads.
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    assert [s for s, _ in val] == [50, 100, 150]
    assert val[-1][1] < val[0][1]
    best = json.loads((out / "best" / "best.json").read_text())
    assert best["val_loss"] == min(v for _, v in val)
    held = {s.id for s in load_sequences(out / "val.jsonl")}
    assert len(held) == 4 and not held & {s.id for s in load_sequences(out / "data.jsonl")}
    first = sum(r["loss"] for r in rows[:10]) / 10
    last = sum(r["loss"] for r in rows[-10:]) / 10
    print(f"\nloss first-10 mean {first:.3f}, last-10 mean {last:.3f}, "
          f"final per-step accuracy {rows[-1]['acc']}")
    assert last < 0.8 * first

    # Published EAGLE-3 layout.
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["draft_vocab_size"] == 24 and cfg["target_hidden_size"] == 32
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("t2d").sum() == 24
    assert {"fc.weight", "norm.weight", "d2t", "t2d",
            "midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight"} <= keys
    # The readout was frozen at the target's rows (the default): not stored, rebuilt at load.
    assert "lm_head.weight" not in keys and cfg["lm_head_from_target"] is True
    assert not any(k.startswith("layers.") or "embed" in k for k in keys)

    net, _ = load_model(target, torch.float32, "cpu")
    draft = load_draft(str(out), net, torch.float32, "cpu")
    assert draft.config.method == "eagle3" and draft.config.draft_vocab_size == 24
    ids = draft_ids_from_d2t(draft.d2t)
    assert torch.equal(draft.lm_head.weight, net.lm_head.weight[ids])
    load_draft(str(out / "best"), net, torch.float32, "cpu")

    rng = random.Random(123)  # held-out prompts
    eval_prompts = [[rng.randrange(31) for _ in range(rng.randint(1, 8))] for _ in range(8)]
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    vanilla = LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=128)
    ref = [o.token_ids for o in vanilla.generate(eval_prompts, sp)]
    llm = LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=128, draft=str(out),
              method="eagle3", num_speculative_tokens=3)
    got = [o.token_ids for o in llm.generate(eval_prompts, sp)]
    assert got == ref
    tau = llm.stats.spec.mean_acceptance_length
    print(f"tau (k=3, greedy, held-out prompts) = {tau:.3f}")
    assert tau >= 2.0


# --- (d) resume ---------------------------------------------------------------------------------------
def test_resume_continues_the_step_count(bigram_setup, smollm2_gguf_path):
    root, target, prompts = bigram_setup
    # A constant lr after warm-up: a cosine schedule depends on the total, which the resume changes.
    kw = dict(steps=6, num_prompts=8, max_new_tokens=16, warmup_steps=2, save_every=3,
              schedule="constant")
    a = _cfg(root, target, prompts, smollm2_gguf_path, "resume", **kw)
    train(a)
    with pytest.raises(ValueError, match="resume"):
        train(a)  # would silently overwrite the run
    out = train(replace(a, steps=12, resume=True))
    assert [r["step"] for r in read_log(out)] == list(range(1, 13))
    assert torch.load(str(out / "trainer_state.pt"), weights_only=True)["step"] == 12
    # Same data order and restored optimizer: identical to an uninterrupted 12-step run.
    straight = train(_cfg(root, target, prompts, smollm2_gguf_path, "straight",
                          **dict(kw, steps=12)))
    with safe_open(str(out / "model.safetensors"), "pt") as f1, \
            safe_open(str(straight / "model.safetensors"), "pt") as f2:
        for k in f1.keys():
            torch.testing.assert_close(f1.get_tensor(k), f2.get_tensor(k), atol=1e-6, rtol=0)


# --- (e) data: several temperatures, data-only runs, resuming a cut-short generation -------------
def test_data_only_and_partial_generation_resume(bigram_setup, smollm2_gguf_path):
    root, target, prompts = bigram_setup
    cfg = _cfg(root, target, prompts, smollm2_gguf_path, "data", num_prompts=6,
               temperatures=(0.0, 1.0), val_prompts=2, max_new_tokens=12, data_only=True)
    out = train(cfg)
    assert not (out / "model.safetensors").exists()  # stopped after the data
    seqs, val = load_sequences(out / "data.jsonl"), load_sequences(out / "val.jsonl")
    assert len(seqs) == 8 and len(val) == 2  # 4 prompts x 2 temperatures; greedy held out
    assert sum(s.id.endswith("#t1") for s in seqs) == 4
    # Cut short after three rows (and a torn fourth line): the rerun keeps those three and
    # generates the rest, with the same per-sequence seeds, so the data are identical.
    (out / "data.jsonl").unlink()
    (out / "val.jsonl").unlink()
    rows = [json.dumps({"id": s.id, "input_ids": s.input_ids, "num_prompt": s.num_prompt})
            for s in val + seqs[:1]]
    (out / "data.partial.jsonl").write_text("\n".join(rows) + '\n{"id": "x", "inp')
    train(cfg)
    assert not (out / "data.partial.jsonl").exists()
    again = load_sequences(out / "data.jsonl")
    assert sorted((s.id, s.input_ids) for s in again) == sorted((s.id, s.input_ids) for s in seqs)
    # A held-out file already there is reused (figures stay comparable across sessions).
    from compiled_spec.train.data import save_sequences

    (out / "data.jsonl").unlink()
    save_sequences(out / "val.jsonl", [replace(v, id=v.id + "-kept") for v in val])
    train(cfg)
    assert [s.id for s in load_sequences(out / "val.jsonl")] == [v.id + "-kept" for v in val]
    with pytest.raises(ValueError, match="temperatures"):
        replace(cfg, temperatures=(-1.0,))


def test_sharded_generation_equals_one_run(bigram_setup, smollm2_gguf_path):
    """Self-distillation split over processes (``gen_shard``): the shards' sequences together
    are one run's (per-job seeds), and only shard 0 answers the held-out prompts."""
    root, target, prompts = bigram_setup
    kw = dict(num_prompts=7, temperatures=(0.0, 1.0), val_prompts=2, max_new_tokens=10,
              data_only=True, gen_kv_gib=0.01)
    whole = train(_cfg(root, target, prompts, smollm2_gguf_path, "whole", **kw))
    parts = [train(_cfg(root, target, prompts, smollm2_gguf_path, f"shard{i}",
                        gen_shard=(i, 2), **kw)) for i in range(2)]

    def rows(d, name):
        return sorted((s.id, s.input_ids) for s in load_sequences(d / name))

    assert rows(parts[0], "data.jsonl") and rows(parts[1], "data.jsonl")
    assert sorted(rows(parts[0], "data.jsonl") + rows(parts[1], "data.jsonl")) == \
        rows(whole, "data.jsonl")
    assert rows(parts[0], "val.jsonl") == rows(whole, "val.jsonl") != []
    assert rows(parts[1], "val.jsonl") == []
    # gen_skip leaves out the head of the seeded job order: the rest of the same run's data.
    train_rows = split_prompts(load_prompts(prompts, 7), 2, 0)[0]
    order = [j.id for j in chat_jobs(train_rows, (0.0, 1.0), 0)]
    skipped = train(_cfg(root, target, prompts, smollm2_gguf_path, "skip", gen_skip=5, **kw))
    assert {i for i, _ in rows(skipped, "data.jsonl")} == \
        {i for i, _ in rows(whole, "data.jsonl")} - set(order[:5]) != set()
    with pytest.raises(ValueError, match="gen_shard"):
        _cfg(root, target, prompts, smollm2_gguf_path, "bad", gen_shard=(2, 2), **kw)


# --- (f) export: bf16, sharded ---------------------------------------------------------------------
def test_export_head_bf16_sharded_loads_identically(small_target, tmp_path):
    target, tcfg = small_target
    src = write_eagle3_head(str(tmp_path / "head"), tcfg, draft_vocab_size=20,
                            aux_layer_ids=(0, 2, 4))
    files = export_head(src, tmp_path / "bf16", "bfloat16", max_shard_mb=0.01)
    shards = [f for f in files if f.name.endswith(".safetensors")]
    assert len(shards) > 1 and all(f.stat().st_size < 0.01 * 2**20 + 4096 for f in shards)
    assert (tmp_path / "bf16" / "model.safetensors.index.json").is_file()
    a = load_draft(src, target, torch.bfloat16, "cpu")
    b = load_draft(str(tmp_path / "bf16"), target, torch.bfloat16, "cpu")
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    with pytest.raises(ValueError, match="max_shard_mb"):
        export_head(src, tmp_path / "x", "bfloat16", max_shard_mb=0.0001)


# --- (g) warm start from a trained head ----------------------------------------------------------
def test_init_from_a_trained_head(bigram_setup, smollm2_gguf_path, tmp_path):
    root, target, prompts = bigram_setup
    kw = dict(num_prompts=12, max_new_tokens=24, warmup_steps=2, schedule="constant",
              log_every=1)
    first = train(_cfg(root, target, prompts, smollm2_gguf_path, "warm_a", steps=60, **kw))
    exported = export_head(first, tmp_path / "bf16", "bfloat16", max_shard_mb=0.01)  # shards
    assert len([f for f in exported if f.suffix == ".safetensors"]) > 1
    warm = train(_cfg(root, target, prompts, smollm2_gguf_path, "warm_b", steps=3,
                      init_from=str(tmp_path / "bf16"), **kw))
    a, b = read_log(first), read_log(warm)
    # It starts where the first run ended (bf16 rounding aside), far below a fresh start.
    assert b[0]["loss"] < 0.6 * a[0]["loss"], (a[0]["loss"], b[0]["loss"])
    with safe_open(str(warm / "model.safetensors"), "pt") as f1, \
            safe_open(str(first / "model.safetensors"), "pt") as f2:
        assert torch.equal(f1.get_tensor("d2t"), f2.get_tensor("d2t"))  # its vocabulary kept
