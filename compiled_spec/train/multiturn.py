"""Multi-turn self-distillation: the target writes every assistant turn of a conversation.

Round r sends each conversation's first r user turns, with the target's own earlier replies as
the assistant turns, through the chat template, and the engine answers all of them as one
continuously batched workload. The training sequence of a conversation is its last round's
prompt plus reply; the loss covers every assistant reply in it (``TrainSequence.spans``), which is
what EAGLE trains on: the target's text in the contexts a chat user gives it.

A reply re-enters the next round as text, re-tokenized by the template as a real chat client
would send it. Where re-tokenizing changes the reply's tokens, the earlier spans are clipped to
the prefix the two tokenizations share, so every trained position holds the target's own tokens.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
from tqdm.auto import tqdm

from compiled_spec.tokenizer import chat_ids_batch
from compiled_spec.train.data import PromptRow, TrainSequence, _row, load_sequences, prompt_kind
from compiled_spec.train.sharegpt import Conversation

if TYPE_CHECKING:
    from compiled_spec.llm import LLM

# Generation round r > 0 shifts every job seed of round 0 (``seed * 1_000_003 + index``, plus
# ``7919 * turn`` per turn) by r * 2**40: a round's seeds stay far below that, so no two rounds
# share a seed (and their high words differ, which the sampler's keys mix in); r * 2**40 stays
# inside int64 seeds. The job order's seed (``seed + 17``) moves by r * 1_000_003 instead: torch's
# CPU generator keeps only the low 32 bits of its seed, so a 2**40 shift would give round 0's order.
ROUND_SEED_STRIDE = 1 << 40
ROUND_ORDER_STRIDE = 1_000_003
_ROUND_SUFFIX = re.compile(r"(#r\d+)?(#t\d+)?$")


@dataclass
class ChatJob:
    """One conversation answered at one temperature."""

    id: str
    user_turns: list[str]
    temperature: float
    seed: int
    kind: str
    first_ids: list[int] | None = None  # verbatim first prompt (``prompt_ids`` rows, one turn)
    # The last prompt's messages: its assistant turns are the earlier replies' text; the last
    # reply is added (decoded) when the next turn's prompt is built.
    messages: list[dict] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # the conversation so far, token ids
    spans: list[tuple[int, int]] = field(default_factory=list)
    num_prompt: int = 0  # prompt length of the last answered round
    done: bool = False

    def sequence(self) -> TrainSequence | None:
        if not self.spans:
            return None
        spans = None if self.first_ids is not None else list(self.spans)
        return TrainSequence(self.id, list(self.ids), self.num_prompt, spans, self.kind)


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix, compared by slices (C loops, not a Python loop per
    token): whole lists first (re-tokenizing a conversation mostly gives its ids back), then
    blocks of 64, then the tokens of the first block that differs."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0  # a mismatch lies before n, so neither loop runs past it
    while a[i:i + 64] == b[i:i + 64]:
        i += 64
    while a[i] == b[i]:
        i += 1
    return i


def _next_prompts(llm: "LLM", jobs: list[ChatJob], turn: int) -> list[list[int]]:
    """Token ids of every job's prompt for ``turn`` (0-based); each job's earlier spans are
    clipped to the prefix its prompt shares with the conversation's tokens so far.

    The chat templates are tokenized in one batch (the Rust tokenizer's threads; one call per
    conversation was most of the host time outside the engine). The last reply is decoded here,
    only for conversations that go on: the engine returns token ids alone."""
    chats = [j for j in jobs if j.first_ids is None]
    for job in chats:
        if job.ids:  # the answer to the last user turn, as text, as a chat client sends it
            job.messages.append({"role": "assistant", "content": llm.tokenizer.decode(
                job.ids[job.num_prompt:], skip_special_tokens=True)})
        job.messages.append({"role": "user", "content": job.user_turns[turn]})
    encoded = iter(chat_ids_batch(llm.tokenizer, [j.messages for j in chats]))
    prompts = []
    for job in jobs:
        if job.first_ids is not None:
            prompts.append(list(job.first_ids))
            continue
        prompt = next(encoded)
        if job.ids:
            keep = _common_prefix(prompt, job.ids)
            job.spans = [(a, min(b, keep)) for a, b in job.spans if a < keep]
        prompts.append(prompt)
    return prompts


def _run_round(llm: "LLM", jobs: list[ChatJob], turn: int, max_new_tokens: int,
               max_seq_len: int, ignore_eos: bool) -> None:
    """Answer user turn ``turn`` of every job in ``jobs`` (one engine workload)."""
    from compiled_spec.sampling_params import SamplingParams

    live, prompts, params = [], [], []
    for job, prompt in zip(jobs, _next_prompts(llm, jobs, turn)):
        room = min(max_new_tokens, max_seq_len - len(prompt))
        if room < 2:  # no room left for a reply worth training on
            job.done = True
            continue
        live.append(job)
        prompts.append(prompt)
        # detokenize=False: the outputs' text is never read (the next round decodes the replies
        # it needs itself, skipping each conversation's last).
        params.append(SamplingParams(max_tokens=room, temperature=job.temperature,
                                     seed=job.seed + 7919 * turn, ignore_eos=ignore_eos,
                                     detokenize=False))
    if not live:
        return
    for job, prompt, res in zip(live, prompts, llm.generate(prompts, params)):
        reply = list(res.outputs[0].token_ids)
        if not reply:
            job.done = True
            continue
        job.spans.append((len(prompt), len(prompt) + len(reply)))
        job.ids, job.num_prompt = prompt + reply, len(prompt)


def _graph_calls(llm: "LLM") -> tuple[int, int, int]:
    """(CUDA-graph replays, steps with a prefill (never captured), other calls that ran without
    a graph) of the engine so far; zeros when it runs eagerly (no graphs to count)."""
    g = llm.compile_stats.get("cuda_graphs", {})
    eager = sum(n for reasons in g.get("without_graph", {}).values() for n in reasons.values())
    prefill = g.get("components", {}).get("target_decode", {}).get("prefill_calls", 0)
    return g.get("replayed", 0), prefill, eager


def _step_split(secs: float, steps: int, step_s: float, pre_steps: int, pre_s: float) -> str:
    """Where a chunk's time went: steps with a prompt chunk, decode-only steps, and outside the
    engine's steps (chat templates, tokenizing, request checks, outputs)."""
    dec_steps, dec_s = steps - pre_steps, step_s - pre_s
    return (f"\n  steps with a prefill: {pre_steps}, {1e3 * pre_s / max(pre_steps, 1):.1f} ms each "
            f"({pre_s:.1f} s); decode-only steps: {dec_steps}, "
            f"{1e3 * dec_s / max(dec_steps, 1):.1f} ms each ({dec_s:.1f} s); "
            f"outside engine steps: {secs - step_s:.1f} s")


