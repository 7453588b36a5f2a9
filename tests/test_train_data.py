"""Training data: the tolerant ShareGPT reader, multi-turn self-distillation (every assistant turn
written by the target, loss spans over exactly its tokens), length-grouped batches, held-out
figures per prompt kind, and a run stopped by its time limit that exports and resumes."""
import json
from pathlib import Path

import pytest
import torch

from compiled_spec.llm import LLM
from compiled_spec.sampling_params import SamplingParams
from compiled_spec.train.data import collate, length_batches, load_sequences
from compiled_spec.train.multiturn import generate_sequences
from compiled_spec.train.sharegpt import Conversation, load_sharegpt
from compiled_spec.train.trainer import TrainConfig, read_log, train


def _record(i: int, turns: list[tuple[str, str]]) -> dict:
    return {"id": f"c{i}", "conversations": [{"from": f, "value": v} for f, v in turns]}


def _write_sharegpt(path: Path, records: list[dict], cut: int = 0) -> Path:
    text = json.dumps(records, indent=2)
    path.write_text(text[:len(text) - cut] if cut else text)
    return path


def test_sharegpt_reader_keeps_complete_records_of_a_cut_off_file(tmp_path):
    recs = [_record(0, [("human", "hi"), ("gpt", "hello"), ("human", "more?"), ("gpt", "yes")]),
            _record(1, [("system", "be nice"), ("human", "a"), ("gpt", "b")]),
            _record(2, [("gpt", "I start"), ("human", "q1"), ("gpt", "a1"), ("gpt", "oops"),
                        ("human", "never read")]),
            _record(3, [("gpt", "only me")]),
            _record(4, [("human", "x" * 5000), ("gpt", "y" * 5000), ("human", "last")])]
    whole, stats = load_sharegpt(_write_sharegpt(tmp_path / "a.json", recs))
    assert not stats.truncated and stats.records == 5 and stats.skipped == 1
    assert [c.user_turns for c in whole] == [["hi", "more?"], ["a"], ["q1"],
                                             ["x" * 5000, "last"]]
    # Cut inside the last record, with chunks far smaller than a record: four are kept.
    import compiled_spec.train.sharegpt as sg
    path = _write_sharegpt(tmp_path / "b.json", recs, cut=2000)
    stats = sg.ReadStats()
    with path.open() as f:
        got = list(sg.iter_json_array(f, stats, chunk_chars=64))
    assert len(got) == 4 and stats.truncated and stats.tail_bytes > 0
    convs, stats = load_sharegpt(path, max_turns=1)
    assert stats.truncated and [c.user_turns for c in convs] == [["hi"], ["a"], ["q1"]]
    # A broken record in the middle is an error, not a silent stop.
    bad = tmp_path / "c.json"
    bad.write_text('[{"id": 1, "conversations": []} {"id": 2}]')
    with pytest.raises(ValueError, match="after record 1"):
        load_sharegpt(bad)


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory, smollm2_tokenizer):
    from tests.spec_models import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("chat_target"), smollm2_tokenizer,
                            max_positions=512)


