"""``python -m capture.selfcheck_cuda``: CUDA-graph replay == eager, on a CUDA machine.

A tiny model-like function (embeddings, then attention layers through
``torch.ops.compiled_spec.write_kv`` / ``paged_attention`` over a paged KV cache) is captured by
GraphRunners for target decode (q=1), target verify (q=k+1) and a (k-1)-step draft loop captured as
one graph, at several sizes and two max_seq_len buckets. Live batches of various sizes are padded
and replayed, and each is checked against the same function run eagerly on the unpadded batch:
outputs match, the KV cache matches, and every slot the live batch does not own (padding rows
included) is bit-for-bit untouched; single-step batches also go through ``run_host`` (the
engine's path: host lists staged in two pinned copies) and must give the replay's bits. Prints a
table; exits 1 on any failure. On a CPU-only
machine it exits with a message (tests/test_capture.py covers the CPU path).
"""
from __future__ import annotations

import argparse
import random
import sys
import time

import torch

import kernels.ops  # noqa: F401  (registers torch.ops.compiled_spec.*)
from capture.cuda_graphs import GraphFn, GraphRunner
from capture.registry import GraphRegistry
from capture.host_stage import HostBatch
from capture.pad import LiveBatch, StaticBuffers, stack_steps
from capture.policy import CapturePolicy, decode_sizes, draft_step_sizes, verify_sizes
from compiled_spec.attention_metadata import AttentionMetadata
from compiled_spec.engine.batch import Span, build_metadata
from compiled_spec.kv_cache import BlockAllocator


class TinyModel:
    """Attention-only stand-in for a decoder: enough to exercise KV writes and paged attention."""

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.float32, vocab: int = 64,
                 hidden: int = 64, heads: int = 4, kv_heads: int = 2, layers: int = 2,
                 num_blocks: int = 2048, page_size: int = 4, max_pos: int = 512, seed: int = 0):
        g = torch.Generator().manual_seed(seed)

        def w(*shape: int, scale: float = 0.2) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.emb, self.pos = w(vocab, hidden, scale=1.0), w(max_pos, hidden)
        self.layers = [(w(hidden, hidden), w(hidden, kv_heads * self.head_dim),
                        w(hidden, kv_heads * self.head_dim), w(hidden, hidden))
                       for _ in range(layers)]
        shape = (num_blocks, page_size, kv_heads, self.head_dim)
        self.caches = [(torch.zeros(shape, device=device, dtype=dtype),
                        torch.zeros(shape, device=device, dtype=dtype)) for _ in range(layers)]

    def _body(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
              ) -> torch.Tensor:
        t = x.shape[0]  # x [T, hidden]
        x = x + self.pos[positions]
        for (wq, wk, wv, wo), (kc, vc) in zip(self.layers, self.caches):
            q = (x @ wq).view(t, self.heads, self.head_dim)
            k = (x @ wk).view(t, self.kv_heads, self.head_dim)
            v = (x @ wv).view(t, self.kv_heads, self.head_dim)
            torch.ops.compiled_spec.write_kv(k, v, kc, vc, meta.slot_mapping)
            o = torch.ops.compiled_spec.paged_attention(
                q, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                meta.max_query_len, meta.max_seq_len, self.head_dim ** -0.5)
            x = x + o.reshape(t, -1) @ wo
        return x  # [T, hidden]

    def forward(self, b: LiveBatch) -> torch.Tensor:  # target decode / verify: [T, hidden]
        return self._body(self.emb[b.input_ids], b.positions, b.meta)

    def draft_loop(self, b: LiveBatch) -> torch.Tensor:  # [B, S] greedy "draft" ids
        tok, feed, out = b.input_ids, b.extras["feed"], []
        for j in range(b.num_steps):
            positions, meta = b.step(j)
            feed = self._body(self.emb[tok] + feed, positions, meta)
            tok = (feed @ self.emb.T).argmax(-1)
            out.append(tok)
        return torch.stack(out, 1)


def make_world(model: TinyModel, ctx_lens: list[int], lookahead: int) -> BlockAllocator:
    """Allocator with block 0 reserved (the padding dummy), one request per context length,
    prefilled through the model so the cache holds real context."""
    kc = model.caches[0][0]
    alloc = BlockAllocator(kc.shape[0], kc.shape[1])
    alloc.grow(-1, 1)  # takes block 0: no live request owns the padding block
    for i, n in enumerate(ctx_lens):
        alloc.grow(i, n + lookahead)
    spans = [Span(i, 0, n) for i, n in enumerate(ctx_lens)]
    ids = torch.randint(0, model.emb.shape[0], (sum(ctx_lens),), device=kc.device)
    pos, meta = build_metadata(alloc, spans, kc.device)
    model.forward(LiveBatch(ids, pos, meta))
    return alloc


