"""Issue 4: the engine's host work per decode step, outside the graph replays (CPU, no GPU needed).

On the H200 a SmolLM2 decode step keeps the GPU busy 0.83 ms while a token costs 1.5 ms end to
end: the rest is host work around the replays (Python scheduling, metadata, padding copies,
acceptance, the proposer's bookkeeping). The host side runs the same code on any device, so it is
measured here: the engine runs compiled (our passes, no Inductor) through emulated CUDA graphs
(``capture.emulate``), a dispatch mode counts every aten op issued *outside* a replay (on a GPU
each is a kernel launch or a copy, each costing host time), and the step's wall time minus the
time spent inside replays is its host time.

python profiles/scripts/host_overhead_cpu.py [--fixtures .device/tc] [--tokenizer GGUF] [--tokens 96]
    [--ops [--by-frame]] [--cprofile] [--cprofile-critical]

Fixtures: the tiny bigram target + EAGLE-3 head of tests/conftest.py (built on first use, as in
profiles/scripts/tree_graphs_check.py). Model size does not matter here: replays are excluded.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from capture import CapturePolicy  # noqa: E402
from capture.emulate import EmulatedGraph  # noqa: E402
from compiled_spec import LLM, SamplingParams  # noqa: E402
from compiled_spec.compile import CompileConfig, capture_graphs, compile_models  # noqa: E402

_IN_REPLAY = [0]
_REPLAY_S = [0.0]
# The critical path: from the end of the step's device-to-host copy to the next replay. On a
# GPU nothing is queued then (the copy waited for all work), so every microsecond of it is the
# GPU's idle time; host work after that replay overlaps the GPU's.
_SYNC_END: list[float | None] = [None]
_CRIT_S = [0.0]
_CRIT_PROF: list[cProfile.Profile | None] = [None]  # --cprofile-critical: that path alone
# From the same copy to the next TARGET replay: the host's whole turnaround. A step that
# proposed early (engine/early_propose.py) has its draft queued on the GPU during it, so its
# GPU idles only for what this exceeds the draft's GPU time; a late step idles through
# sync_to_launch, then again wherever the rest outlasts the draft.
_SYNC_END_T: list[float | None] = [None]
_CRIT_T_S = [0.0]
_PROPOSE_GRAPHS: set[int] = set()  # ids of the propose graphs' (emulated) graph objects
# The engine's HostClock (engine/host_clock.py): an emulated replay's run is moved out of its
# phases, so host_phase_ms is host work alone, as on a GPU (where a replay is one launch).
_CLOCK: list = [None]
_orig_replay = EmulatedGraph.replay


def _timed_replay(self: EmulatedGraph) -> None:
    _IN_REPLAY[0] += 1
    t0 = time.perf_counter()
    if _SYNC_END_T[0] is not None and id(self) not in _PROPOSE_GRAPHS:
        _CRIT_T_S[0] += t0 - _SYNC_END_T[0]
        _SYNC_END_T[0] = None
    if _SYNC_END[0] is not None:
        _CRIT_S[0] += t0 - _SYNC_END[0]
        _SYNC_END[0] = None
        if _CRIT_PROF[0] is not None:
            _CRIT_PROF[0].disable()
    try:
        with _disable_current_modes():  # a replay is one launch, and Dynamo refuses the mode
            _orig_replay(self)
    finally:
        dt = time.perf_counter() - t0
        _REPLAY_S[0] += dt
        if _CLOCK[0] is not None and _IN_REPLAY[0] == 1:  # the outermost replay alone
            _CLOCK[0]._t += dt
        if _SYNC_END_T[0] is not None:  # a replay is one launch: its emulated run is no host work
            _SYNC_END_T[0] += dt
        _IN_REPLAY[0] -= 1


EmulatedGraph.replay = _timed_replay  # type: ignore[method-assign]


class OpCounter(TorchDispatchMode):
    """Counts aten ops issued outside replays (a replay on a GPU is one launch)."""

    def __init__(self, by_frame: bool = False) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.by_frame = by_frame
        self.frames: Counter[str] = Counter()  # launching ops per innermost project function

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _IN_REPLAY[0]:
            name = str(func.overloadpacket.__name__)
            self.ops[name] += 1
            if self.by_frame and name not in _NO_LAUNCH:
                self.frames[f"{_project_frame()} {name}"] += 1
        return func(*args, **(kwargs or {}))


# Ops that only make views or host tensors: no kernel launch on a GPU.
_NO_LAUNCH = {"slice", "narrow", "select", "view", "reshape", "detach", "detach_", "lift_fresh",
              "expand", "unsqueeze", "squeeze", "as_strided", "t", "permute", "transpose", "alias",
              "resolve_conj", "resolve_neg", "_unsafe_view", "split", "unbind"}


def _project_frame() -> str:
    """file:function of the innermost frame in this repository's packages."""
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename
        if any(f"/{d}/" in path for d in ("compiled_spec", "capture", "kernels", "passes")):
            return f"{Path(path).parent.name}/{Path(path).name}:{f.f_code.co_name}"
        f = f.f_back
    return "?"