def generate_chats(llm: "LLM", jobs: list[ChatJob], max_new_tokens: int, max_seq_len: int,
                   batch_size: int, ignore_eos: bool = False, partial: Path | None = None,
                   deadline: float | None = None,
                   keep_other: Callable[[str], bool] | None = None) -> list[TrainSequence]:
    """Answer every job's user turns in order; one TrainSequence per job with a reply.

    Jobs go in chunks of several engine batches through all their rounds (later rounds shrink as
    short conversations end, so chunks are kept large). With ``partial``, each finished chunk is
    appended there and jobs already in it are skipped, so a cut-short run resumes. Sequences of
    ``partial`` that are no job here but pass ``keep_other`` (e.g. an earlier generation round's)
    come back unchanged after the jobs' sequences: they are data, not work. Past
    ``deadline`` (``time.monotonic()``) no new round starts: the chunk in flight ends with the
    turns it has answered (a conversation cut after any turn is a valid training sequence) and
    no new chunk starts, so a run overshoots its limit by one round at most.
    """
    done: dict[str, TrainSequence] = {}
    if partial is not None and partial.is_file():
        done = {s.id: s for s in load_sequences(partial, strict=False)}
    job_ids = {j.id for j in jobs}
    kept = [s for i, s in done.items() if i not in job_ids and keep_other and keep_other(i)]
    out = [done[j.id] for j in jobs if j.id in done]
    todo = [j for j in jobs if j.id not in done]
    bar = tqdm(total=len(jobs), initial=len(jobs) - len(todo), desc="self-distill", unit="seq")
    chunk_size = 8 * batch_size
    def late() -> bool:
        return deadline is not None and time.monotonic() > deadline

    for start in range(0, len(todo), chunk_size):
        if late():
            print(f"generation time limit: {len(out)} of {len(jobs)} sequences written")
            break
        chunk = todo[start:start + chunk_size]
        st, t_chunk = llm.stats, time.perf_counter()
        steps0, tok0 = st.num_steps, st.num_prefill_tokens + st.num_decode_tokens
        step_s0, pre0, pre_s0 = st.step_s, st.num_prefill_steps, st.prefill_step_s
        graphs0 = _graph_calls(llm)
        for turn in range(max(len(j.user_turns) for j in chunk)):
            if turn > 0 and late():
                break
            _run_round(llm, [j for j in chunk if turn < len(j.user_turns) and not j.done],
                       turn, max_new_tokens, max_seq_len, ignore_eos)
        new = [s for s in (j.sequence() for j in chunk) if s is not None]
        if partial is not None:
            with partial.open("a") as f:
                f.write("".join(_row(s) for s in new))
        out.extend(new)
        bar.update(len(chunk))
        # Engine steps and their mean cost: where generation time goes at large batch.
        secs, steps = time.perf_counter() - t_chunk, st.num_steps - steps0
        toks = st.num_prefill_tokens + st.num_decode_tokens - tok0
        replays, prefill, eager = (b - a for a, b in zip(graphs0, _graph_calls(llm)))
        tqdm.write(f"chunk of {len(chunk)} jobs: {secs:.1f} s, {steps} engine steps "
                   f"({1e3 * secs / max(steps, 1):.1f} ms each), {toks} tokens "
                   f"({toks / max(secs, 1e-9):,.0f} tokens/s)"  # clears the bar's line first
                   + (f"; graph replays {replays}, prefill steps {prefill} (no graph), "
                      f"other calls without a graph {eager}" if replays or eager else "")
                   + _step_split(secs, steps, st.step_s - step_s0, st.num_prefill_steps - pre0,
                                 st.prefill_step_s - pre_s0))
    bar.close()
    if kept:
        print(f"{len(kept)} sequences of {partial} are no job of this run (e.g. another "
              f"round's): kept as they are")
    if not out and not kept:
        raise ValueError("the target produced no usable training sequences")
    return out + kept


