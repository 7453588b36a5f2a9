"""Host time of multi-turn self-distillation outside the engine's steps, per request, on the CPU.

On the H200 (results/2026-12-01_h200_session5/data.log) a chunk of 8,192 multi-turn jobs took
208 s, 32.0 s of it outside ``engine.step`` (~20k requests: ~1.6 ms each): chat templates,
tokenizing whole conversations, request checks, detokenizing outputs, decoding replies. That
work runs the same code on any device, so it is measured here around ``generate_sequences``
with a tiny random Llama over SmolLM2's real tokenizer and chat template (hidden 64, 2 layers;
attention returns zeros, as in host_large_batch_cpu.py: the model is not the subject).

Workload (seeded): N ShareGPT-like conversations of 1-5 user turns (mean ~2.5) whose text is
sentences of MT-bench questions strung together, 60% short (5-40 words), 30% medium (40-200),
10% long (200-900), at temperatures 0 and 0.8, ignore_eos, max_new_tokens 256,
max_seq_len 2048, batch 128 (one chunk). "outside" is generate_sequences' wall time minus the
time inside engine.step. Each listed function is timed exclusively (time in a listed callee is
the callee's); "rest" is outside time no listed function holds. The digest covers every
training sequence (id, token ids, prompt length, spans, kind): it must not change when the host
code is optimised.

``--encode-only``: no engine; the tokenizer's cost alone on every conversation's last prompt
(earlier replies: 256 random tokens, decoded), one ``chat_ids`` call per conversation against
one ``chat_ids_batch`` call (its Rust threads: set RAYON_NUM_THREADS to compare counts).

.venv/bin/python profiles/scripts/multiturn_host_cpu.py [--convs 300] [--max-new-tokens 256]
                                                         [--batch 128] [--cprofile] [--seed 0]
                                                         [--encode-only]
"""
from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import pstats
import random
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import kernels.ops  # noqa: E402
import transformers.tokenization_utils_base as tub  # noqa: E402
from compiled_spec import LLM, SamplingParams  # noqa: E402
from compiled_spec import llm as llm_mod, tokenizer as tok_mod  # noqa: E402
from compiled_spec.engine import engine as engine_mod, stopping  # noqa: E402
from compiled_spec.engine.engine import LLMEngine  # noqa: E402
from compiled_spec.train import multiturn  # noqa: E402
from compiled_spec.train.sharegpt import Conversation  # noqa: E402

kernels.ops.paged_attention_ref = lambda q, *a: torch.zeros_like(q)


class Timers:
    """Exclusive wall time and calls per label: a wrapped call's time minus its wrapped callees'."""

    def __init__(self) -> None:
        self.excl: dict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self._stack: list[float] = []  # per open call: time spent in wrapped callees

    def wrap(self, label: str, fn: Callable) -> Callable:
        def call(*args, **kw):
            self._stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                dt = time.perf_counter() - t0
                self.excl[label] += dt - self._stack.pop()
                self.calls[label] += 1
                if self._stack:
                    self._stack[-1] += dt
        call.__wrapped__ = fn  # type: ignore[attr-defined]
        return call


# (label, owners, attribute): every owner that holds the attribute gets the wrapper (a function
# imported by name lives in several modules). Names missing before or after a change are skipped.
TARGETS: list[tuple[str, tuple, str]] = [
    ("engine.step (inside the engine)", (LLMEngine,), "step"),
    ("chat template render (jinja)", (tub,), "render_jinja_template"),
    ("tokenizer encode", (), "__call__"),  # owner: the tokenizer's class, set in main
    ("apply_chat_template (rest)", (), "apply_chat_template"),
    ("tokenizer.decode", (), "decode"),
    ("tokenizer.batch_decode", (), "batch_decode"),
    ("check_conversation", (tok_mod,), "check_conversation"),
    ("chat_ids (rest)", (tok_mod, llm_mod), "chat_ids"),
    ("chat_ids_batch (rest)", (tok_mod, multiturn), "chat_ids_batch"),
    ("LLM.encode_chat (rest)", (LLM,), "encode_chat"),
    ("_common_prefix", (multiturn,), "_common_prefix"),
    ("_next_prompt (rest)", (multiturn,), "_next_prompt"),
    ("_next_prompts (rest)", (multiturn,), "_next_prompts"),
    ("_run_round (rest)", (multiturn,), "_run_round"),
    ("SamplingParams.validate", (SamplingParams,), "validate"),
    ("LLM._encode", (LLM,), "_encode"),
    ("engine.check_request", (LLMEngine,), "check_request"),
    ("engine.add_request (rest)", (LLMEngine,), "add_request"),
    ("engine.to_output (rest)", (LLMEngine,), "to_output"),
    ("output_text (rest)", (stopping, engine_mod), "output_text"),
    ("LLM.generate (rest)", (LLM,), "generate"),
    ("LLM._run_until_done (rest)", (LLM,), "_run_until_done"),
    ("ChatJob.sequence", (multiturn.ChatJob,), "sequence"),
]