def test_multiturn_spans_hold_exactly_the_targets_replies(chat_target, tmp_path, capsys):
    llm = LLM(model=chat_target, max_model_len=512, max_num_seqs=4)
    convs = [Conversation("a", ["Name a colour.", "And another one?", "Why?"]),
             Conversation("b", ["Hello"], source="codealpaca")]
    seqs = generate_sequences(llm, convs, max_new_tokens=12, max_seq_len=512,
                              temperatures=(0.0, 1.0), batch_size=4, ignore_eos=True,
                              partial=tmp_path / "p.jsonl")
    by_id = {s.id: s for s in seqs}
    assert sorted(by_id) == ["a", "a#t1", "b", "b#t1"]
    assert by_id["a"].kind == "chat" and by_id["b"].kind == "code"
    a = by_id["a"]
    assert len(a.spans) == 3 and all(e - s == 12 for s, e in a.spans)
    # Replaying the conversation turn by turn through the engine: each span is what the target
    # answers (greedy) to everything before it, and the text between spans is the template.
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for start, end in a.spans:
        reply = llm.generate([a.input_ids[:start]], greedy)[0].token_ids
        assert a.input_ids[start:end] == list(reply)
    messages = []
    for turn, (start, end) in zip(["Name a colour.", "And another one?", "Why?"], a.spans):
        messages.append({"role": "user", "content": turn})
        assert a.input_ids[:start] == llm.encode_chat(messages)
        messages.append({"role": "assistant",
                         "content": llm.tokenizer.decode(a.input_ids[start:end],
                                                         skip_special_tokens=True)})
    # A deadline passed after the first round: every conversation keeps its first reply.
    import time
    from compiled_spec.train.multiturn import chat_jobs, generate_chats
    jobs = chat_jobs(convs, (0.0,), seed=0)
    t0 = time.monotonic()
    orig = llm.generate

    def slow_generate(*args, **kw):  # the first round outlasts the deadline, sleeping >= 0.3 s
        out = orig(*args, **kw)
        time.sleep(max(0.3, t0 + 0.5 - time.monotonic()))
        return out
    llm.generate = slow_generate
    capsys.readouterr()
    cut = generate_chats(llm, jobs, 12, 512, 4, ignore_eos=True, deadline=t0 + 0.2)
    llm.generate = orig
    # The chunk's time split: 2 prompts admitted together (one step with a prefill), 11 more
    # decode steps, and the sleep above (>= 0.3 s however slow the host) counted outside the
    # engine's steps.
    line = next(x for x in capsys.readouterr().out.splitlines() if "steps with a prefill" in x)
    assert "steps with a prefill: 1," in line and "decode-only steps: 11," in line
    assert float(line.split("outside engine steps: ")[1].split(" s")[0]) >= 0.25
    assert len(cut) == 2 and all(len(s.spans) == 1 for s in cut)
    assert {s.id: s.input_ids for s in cut}["a"] == a.input_ids[:a.spans[0][1]]
    mask = collate([a], "cpu").loss_mask[0]
    assert mask.sum() == 36 and all(mask[s:e].all() for s, e in a.spans)
    # The partial file holds the finished chunk: a rerun generates nothing and reads it back.
    again = generate_sequences(None, convs, max_new_tokens=12, max_seq_len=512,  # type: ignore
                               temperatures=(0.0, 1.0), batch_size=4,
                               partial=tmp_path / "p.jsonl")
    assert [(s.id, s.input_ids, s.spans) for s in again] == \
        [(s.id, s.input_ids, s.spans) for s in seqs]


def test_batched_chat_prompts_equal_one_conversation_at_a_time(smollm2_tokenizer):
    from compiled_spec.tokenizer import chat_ids, chat_ids_batch

    convs = [[{"role": "user", "content": "Hi"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ""}],
             [{"role": "user", "content": "Why <|im_end|> that?\n\n  \u00e9 \U0001F600 " * 40},
              {"role": "assistant", "content": "hel" + "lo\n"},
              {"role": "user", "content": "```python\ndef f(x):\n    return x\n```"}]]
    assert chat_ids_batch(smollm2_tokenizer, convs) == [chat_ids(smollm2_tokenizer, c)
                                                       for c in convs]
    assert chat_ids_batch(smollm2_tokenizer, convs[:1]) == [chat_ids(smollm2_tokenizer, convs[0])]
    assert chat_ids_batch(smollm2_tokenizer, []) == []
    with pytest.raises(ValueError, match="message 0"):
        chat_ids_batch(smollm2_tokenizer, [convs[0], [{"role": "user"}]])