def live_batch(model: TinyModel, alloc: BlockAllocator, reqs: list[int], starts: list[int],
               q_lens: list[int], steps: int = 0) -> LiveBatch:
    """q_lens tokens per request from ``starts``; steps > 0: a one-token draft loop batch."""
    dev, vocab = model.emb.device, model.emb.shape[0]
    if steps == 0:
        pos, meta = build_metadata(alloc, [Span(r, s, q) for r, s, q in zip(reqs, starts, q_lens)],
                                   dev)
        return LiveBatch(torch.randint(0, vocab, (pos.shape[0],), device=dev), pos, meta)
    per_step = [build_metadata(alloc, [Span(r, s + j, 1, s + steps) for r, s in zip(reqs, starts)],
                               dev) for j in range(steps)]
    return stack_steps(per_step, torch.randint(0, vocab, (len(reqs),), device=dev),
                       {"feed": torch.randn(len(reqs), model.emb.shape[1], device=dev,
                                            dtype=model.emb.dtype)})


def check_case(model: TinyModel, runner: GraphRunner, ref_fn: GraphFn, live: LiveBatch,
               tol: float) -> dict:
    """Eager on the unpadded batch vs runner.run (padded replay); the cache is restored after."""
    snap = [(k.clone(), v.clone()) for k, v in model.caches]
    ref = ref_fn(live)
    ref_caches = [(k.clone(), v.clone()) for k, v in model.caches]
    for (k, v), (ks, vs) in zip(model.caches, snap):
        k.copy_(ks), v.copy_(vs)
    before = runner.graph_replays
    out = runner.run(live)
    torch.cuda.synchronize()
    written = torch.zeros(model.caches[0][0].shape[:2], dtype=torch.bool, device=out.device)
    slots = live.meta.slot_mapping.reshape(-1)
    written.view(-1)[slots[slots >= 0]] = True
    kv_diff, untouched = 0.0, True  # relative: the residual stream grows over layers / steps
    for (k, v), (kr, vr), (ks, vs) in zip(model.caches, ref_caches, snap):
        for c, cr, cs in ((k, kr, ks), (v, vr, vs)):
            kv_diff = max(kv_diff, (c - cr).abs().max().item() / max(cr.abs().max().item(), 1e-6))
            untouched &= bool(torch.equal(c[~written], cs[~written]))
        k.copy_(ks), v.copy_(vs)
    if out.dtype.is_floating_point:
        diff = (out.float() - ref.float()).abs().max().item() / max(ref.abs().max().item(), 1e-6)
    else:
        diff = float((out != ref).sum().item())  # mismatching draft ids
    host_equal = True
    if live.num_steps == 1 and runner.graph_replays > before:
        # The engine's path: the same batch as host lists, staged in two (pinned) copies.
        out = out.clone()  # graph memory: the next replay rewrites it
        staged = runner.run_host(host_batch_of(live))
        torch.cuda.synchronize()
        host_equal = staged is not None and torch.equal(staged, out)
        for (k, v), (ks, vs) in zip(model.caches, snap):
            k.copy_(ks), v.copy_(vs)
    return {"path": "graph" if runner.graph_replays > before else "eager", "diff": diff,
            "kv_diff": kv_diff, "untouched": untouched, "host_equal": host_equal,
            "ok": out.shape == ref.shape and diff <= tol and kv_diff <= tol and untouched
            and host_equal}


