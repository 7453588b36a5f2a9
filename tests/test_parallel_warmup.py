"""The cold-start attention warm-up's worker processes (kernels/warmup_parallel.py): how the
configurations are shared out, the workers launching their share (under the Triton interpreter
here; on a GPU they compile into Triton's cache), and a failing worker counted and named."""
from __future__ import annotations

import pytest
import torch

from kernels import warmup_parallel as wp
from kernels.launch import reachable_configs


def test_configurations_are_shared_out_once_each():
    configs = reachable_configs(4, 8, 2048, 2048, 132)  # the 8B shape's 18 configurations
    assert len(configs) == 18
    for workers in (1, 3, 8, 40):
        groups = wp.shares(configs, workers)
        assert len(groups) == min(workers, len(configs))
        assert sorted(c for g in groups for c in g) == sorted(configs)
        assert max(map(len, groups)) - min(map(len, groups)) <= 1
    assert 1 <= wp.num_workers(17) <= 8 and wp.num_workers(1) == 1


def test_workers_are_spread_only_on_a_cold_cache(monkeypatch):
    assert wp.worth_spreading(0.6, 17)  # a compile: share the rest out
    assert not wp.worth_spreading(0.004, 17)  # loaded from the cache: the rest will be too
    assert not wp.worth_spreading(0.6, 1)  # one left: not worth a process
    monkeypatch.delenv(wp.ENV, raising=False)
    assert wp.enabled()  # on by default (measured on the H200, twentieth session)
    monkeypatch.setenv(wp.ENV, "0")
    assert not wp.enabled()
    monkeypatch.setenv(wp.ENV, "1")
    assert wp.enabled()