def test_common_prefix_matches_a_token_by_token_scan():
    import random
    from compiled_spec.train.multiturn import _common_prefix

    def scan(a, b):
        i = 0
        while i < min(len(a), len(b)) and a[i] == b[i]:
            i += 1
        return i
    rng = random.Random(0)
    for n in (0, 1, 63, 64, 65, 128, 300):
        a = [rng.randrange(5) for _ in range(n)]
        cases = [(a, list(a)), (a, a + [1, 2]), (a + [3], a), ([], a)]
        for at in {0, n // 2, max(n - 1, 0), 63, 64, 127} & set(range(n)):
            b = list(a)
            b[at] += 1
            cases += [(a, b), (b + [0] * 70, a)]
        for x, y in cases:
            assert _common_prefix(x, y) == scan(x, y), (n, x, y)


def test_round_prompts_are_each_conversations_chat_template(smollm2_tokenizer):
    """A round's prompts, tokenized in one batch, are ``chat_ids`` of each conversation so far,
    the last reply decoded into it; spans are clipped where re-tokenizing changed a reply."""
    from types import SimpleNamespace

    from compiled_spec.tokenizer import chat_ids
    from compiled_spec.train.multiturn import ChatJob, _next_prompts

    tok = smollm2_tokenizer
    llm = SimpleNamespace(tokenizer=tok)  # all the prompts need of the LLM
    turns = ["Name a colour.", "Why <|im_end|> that one?\n\n  \u00e9 \U0001F600"]
    fresh = ChatJob("fresh", list(turns), 0.0, 1, "chat")
    ids_only = ChatJob("ids", [""], 0.0, 2, "prose", first_ids=[5, 6, 7])
    assert _next_prompts(llm, [fresh, ids_only], 0) == [
        chat_ids(tok, [{"role": "user", "content": turns[0]}]), [5, 6, 7]]
    # Turn 0 answered by replies: one split where the tokenizer would not split ("hel" + "lo"),
    # so re-tokenizing changes it from there on; one ending in the EOS token that decoding drops.
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    jobs = []
    for i, reply in enumerate([enc("Blue, hel") + enc("lo there"),
                               enc("Blue.") + [tok.convert_tokens_to_ids("<|im_end|>")]]):
        job = ChatJob(f"j{i}", list(turns), 0.0, i, "chat")
        first = _next_prompts(llm, [job], 0)[0]
        job.ids, job.num_prompt = first + reply, len(first)
        job.spans = [(len(first), len(job.ids))]
        jobs.append((job, first, reply))
    prompts = _next_prompts(llm, [j for j, _, _ in jobs], 1)
    for (job, first, reply), prompt in zip(jobs, prompts):
        messages = [{"role": "user", "content": turns[0]},
                    {"role": "assistant", "content": tok.decode(reply, skip_special_tokens=True)},
                    {"role": "user", "content": turns[1]}]
        assert prompt == chat_ids(tok, messages) and job.messages == messages
        keep = next(i for i, (a, b) in enumerate(zip(prompt + [-1], job.ids + [-2])) if a != b)
        assert job.spans == [(len(first), min(len(first) + len(reply), keep))]
        assert keep > len(first)  # (a span starting at or past the change would be dropped)
    assert jobs[0][0].spans[0][1] < len(jobs[0][0].ids)  # the split reply was clipped
    assert jobs[1][0].spans[0][1] == len(jobs[1][0].ids)  # the EOS-ended one was not


# --- generation rounds: new jobs over the same prompts, round 0's data untouched -----------------
def _round_rows() -> list:
    from compiled_spec.train.data import PromptRow

    return [Conversation("c0", ["hi", "more?"]), PromptRow("p1", "Write a poem.", None, "alpaca"),
            PromptRow("p2", None, [5, 6, 7], "code"), Conversation("c3", ["q"])]


def test_chat_jobs_round_0_is_the_job_list_the_data_on_disk_came_from():
    """Pinned: ids, seeds and order as chat_jobs gave them before rounds existed (computed with
    that code); every sequence written so far is named and seeded by them."""
    from compiled_spec.train.data import PromptRow
    from compiled_spec.train.multiturn import chat_jobs

    rows = _round_rows()
    assert [(j.id, j.seed) for j in chat_jobs(rows, (0.0, 0.8), 0)] == [
        ("c3#t1", 7), ("c0", 0), ("c0#t1", 1), ("p2#t1", 5), ("c3", 6), ("p2", 4),
        ("p1#t1", 3), ("p1", 2)]
    jobs = chat_jobs(rows, (0.0, 0.8), 3, round_=0)
    assert [(j.id, j.seed) for j in jobs] == [
        ("p1#t1", 3000012), ("p2", 3000013), ("p2#t1", 3000014), ("c3", 3000015),
        ("c0#t1", 3000010), ("c3#t1", 3000016), ("p1", 3000011), ("c0", 3000009)]
    assert [(j.temperature, j.kind, j.user_turns, j.first_ids) for j in jobs[:2]] == [
        (0.8, "prose", ["Write a poem."], None), (0.0, "code", [""], [5, 6, 7])]
    many = chat_jobs([PromptRow(f"r{i}", f"prompt {i}", None, "") for i in range(500)],
                     (0.0, 0.8), 0)
    assert [(j.id, j.seed) for j in many[:6] + many[-2:]] == [
        ("r279#t1", 559), ("r48#t1", 97), ("r295#t1", 591), ("r173", 346), ("r15", 30),
        ("r259#t1", 519), ("r312#t1", 625), ("r410", 820)]


def test_later_rounds_have_their_own_ids_seeds_and_order():
    from compiled_spec.train.data import PromptRow
    from compiled_spec.train.multiturn import chat_jobs, source_row_id

    rows = [PromptRow(f"r{i}", f"prompt {i}", None, "") for i in range(300)] + _round_rows()
    rounds = [chat_jobs(rows, (0.0, 0.8), 5)] + [chat_jobs(rows, (0.5, 1.0), 5, round_=r)
                                                 for r in (1, 2)]
    r1 = rounds[1]
    assert {j.id for j in r1} == {f"{r.id}#r1" for r in rows} | {f"{r.id}#r1#t1" for r in rows}
    assert {j.id: j.temperature for j in r1}["p1#r1#t1"] == 1.0
    assert sorted(source_row_id(j.id) for j in r1) == sorted([r.id for r in rows] * 2)
    # Seeds (with the engine's per-turn offset, 3 turns) and ids: no two rounds share one.
    seeds = [{j.seed + 7919 * t for j in jobs for t in range(3)} for jobs in rounds]
    ids = [{j.id for j in jobs} for jobs in rounds]
    for a in range(3):
        assert len({j.seed for j in rounds[a]}) == len(rounds[a])
        for b in range(a + 1, 3):
            assert not seeds[a] & seeds[b] and not ids[a] & ids[b], (a, b)
    # A job order of its own (not round 0's with new names), the same on every call.
    order = [[source_row_id(j.id) + str(j.temperature > 0.6) for j in jobs] for jobs in rounds]
    assert order[0] != order[1] != order[2] != order[0]
    assert [(j.id, j.seed) for j in chat_jobs(rows, (0.5, 1.0), 5, 1)] == \
        [(j.id, j.seed) for j in r1]
    # A later round's greedy replies would repeat round 0's.
    with pytest.raises(ValueError, match=r"temperature 0.*\(0\.0, 1\.0\)"):
        chat_jobs(rows, (0.0, 1.0), 5, round_=1)
    with pytest.raises(ValueError, match="round_=-1"):
        chat_jobs(rows, (0.5,), 5, round_=-1)


def test_gen_round_reaches_the_config_and_refuses_temperature_0(tmp_path, monkeypatch):
    import compiled_spec.train.trainer as trainer
    from compiled_spec.cli import main

    seen: list[TrainConfig] = []
    monkeypatch.setattr(trainer, "train", lambda cfg: seen.append(cfg) or tmp_path)
    base = ["train", "--target", "t", "--prompts", "p.jsonl", "--out", str(tmp_path),
            "--data-only", "--temperatures", "0", "0.8"]
    # Arguments appended after the script's own: the last --temperatures wins.
    assert main(base + ["--gen-round", "2", "--temperatures", "0.5", "1.0"]) == 0
    assert seen[-1].gen_round == 2 and seen[-1].temperatures == (0.5, 1.0)
    assert main(base) == 0 and seen[-1].gen_round == 0
    assert main(base + ["--gen-round", "1"]) == 2 and len(seen) == 2  # temperature 0 refused
    kw = dict(target="t", prompts="p.jsonl", out=str(tmp_path))
    with pytest.raises(ValueError, match=r"temperatures=\(0\.0, 0\.8\) with gen_round=1"):
        TrainConfig(**kw, temperatures=(0.0, 0.8), gen_round=1)
    with pytest.raises(ValueError, match="gen_round=-1"):
        TrainConfig(**kw, temperatures=(0.5,), gen_round=-1)
    assert TrainConfig(**kw, temperatures=(0.5, 1.0), gen_round=1).gen_round == 1


def test_a_later_round_returns_the_earlier_rounds_data_with_its_own(tmp_path, smollm2_gguf_path):
    """The `data` phase of a later session: round 0's sequences in data.partial.jsonl are no
    jobs of round 1; they come back unchanged beside round 1's, never as round 1's, and the
    held-out sequences (sharing the partial file) stay out of the training data."""
    from dataclasses import replace

    from compiled_spec.train.corpus import load_corpus
    from compiled_spec.train.data import save_sequences
    from tests.spec_models import write_bigram_target, write_id_prompts

    out = tmp_path / "out"
    out.mkdir()
    cfg = TrainConfig(target=write_bigram_target(tmp_path / "t", vocab=32, layers=2),
                      prompts=write_id_prompts(tmp_path / "p.jsonl", 6, vocab=32),
                      out=str(out), tokenizer=smollm2_gguf_path, max_seq_len=64,
                      max_new_tokens=8, ignore_eos=True, draft_vocab_size=24, val_prompts=2,
                      temperatures=(0.0, 1.0))

    def rows(seqs):
        return sorted((s.id, s.input_ids) for s in seqs)

    _, round0, val0 = load_corpus(cfg, out)
    assert len(round0) == 8 and len(val0) == 2
    # As the script hands over earlier data: a partial file (here with the held-out sequences
    # too, as a cut-short run leaves it), no data.jsonl, no val.jsonl (regenerated).
    (out / "data.jsonl").unlink()
    (out / "val.jsonl").unlink()
    save_sequences(out / "data.partial.jsonl", val0 + round0)
    one = replace(cfg, gen_round=1, temperatures=(0.5, 1.0))
    _, seqs, val = load_corpus(one, out)
    got = {s.id: s.input_ids for s in seqs}
    assert rows(val) == rows(val0)
    assert len(seqs) == len(got) == 16 and not set(got) & {v.id for v in val0}
    assert rows(s for s in seqs if "#r1" not in s.id) == rows(round0)  # round 0 as it was
    r1 = [s for s in seqs if "#r1" in s.id]
    assert sorted(s.id for s in r1) == sorted(  # a#r1 for a, a#r1#t1 for a#t1
        s.id.replace("#t1", "#r1#t1") if s.id.endswith("#t1") else s.id + "#r1" for s in round0)
    assert any(got[s.id] != got[s.id.replace("#r1", "")] for s in r1)  # new replies
    # Held-out prompts regenerated in a later round: round 0's greedy sequences again.
    (out / "data.jsonl").unlink()
    (out / "val.jsonl").unlink()
    save_sequences(out / "data.partial.jsonl", round0)
    _, again, val = load_corpus(one, out)
    assert rows(val) == rows(val0) and rows(again) == rows(seqs)


def test_length_batches_cover_each_sequence_once_within_the_budget():
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(5, 400, (1000,), generator=g).tolist()
    plan = length_batches(lengths, 2048, seed=11)
    flat = sorted(i for b in plan for i in b)
    assert flat == list(range(1000))
    assert all(len(b) * max(lengths[i] for i in b) <= 2048 for b in plan)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in plan)
    assert padded < 1.15 * sum(lengths)  # random batches of this mix pad ~2x
    assert plan == length_batches(lengths, 2048, seed=11)
    assert plan != length_batches(lengths, 2048, seed=12)