def fixtures(fx: Path, tokenizer: str) -> tuple[str, str, str]:
    if not (fx / "head" / "config.json").is_file():
        from compiled_spec.train import TrainConfig, train
        from tests.spec_models import write_bigram_target, write_id_prompts

        fx.mkdir(parents=True, exist_ok=True)
        target = write_bigram_target(fx / "target", vocab=32, layers=2)
        prompts = write_id_prompts(fx / "prompts.jsonl", 32, vocab=32)
        train(TrainConfig(target=target, prompts=prompts, out=str(fx / "head"),
                          tokenizer=tokenizer, draft_vocab_size=24, ttt_steps=3, steps=150,
                          batch_size=8, lr=5e-3, warmup_steps=10, max_seq_len=64,
                          max_new_tokens=40, ignore_eos=True, log_every=50, save_every=0, seed=0))
    tok = str(fx / "tok") if (fx / "tok").is_dir() else tokenizer
    return str(fx / "target"), str(fx / "head"), tok


def measure(name: str, llm: LLM, k: int, batch: int, tokens: int, ops: bool,
            prof: cProfile.Profile | None, by_frame: bool = False) -> dict:
    cfg = llm.config
    models = compile_models(llm.engine.runner, CompileConfig(inductor=False))
    llm._compiled = models
    policy = CapturePolicy(max_batch_size=batch, num_speculative_tokens=k,
                           max_model_len=cfg.max_model_len, batch_sizes=(batch,),
                           seq_len_buckets=(cfg.max_model_len,))
    graphs = capture_graphs(llm.engine.runner, models, policy, cfg.cache.page_size, emulate=True)
    _PROPOSE_GRAPHS.clear()
    for pg in (graphs.propose, graphs.propose_early):
        # A tree engine's propose is two GraphRunners (first pass, expand), a chain's one object.
        parts = [] if pg is None else [pg.first_pass, pg.expand] if hasattr(pg, "expand") \
            else [pg]
        _PROPOSE_GRAPHS.update(id(g) for part in parts for g, _ in part._graphs.values())
    sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    prompts = [[3, 7, 1, 9, 2, 4][: 3 + i % 3] + [i % 29 + 1] for i in range(batch)]
    llm.generate(prompts, sp, use_tqdm=False)  # warm: Dynamo guards, allocator, graphs

    eng = llm.engine
    to_host = eng.runner.to_host
    _CLOCK[0] = eng.runner.clock

    def timed_to_host(*args, **kwargs):
        out = to_host(*args, **kwargs)
        _SYNC_END[0] = _SYNC_END_T[0] = time.perf_counter()
        if _CRIT_PROF[0] is not None:
            _CRIT_PROF[0].enable()
        return out

    eng.runner.to_host = timed_to_host
    for p in prompts:
        eng.add_request(p, sp)
    eng.step()  # prefill (not a decode step)
    _SYNC_END[0] = _SYNC_END_T[0] = None
    host_ms, replay_ms, crit_ms, counter = [], [], [], OpCounter(by_frame)
    crit_t_ms = []
    tokens_before = eng.stats.num_decode_tokens
    phases_before = dict(eng.stats.host_phase_s)  # the engine's own clock (host_clock.py)
    steps = 0
    while eng.has_unfinished():
        # a copy's path to the next launch may span steps
        _REPLAY_S[0] = _CRIT_S[0] = _CRIT_T_S[0] = 0.0
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        if ops:
            with counter:
                eng.step()
        else:
            eng.step()
        if prof is not None:
            prof.disable()
        wall = time.perf_counter() - t0
        host_ms.append((wall - _REPLAY_S[0]) * 1e3)
        replay_ms.append(_REPLAY_S[0] * 1e3)
        crit_ms.append(_CRIT_S[0] * 1e3)
        crit_t_ms.append(_CRIT_T_S[0] * 1e3)
        steps += 1
    emitted = eng.stats.num_decode_tokens - tokens_before
    row = {"variant": name, "batch": batch, "k": k, "steps": steps, "tokens": emitted,
           "host_ms_per_step_median": statistics.median(host_ms),
           "host_ms_per_step_p90": sorted(host_ms)[int(0.9 * (len(host_ms) - 1))],
           "replay_ms_per_step_median": statistics.median(replay_ms),
           "sync_to_launch_ms_median": statistics.median(crit_ms),
           "sync_to_target_launch_ms_median": statistics.median(crit_t_ms)}
    phases = {p: (s - phases_before.get(p, 0.0)) * 1e3 / max(1, steps)
              for p, s in eng.stats.host_phase_s.items()}
    row["host_phase_ms"] = {p: round(v, 4) for p, v in phases.items() if v > 0}
    st = graphs.stats()
    row["replays_per_step"] = round(st["replayed"] / max(1, steps), 2)
    row["without_graph"] = st["without_graph"]
    if eng.stats.early_propose is not None:  # cumulative, the warm-up run included
        row["early_propose"] = eng.stats.early_propose.as_dict()
    if eng.stats.verify_ahead is not None and eng.stats.verify_ahead.launched:
        row["verify_ahead"] = eng.stats.verify_ahead.as_dict()
    if eng.stats.deferred_first_pass is not None:
        row["deferred_first_pass"] = eng.stats.deferred_first_pass.as_dict()
    if ops:
        row["aten_ops_per_step"] = round(sum(counter.ops.values()) / steps, 1)
        row["top_ops"] = {o: round(n / steps, 2) for o, n in counter.ops.most_common(40)}
    if by_frame:
        row["launches_per_step"] = round(sum(counter.frames.values()) / steps, 1)
        row["launches_by_frame"] = {o: round(n / steps, 2)
                                    for o, n in counter.frames.most_common(40)}
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default=".device/tc")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--ops", action="store_true", help="count aten ops (slows the host timing)")
    ap.add_argument("--cprofile", action="store_true", help="print the top host functions")
    ap.add_argument("--cprofile-critical", action="store_true",
                    help="the same for the path from the step's copy to the next replay only")
    ap.add_argument("--by-frame", action="store_true",
                    help="with --ops: launching ops (no views) per project function")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--trees", action="store_true", help="also two draft-tree variants")
    ap.add_argument("--only", nargs="+", default=None, help="these variants alone (by name)")
    a = ap.parse_args()
    if a.tokenizer is None:
        from compiled_spec.models.gguf_loader import find_default_gguf

        a.tokenizer = find_default_gguf()
    torch.set_num_threads(1)
    target, head, tok = fixtures(Path(a.fixtures), a.tokenizer)
    rows = []
    for batch in a.batch:
        # eagle3_k5: chain steps propose before the acceptance is read (early_propose, the
        # default); eagle3_k5_late: after it, as before issue 16.
        # eagle3_k5_ahead: early steps also launch the next verify before the bookkeeping
        # (engine/verify_ahead.py).
        variants = [("vanilla", None, 0, {"verify_ahead": False}),
                    ("vanilla_ahead", None, 0, {"verify_ahead": True}),
                    ("eagle3_k5", head, 5, {"verify_ahead": False}),
                    ("eagle3_k5_ahead", head, 5, {"verify_ahead": True}),
                    ("eagle3_k5_late", head, 5, {"early_propose": False}),
                    # speculation paused every step (the adaptive policy's PLAIN mode): how
                    # far a paused step's host work is from vanilla's
                    ("eagle3_k5_paused", head, 5, {"speculation_policy": "adaptive",
                                                   "verify_ahead": True}),
                    # ... with the first pass run every paused step, not deferred (before
                    # the thirty-ninth session)
                    ("eagle3_k5_paused_sync", head, 5, {"speculation_policy": "adaptive",
                                                        "verify_ahead": True,
                                                        "defer_paused_first_pass": False})]
        if a.trees:  # issue 15: a tree step's host work against the chain's
            t8 = {"speculative_topk": 8, "speculative_num_draft_tokens": 32}
            variants += [("tree_topk4_16", head, 5, {"speculative_topk": 4,
                                                      "speculative_num_draft_tokens": 16}),
                         ("tree_topk8_32", head, 5, {**t8, "verify_ahead": False}),
                         ("tree_topk8_32_ahead", head, 5, {**t8, "verify_ahead": True})]
        for name, draft, k, extra in variants:
            if a.only is not None and name not in a.only:
                continue
            spec = {"draft": draft, "num_speculative_tokens": k, **extra} if draft else extra
            llm = LLM(model=target, tokenizer=tok, max_model_len=256, max_num_seqs=batch,
                      num_kv_blocks=20 * batch + 8, dtype="float32", **spec)
            if "_paused" in name:  # a stand-in policy: PLAIN every step
                from compiled_spec.spec.policy import PLAIN
                from tests.policy_stub import ModesInTurn

                llm.engine.stats.policy = ModesInTurn([PLAIN])
            prof = cProfile.Profile() if a.cprofile else None
            _CRIT_PROF[0] = cProfile.Profile() if a.cprofile_critical else None
            row = measure(name, llm, k, batch, a.tokens, a.ops, prof, a.by_frame)
            if _CRIT_PROF[0] is not None:
                _CRIT_PROF[0].disable()
                print(f"== {name}: from the step's copy to the next replay")
                order = os.environ.get("CRIT_SORT", "cumulative")  # or tottime
                pstats.Stats(_CRIT_PROF[0]).sort_stats(order).print_stats(30)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if prof is not None:
                pstats.Stats(prof).sort_stats(os.environ.get("PROF_SORT", "cumulative")).print_stats(os.environ.get("PROF_FILTER", r"compiled_spec|capture"),
                                                                        40)
    print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                      "cpu": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}))


if __name__ == "__main__":
    main()