def install(timers: Timers, tok_cls: type) -> None:
    for label, owners, attr in TARGETS:
        for owner in owners or (tok_cls,):
            fn = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr,
                                                                                    None)
            if fn is None and isinstance(owner, type) and hasattr(owner, attr):
                fn = getattr(owner, attr)  # inherited: wrap on this class
            if fn is not None:
                setattr(owner, attr, timers.wrap(label, fn))


def conversations(n: int, seed: int) -> list[Conversation]:
    rows = [json.loads(x) for x in
            (ROOT / "compiled_spec" / "data" / "mt_bench_question.jsonl").read_text().splitlines()]
    words = " ".join(t for r in rows for t in r["turns"]).split()
    rng = random.Random(seed)

    def text() -> str:
        u = rng.random()
        k = rng.randint(5, 40) if u < 0.6 else rng.randint(40, 200) if u < 0.9 else \
            rng.randint(200, 900)
        start = rng.randrange(len(words))
        out = [words[(start + i) % len(words)] for i in range(k)]
        if rng.random() < 0.15:  # some code, as ShareGPT has
            out.append("\n```python\ndef f(x):\n    return [i * x for i in range(10)]\n```\n")
        return " ".join(out)

    return [Conversation(f"c{i}", [text() for _ in range(rng.choice([1, 1, 2, 2, 2, 3, 3, 4, 5]))])
            for i in range(n)]


def encode_only(convs: list[Conversation], seed: int) -> None:
    from compiled_spec.models.gguf_loader import find_default_gguf

    tok = tok_mod.load_tokenizer(find_default_gguf())
    rng = random.Random(seed)
    chats = []
    for c in convs:
        m: list[dict] = []
        for t in c.user_turns[:-1]:
            reply = tok.decode([rng.randrange(len(tok)) for _ in range(256)],
                               skip_special_tokens=True)
            m += [{"role": "user", "content": t}, {"role": "assistant", "content": reply}]
        chats.append(m + [{"role": "user", "content": c.user_turns[-1]}])
    t0 = time.perf_counter()
    one = [tok_mod.chat_ids(tok, m) for m in chats]
    t1 = time.perf_counter()
    batch = tok_mod.chat_ids_batch(tok, chats)
    t2 = time.perf_counter()
    assert batch == one
    n = len(chats)
    print(f"{n} conversations, {sum(map(len, one)) / n:.0f} tokens each: one call each "
          f"{1e3 * (t1 - t0) / n:.3f} ms per conversation, one batch {1e3 * (t2 - t1) / n:.3f} ms "
          f"(same ids)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--convs", type=int, default=300)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--cprofile", action="store_true", help="top functions by tottime")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--encode-only", action="store_true", help="the tokenizer alone, no engine")
    a = ap.parse_args()
    if a.encode_only:
        return encode_only(conversations(a.convs, a.seed), a.seed)
    torch.set_num_threads(1)
    from compiled_spec.models.gguf_loader import find_default_gguf
    from tests.spec_models import write_tiny_llama

    tok = tok_mod.load_tokenizer(find_default_gguf())
    tmp = tempfile.TemporaryDirectory()
    target = write_tiny_llama(Path(tmp.name) / "target", tok, max_positions=2048)
    llm = LLM(model=target, max_model_len=2048, max_num_seqs=a.batch,
              max_num_batched_tokens=max(4096, 32 * a.batch), kv_cache_memory_gib=1.0)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))  # first-call costs out of the way
    convs = conversations(a.convs, a.seed)
    timers = Timers()
    install(timers, type(llm.tokenizer))
    prof = cProfile.Profile() if a.cprofile else None
    if prof is not None:
        prof.enable()
    t0 = time.perf_counter()
    seqs = multiturn.generate_sequences(llm, convs, max_new_tokens=a.max_new_tokens,
                                        max_seq_len=2048, temperatures=(0.0, 0.8),
                                        batch_size=a.batch, seed=a.seed, ignore_eos=True)
    wall = time.perf_counter() - t0
    if prof is not None:
        prof.disable()
    step = timers.excl["engine.step (inside the engine)"]
    reqs = timers.calls["engine.add_request (rest)"]
    outside = wall - step
    digest = hashlib.sha1(repr([(s.id, s.input_ids, s.num_prompt, s.spans, s.kind)
                                for s in seqs]).encode()).hexdigest()[:12]
    toks = sum(len(s.input_ids) for s in seqs)
    print(f"\n{len(convs)} conversations, {len(seqs)} sequences, {reqs} requests, {toks} tokens "
          f"in the sequences; digest {digest}")
    print(f"wall {wall:.2f} s, inside engine.step {step:.2f} s, outside {outside:.2f} s = "
          f"{1e3 * outside / max(reqs, 1):.3f} ms per request\n")
    print(f"{'function (exclusive)':<34} {'calls':>7} {'s':>7} {'ms/request':>10}")
    listed = 0.0
    for label, _, _ in TARGETS[1:]:
        if timers.calls[label]:
            s = timers.excl[label]
            listed += s
            print(f"{label:<34} {timers.calls[label]:>7} {s:>7.2f} {1e3 * s / reqs:>10.3f}")
    print(f"{'rest':<34} {'':>7} {outside - listed:>7.2f} {1e3 * (outside - listed) / reqs:>10.3f}")
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