def test_time_limited_run_exports_reports_kinds_and_resumes(tmp_path, smollm2_gguf_path):
    from tests.spec_models import write_bigram_target, write_id_prompts

    target = write_bigram_target(tmp_path / "target", vocab=32, layers=2)
    prompts = Path(write_id_prompts(tmp_path / "prompts.jsonl", 24, vocab=32))
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    for i, r in enumerate(rows):  # two kinds of prompt
        r["source"] = "codealpaca" if i % 2 else "alpaca"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = TrainConfig(target=target, prompts=str(prompts), out=str(tmp_path / "run"),
                      tokenizer=smollm2_gguf_path, draft_vocab_size=24, ttt_steps=2,
                      steps=100000, batch_size=4, batch_tokens=128, lr=5e-3, warmup_steps=2,
                      max_seq_len=64, max_new_tokens=24, ignore_eos=True, log_every=5,
                      eval_every=5, val_prompts=6, save_every=0, seed=0, time_limit_s=3.0,
                      export_dir=str(tmp_path / "export"), export_max_shard_mb=0.01)
    out = train(cfg)
    rows = read_log(out)
    stopped = rows[-1]["step"]
    assert 0 < stopped < 100000 and rows[-1]["tokens_per_s"] > 0
    kinds = [r["val_acc_by_kind"] for r in rows if "val_acc_by_kind" in r]
    assert kinds and set(kinds[-1]) == {"code", "prose"}
    assert {s.kind for s in load_sequences(out / "val.jsonl")} == {"code", "prose"}
    assert json.loads((out / "vocab.json").read_text())["coverage"] == 1.0
    shards = list((tmp_path / "export").glob("model-*.safetensors"))
    assert len(shards) > 1 and json.loads(
        (tmp_path / "export" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert torch.load(str(out / "trainer_state.pt"), weights_only=True)["step"] == stopped
    more = train(TrainConfig(**{**cfg.__dict__, "resume": True, "export_dir": None}))
    assert read_log(more)[-1]["step"] > stopped


def _dense_ttt_loss(draft, input_ids, aux, target_logits, loss_mask, num_steps, decay):
    """The loss over every [B, S] position, masked afterwards (the trainer's earlier form)."""
    import torch.nn.functional as F
    from compiled_spec.train.ttt import label_mask, ttt_forward

    b, s = input_ids.shape
    hidden = draft.combine_aux(list(aux.chunk(3, dim=-1)))
    outs = ttt_forward(draft, F.pad(input_ids[:, 1:], (0, 1)), hidden,
                       torch.arange(s).expand(b, s), num_steps)
    labels = F.pad(target_logits[:, 1:], (0, 0, 0, 1)).float()
    target_p = torch.softmax(labels, dim=-1)
    trainable = label_mask(loss_mask)
    total = 0.0
    for step, (_, for_logits) in enumerate(outs, 1):
        m = trainable & (torch.arange(s)[None, :] >= step - 1)
        ce = -(target_p * torch.log_softmax(draft.compute_logits(for_logits).float(), -1)).sum(-1)
        total = total + decay ** (step - 1) * torch.where(m, ce, 0.0).sum() / m.sum().clamp(min=1)
    return total


def test_ttt_loss_on_trainable_rows_equals_the_dense_loss(tmp_path):
    from compiled_spec.draft.loader import load_draft
    from compiled_spec.draft.testing import write_eagle3_head
    from compiled_spec.models.loader import load_model
    from compiled_spec.train.ttt import ttt_loss
    from tests.spec_models import write_bigram_target

    write_bigram_target(tmp_path / "t", vocab=48, hidden=32, layers=4, seed=3)
    target, tcfg = load_model(str(tmp_path / "t"), torch.float32, "cpu")
    path = write_eagle3_head(str(tmp_path / "head"), tcfg, draft_vocab_size=20,
                             aux_layer_ids=(0, 2, 4), seed=1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 48, (3, 13), generator=g)
    aux = torch.randn(3, 13, 3 * tcfg.hidden_size, generator=g)
    tl = torch.randn(3, 13, 20, generator=g)
    mask = torch.zeros(3, 13, dtype=torch.bool)
    mask[0, 4:13], mask[1, 2:7], mask[2, 9:11] = True, True, True  # prompts, padding, ends
    grads = []
    for fn in (lambda d: ttt_loss(d, ids, aux, tl, mask, 4, 0.8).loss,
               lambda d: _dense_ttt_loss(d, ids, aux, tl, mask, 4, 0.8)):
        draft = load_draft(path, target, torch.float32, "cpu")
        for p in draft.parameters():
            p.requires_grad_(True)
        loss = fn(draft)
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in draft.named_parameters()
                                      if p.grad is not None}))
    (la, ga), (lb, gb) = grads
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-6)
    assert ga.keys() == gb.keys() and ga
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], rtol=1e-4, atol=1e-6)