def source_row_id(seq_id: str) -> str:
    """The prompt or conversation id a job's id was made from (``id``, ``id#t1``, ``id#r2#t1``
    all give ``id``)."""
    return _ROUND_SUFFIX.sub("", seq_id, count=1)


def chat_jobs(rows: list[PromptRow | Conversation], temperatures: tuple[float, ...],
              seed: int, round_: int = 0) -> list[ChatJob]:
    """One job per (prompt or conversation, temperature); the first temperature keeps the row's
    id, later ones are ``id#t<i>``. Seeds depend only on the job's index, so a rerun draws the
    same replies. Jobs come back in a seeded random order: a run cut short by its time limit
    holds a sample of every source, not the first file's prompts.

    ``round_`` r > 0 answers the same rows again as new jobs: ids ``id#r<r>`` (``id#r<r>#t<i>``),
    seeds and order seed shifted by r strides (``ROUND_SEED_STRIDE``, ``ROUND_ORDER_STRIDE``), so
    its replies extend the data of the earlier rounds. Round 0 is the original job list (data on
    disk depend on its ids, seeds and order). A later round's greedy reply would repeat round
    0's, so it refuses temperature 0."""
    if isinstance(round_, bool) or not isinstance(round_, int) or round_ < 0:
        raise ValueError(f"chat_jobs: round_={round_!r} must be an integer >= 0")
    if round_ > 0 and 0.0 in temperatures:
        raise ValueError(f"chat_jobs: round {round_} with temperature 0 would repeat round 0's "
                         f"greedy replies (temperatures {tuple(temperatures)})")
    offset = round_ * ROUND_SEED_STRIDE
    order_seed = seed + 17 + round_ * ROUND_ORDER_STRIDE
    jobs: list[ChatJob] = []
    for row in rows:
        if isinstance(row, Conversation):
            turns, first, kind = row.user_turns, None, prompt_kind(row.source)
        else:
            turns = [row.text] if row.text is not None else [""]
            first, kind = row.ids, prompt_kind(row.source)
        base = row.id if round_ == 0 else f"{row.id}#r{round_}"
        for ti, temp in enumerate(temperatures):
            sid = base if ti == 0 else f"{base}#t{ti}"
            jobs.append(ChatJob(sid, list(turns), temp, seed * 1_000_003 + offset + len(jobs),
                                kind, first))
    order = torch.randperm(len(jobs), generator=torch.Generator().manual_seed(order_seed))
    return [jobs[i] for i in order.tolist()]


def generate_sequences(llm: "LLM", rows: list[PromptRow | Conversation], max_new_tokens: int,
                       max_seq_len: int, temperatures: tuple[float, ...] = (0.0,),
                       batch_size: int = 32, seed: int = 0, ignore_eos: bool = False,
                       partial: Path | None = None, deadline: float | None = None,
                       shard: tuple[int, int] | None = None, skip: int = 0,
                       round_: int = 0) -> list[TrainSequence]:
    """Let the target answer every prompt (every turn of every conversation) once per
    temperature with our engine; see ``generate_chats``. Prompts that leave no room for two
    reply tokens within ``max_seq_len`` give no sequence. ``shard=(i, n)``: only jobs i, i+n,
    ... of the seeded job order (seeds are per job, so the shards together give one run's
    sequences). ``skip``: leave out the first jobs of that order (before sharding).
    ``round_``: the generation round (see ``chat_jobs``). Sequences in ``partial`` made from
    these rows that are no job here (another round's, or skipped or other shards' jobs) are
    returned with the new ones; those of other rows (the held-out prompts share the file) not."""
    jobs = chat_jobs(rows, temperatures, seed, round_)[skip:]
    if shard is not None:
        jobs = jobs[shard[0]::shard[1]]
    row_ids = {r.id for r in rows}
    return generate_chats(llm, jobs, max_new_tokens, max_seq_len, batch_size, ignore_eos,
                          partial, deadline,
                          keep_other=lambda sid: source_row_id(sid) in row_ids)