def host_batch_of(live: LiveBatch) -> HostBatch:
    m = live.meta
    return HostBatch(input_ids=live.input_ids.tolist(), positions=live.positions.tolist(),
                     slots=m.slot_mapping.tolist(), seq_lens=m.seq_lens.tolist(),
                     query_start_loc=m.query_start_loc.tolist(), tables=m.block_tables.tolist(),
                     max_query_len=m.max_query_len, max_seq_len=m.max_seq_len)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd run")
    ap.add_argument("-k", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("capture.selfcheck_cuda: no CUDA device here; nothing checked "
                         "(run it on a GPU machine; tests/test_capture.py covers the CPU path)")
    return run_checks(torch.device("cuda"), args.k, compile_too=not args.no_compile)


def run_checks(dev: torch.device, k: int, compile_too: bool) -> int:
    torch.manual_seed(0)
    random.seed(0)
    policy = CapturePolicy(max_batch_size=16, num_speculative_tokens=k, max_model_len=256,
                           seq_len_buckets=(64, 256))
    model = TinyModel(dev)
    ctx = [random.randint(5, 40) for _ in range(12)] + [random.randint(41, 200) for _ in range(12)]
    alloc = make_world(model, ctx, lookahead=k + 1)
    max_blocks = alloc.blocks_for(policy.max_model_len)
    rows, ok_all = [], True
    modes = ["eager-fn"] + (["compiled-fn"] if compile_too else [])
    for mode in modes:
        fwd, loop = model.forward, model.draft_loop
        if mode == "compiled-fn":
            fwd, loop = torch.compile(fwd, dynamic=True), torch.compile(loop, dynamic=True)
        reg = GraphRegistry(dev)
        bmax, q = policy.max_batch_size, policy.verify_query_len
        t0 = time.perf_counter()
        dec = reg.register("decode", fwd, decode_sizes(policy),
                           StaticBuffers(bmax, bmax, max_blocks, dev),
                           seq_len_buckets=policy.seq_len_buckets)
        ver = reg.register("verify", fwd, verify_sizes(policy),
                           StaticBuffers(bmax * q, bmax, max_blocks, dev),
                           seq_len_buckets=policy.seq_len_buckets, query_len=q)
        drf = reg.register("draft_loop", loop, draft_step_sizes(policy),
                           StaticBuffers(bmax, bmax, max_blocks, dev, num_steps=k - 1,
                                         token_extras={"feed": ((model.emb.shape[1],),
                                                                model.emb.dtype)}),
                           seq_len_buckets=policy.seq_len_buckets, output_rows="seqs")
        reg.capture_all()
        reg.assert_captured("decode", "verify", "draft_loop")
        n_graphs = sum(len(r.stats()["captured_graphs"]) for r in reg.runners.values())
        print(f"[{mode}] captured {n_graphs} graphs in {time.perf_counter() - t0:.1f}s")
        short, long_ = list(range(12)), list(range(12, 24))
        cases = []  # (runner, ref, reqs, q_lens, steps)
        for b in (1, 3, 5, 8, 13, 16):  # odd: short contexts (bucket 64); even: mixed (256)
            reqs = short[:b] if b % 2 and b <= 12 else long_[:b // 2] + short[:b - b // 2]
            cases.append((dec, fwd, reqs, [1] * b, 0))
            cases.append((ver, fwd, reqs, [q] * b, 0))
            cases.append((drf, loop, reqs, [1] * b, k - 1))
        cases.append((ver, fwd, long_[:7], [1, q, 2, q, 1, 3, q], 0))  # mixed q_len (k_i < k)
        cases.append((dec, fwd, list(range(20)), [1] * 20, 0))  # above the largest: eager
        for runner, ref_fn, reqs, q_lens, steps in cases:
            live = live_batch(model, alloc, reqs, [ctx[r] for r in reqs], q_lens, steps)
            res = check_case(model, runner, ref_fn, live, tol=1e-4)
            res["ok"] &= res["path"] == ("graph" if len(reqs) <= bmax else "eager")
            ok_all &= res["ok"]
            rows.append((mode, runner.name, len(reqs), live.num_tokens, live.meta.max_seq_len,
                         res["path"], res["diff"], res["kv_diff"], res["untouched"], res["ok"]))
        # Replay vs eager launch time, decode batch of 8.
        live = live_batch(model, alloc, short[:8], [ctx[r] for r in short[:8]], [1] * 8)
        for name, f in (("replay", lambda: dec.run(live)), ("no-graph", lambda: fwd(live))):
            for _ in range(3):
                f()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(50):
                f()
            torch.cuda.synchronize()
            us = (time.perf_counter() - t0) / 50 * 1e6
            print(f"[{mode}] decode B=8 {name}: {us:.0f} us/step")
        for name, st in reg.stats().items():
            print(f"[{mode}] {name}: " + ", ".join(f"{key}={st[key]}" for key in (
                "graph_replays", "padded_rows", "eager_fallbacks", "fallback_reasons",
                "captured_sizes", "capture_failures")))
    print(f"\n{'mode':12s} {'component':11s} {'B':>3s} {'tokens':>6s} {'max_seq':>7s} "
          f"{'path':6s} {'rel|out|':>9s} {'rel|kv|':>9s} {'untouched':>9s}  ok")
    for m, c, b, t, s, p, d, kd, u, ok in rows:
        print(f"{m:12s} {c:11s} {b:3d} {t:6d} {s:7d} {p:6s} {d:9.2e} {kd:9.2e} {str(u):>9s}  "
              f"{'OK' if ok else 'FAIL'}")
    print("\nALL OK" if ok_all else "\nFAILURES")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