def test_length_grouped_steps_walk_epochs_of_different_sizes():
    from compiled_spec.train.data import Batches, TrainSequence

    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(3, 120, (300,), generator=g).tolist()
    seqs = [TrainSequence(str(i), [1] * n, 1) for i, n in enumerate(lengths)]
    plans = [length_batches(lengths, 256, e) for e in range(6)]
    assert len({len(p) for p in plans}) > 1  # epochs differ in their number of batches
    b = Batches(seqs, 8, 256, seed=0)
    step = 0
    for plan in plans:  # every epoch's batches in order, each sequence once per epoch
        for batch in plan:
            assert [s.id for s in b.at(step)] == [str(i) for i in batch]
            step += 1
    fresh = Batches(seqs, 8, 256, seed=0)  # a resumed run starts anywhere and sees the same batch
    assert [s.id for s in fresh.at(step - 1)] == [str(i) for i in plans[-1][-1]]


def test_generation_hands_its_kv_pool_back_before_training(tmp_path, smollm2_gguf_path,
                                                           monkeypatch):
    import gc
    import weakref

    import compiled_spec.engine.kv_pool as pool_mod
    from compiled_spec.train.corpus import load_corpus
    from tests.spec_models import write_bigram_target, write_id_prompts

    pools: list[weakref.ref] = []  # every KV tensor the generating engine allocates
    real = pool_mod.allocate_kv_pair

    def tracked(*args, **kw):
        pair = real(*args, **kw)
        pools.extend(weakref.ref(t) for t in pair)
        return pair
    monkeypatch.setattr(pool_mod, "allocate_kv_pair", tracked)
    target = write_bigram_target(tmp_path / "t", vocab=32, layers=2)
    prompts = write_id_prompts(tmp_path / "p.jsonl", 6, vocab=32)
    (tmp_path / "out").mkdir()
    cfg = TrainConfig(target=target, prompts=prompts, out=str(tmp_path / "out"),
                      tokenizer=smollm2_gguf_path, max_seq_len=64, max_new_tokens=8,
                      ignore_eos=True, draft_vocab_size=24)
    model, seqs, _ = load_corpus(cfg, tmp_path / "out")
    assert len(seqs) == 6 and pools
    assert all(l.self_attn.k_cache is None and l.self_attn.v_cache is None
               for l in model.model.layers)
    gc.collect()
    assert [r for r in pools if r() is not None] == []  # the pool is freed, not just unbound


def test_lr_by_time_reaches_zero_at_the_time_limit():
    from compiled_spec.train.trainer import TrainConfig, lr_at

    cfg = TrainConfig(target="t", prompts="p", out="o", lr=1.0, warmup_steps=2, steps=1000,
                      time_limit_s=60.0, lr_by_time=True)
    assert lr_at(cfg, 0, 1000, 0.9) == 0.5  # warm-up is by step
    assert lr_at(cfg, 10, 1000, 0.0) > 0.99  # early in both
    assert lr_at(cfg, 10, 1000, 0.5) == pytest.approx(0.5)  # half the time: cosine midpoint
    assert lr_at(cfg, 10, 1000, 1.0) == pytest.approx(0.0)
    assert lr_at(cfg, 1000, 1000, 0.1) == pytest.approx(0.0)  # the steps may end first
    with pytest.raises(ValueError, match="lr_by_time needs time_limit_s"):
        TrainConfig(target="t", prompts="p", out="o", lr_by_time=True)