def test_workers_launch_their_share_and_failures_are_counted(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the workers run the kernels interpreted
    k = torch.zeros(6, 16, 3, 32)  # [num_blocks, page_size, num_kv_heads, head_dim]
    configs = [(8, 1), (8, 2), (16, 4)]
    groups = wp.shares(configs, 2)
    good = [wp.spec_of(k, 9, g, rope=i == 0) for i, g in enumerate(groups)]
    assert good[0]["stride"] == list(k.stride()) and good[0]["dtype"] == "float32"
    bad = dict(good[0], dtype="not_a_dtype")
    launched, failed = wp.wait(wp.start(good + [bad]), timeout_s=300)
    assert (launched, failed) == (3, 1)
    assert "attention warm-up worker failed" in capsys.readouterr().err


def _fake_warmup(monkeypatch, slow: set[tuple[int, int]]):
    """kernels.warmup._compile_in_workers with launches faked: a config in ``slow`` takes
    0.3 s (a compile), the others nothing (a cache load); returns it, the workers' configs
    and the workers stopped (as their configs), in the order of the calls in ``events``."""
    import time

    from kernels import warmup

    def fake_warm(k, v, num_heads, q, s, configs):
        for c in configs:
            if c in slow:
                time.sleep(0.3)
        return configs

    started: list[list[tuple[int, int]]] = []
    stopped: list[list[tuple[int, int]]] = []
    events: list[str] = []

    def start(specs):
        events.append("start")
        started.extend(s["configs"] for s in specs)
        return specs

    def warm(k, v, num_heads, q, s, configs):
        events.append(f"launch {configs}")
        return fake_warm(k, v, num_heads, q, s, configs)

    monkeypatch.setattr(warmup, "warm_attention", warm)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(wp, "start", start)
    monkeypatch.setattr(wp, "stop", lambda procs: stopped.extend(s["configs"] for s in procs))
    monkeypatch.setattr(wp, "wait", lambda procs: (len(procs), 0))
    return warmup._compile_in_workers, started, stopped, events


def test_a_warm_cache_stops_its_workers_though_the_first_launch_is_slow(monkeypatch):
    # The H200 (twenty-sixth session): the process's first Triton launch cost >= 0.15 s on a
    # warm cache, and timing it sent every warm start to 8 workers for ~4 s. The second
    # launch decides; the workers started before it are stopped, not waited for.
    configs = [(1, s) for s in range(1, 9)]
    run, started, stopped, events = _fake_warmup(monkeypatch, slow={configs[0]})
    assert run(torch.zeros(2, 16, 1, 8), torch.zeros(2, 16, 1, 8), 4, configs) == []
    assert started and stopped == started


def test_a_cold_cache_spreads_what_the_first_two_launches_left(monkeypatch):
    # The workers start before the two in-process launches (their own start-up is most of
    # their time), and are kept when the second launch compiled.
    configs = [(1, s) for s in range(1, 9)]
    run, started, stopped, events = _fake_warmup(monkeypatch, slow=set(configs))
    procs = run(torch.zeros(2, 16, 1, 8), torch.zeros(2, 16, 1, 8), 4, configs)
    assert len(procs) == len(started) >= 1 and stopped == []
    assert sorted(tuple(c) for g in started for c in g) == configs[2:]
    assert events == ["start", f"launch {configs[:1]}", f"launch {configs[1:2]}"]


def test_too_few_configurations_start_no_workers(monkeypatch):
    configs = [(1, 1), (1, 2), (1, 4)]  # one left after the two in-process launches
    run, started, stopped, events = _fake_warmup(monkeypatch, slow=set(configs))
    assert run(torch.zeros(2, 16, 1, 8), torch.zeros(2, 16, 1, 8), 4, configs) == []
    assert started == [] and "start" not in events


def test_stopped_workers_are_killed_and_reaped():
    import signal

    k = torch.zeros(6, 16, 3, 32)  # [num_blocks, page_size, num_kv_heads, head_dim]
    procs = wp.start([wp.spec_of(k, 9, [(8, 1)], rope=False) for _ in range(2)])
    wp.stop(procs)  # well before a worker is through importing torch
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2


class _Attn(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_heads = 4
        self.k_cache = torch.zeros(2, 16, 1, 8)  # [num_blocks, page_size, num_kv_heads, head_dim]
        self.v_cache = torch.zeros(2, 16, 1, 8)


@pytest.mark.parametrize("defer", [True, False])
def test_a_cold_starts_workers_run_on_until_the_first_attention_launch(monkeypatch, defer):
    # Cold start on the H200 (twenty-sixth session): 11-16 s of attention warm-up before the
    # model's compile began. Deferred, the workers compile while the model does; the join
    # (kernels.warmup_pending.finish, called by the first attention launch) waits for them and
    # only then loads the binaries.
    from kernels import warmup, warmup_pending

    events: list[str] = []
    monkeypatch.setattr(warmup, "_spreads", lambda k: True)
    monkeypatch.setattr(warmup, "_sms", lambda k: 132)
    monkeypatch.setattr(warmup, "_compile_in_workers",
                        lambda k, v, h, configs, gdc: events.append("spawn") or ["p1", "p2"])
    monkeypatch.setattr(wp, "wait", lambda procs: events.append(f"wait {len(procs)}") or (7, 0))
    monkeypatch.setattr(warmup, "warm_attention",
                        lambda k, v, h, q, s, configs: events.append("load") or configs)
    monkeypatch.setattr(warmup_pending, "PENDING", [])
    layers = [_Attn(), _Attn()]  # one shape: one warm-up
    out = warmup.warm_model_attention(layers, 64, 256, defer=defer)
    if defer:
        assert events == ["spawn"] and len(warmup_pending.PENDING) == 1
        assert out["configs"] == 0 and "join_s" not in out
        warmup_pending.finish()
        assert warmup_pending.PENDING == []
        assert "join_s" in out
    else:
        assert warmup_pending.PENDING == [] and "serial_s" in out
    assert events == ["spawn", "wait 2", "load"]  # loads only after the workers are done
    assert out["parallel_workers"] == 2 and out["parallel_configs"] == 7
    assert out["configs"] == len(reachable_configs(4, 1, 64, 256, 132))
    warmup_pending.finish()  # nothing left: a no-op
    assert events == ["spawn", "wait 2", "load"]


def test_pdl_warm_up_launches_inside_the_pdl_scope_for_narrow_calls_only(monkeypatch):
    """An engine whose calls launch with PDL meets GDC=1 binaries, which the engine's own
    warm-up (before PDL is resolved) never compiles: ``gdc=True`` launches the configurations
    of calls of at most PDL_MAX_ROWS query tokens inside the PDL scope, workers included."""
    from kernels import dispatch, warmup

    seen = []

    def spy(k, v, num_heads, max_query_len, max_seq_len, force=False, sms=None, configs=None):
        seen.append((dispatch._PDL.get(), max_query_len))
        return []

    monkeypatch.setattr(warmup, "warm_attention", spy)
    monkeypatch.delenv("COMPILED_SPEC_GEMM_PDL", raising=False)
    warmup.warm_model_attention([_Attn()], 2048, 2048)
    warmup.warm_model_attention([_Attn()], 2048, 2048, defer=True, gdc=True)  # never deferred
    warmup.warm_model_attention([_Attn()], 16, 2048, gdc=True)
    assert seen == [(False, 2048), (True, dispatch.PDL_MAX_ROWS), (True, 16)]
    assert not dispatch._PDL.get()  # the scope ends with the warm-up
    # a worker asked for GDC=1 binaries launches inside the scope too, and skips the rope kernel
    k = torch.zeros(2, 16, 1, 8)  # [num_blocks, page_size, num_kv_heads, head_dim]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    seen.clear()
    for gdc in (False, True):
        warmup._worker(wp.spec_of(k, 4, [(16, 1)], rope=False, gdc=gdc))
    assert [s[0] for s in seen] == [False, True]
    assert wp.spec_of(k, 4, [(16, 1)], rope=True)["gdc"] is False
    # ... and a cold cache's workers are started with it
    specs = []
    monkeypatch.setattr(wp, "start", lambda s: specs.extend(s) or s)
    monkeypatch.setattr(wp, "worth_spreading", lambda first_s, rest: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    configs = [(16, s) for s in (1, 2, 4, 8, 16)]
    assert warmup._compile_in_workers(k, k, 4, configs, gdc=True) == specs
    assert specs and all(s["gdc"] and not s["rope"] for s in specs)


def test_pdl_warm_up_takes_the_layers_whose_calls_launch_with_pdl(monkeypatch):
    from types import SimpleNamespace as NS

    from compiled_spec import llm_compile
    from compiled_spec.engine.engine import LLMEngine
    from compiled_spec.pdl_policy import PdlChoice

    calls = []
    monkeypatch.setattr(llm_compile, "warm_model_attention",
                        lambda layers, q, s, gdc: calls.append((layers, q, s, gdc)) or
                        {"seconds": 0.5})
    target = [NS(self_attn=f"t{i}") for i in range(2)]
    draft = [NS(self_attn="d0")]
    engine = NS(model=NS(model=NS(layers=target)), draft=NS(layers=draft))
    # the engine's own list (the one its GDC=0 warm-up takes), on this stand-in
    engine.attention_layers = lambda target, draft: LLMEngine.attention_layers(
        engine, target, draft)
    on, off = PdlChoice(True, "on"), PdlChoice(False, "off")

    def warm(pdl, pdl_draft):
        calls.clear()
        out = llm_compile.warm_pdl_attention(engine, NS(pdl=pdl, pdl_draft=pdl_draft), 1024)
        return out, [c[0] for c in calls]

    monkeypatch.delenv(wp.PDL_ENV, raising=False)
    assert warm(on, on) == (None, [])  # opt-in until timed on a GPU
    monkeypatch.setenv(wp.PDL_ENV, "1")
    assert warm(on, on) == ({"seconds": 0.5}, [["t0", "t1", "d0"]])
    assert calls[0][1:] == (1024, 1024, True)
    assert warm(on, off)[1] == [["t0", "t1"]]
    assert warm(off, on)[1] == [["d0"]]
    assert warm(off, None) == (None, [])
