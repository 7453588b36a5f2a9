"""``compiled-spec bench`` smoke test on the CPU (no speed assertions): every engine variant runs
on the same prompts, the report files are written, and the columns that do not depend on speed
hold: fp32 greedy outputs identical across our engines and transformers, tau only on speculative
rows, a projection for the random-weight shape."""
from __future__ import annotations

import json

import pytest
import torch

from compiled_spec.cli import main


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory, smollm2_tokenizer):
    from tests.spec_models import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("bench_target"), smollm2_tokenizer,
                            layers=4, max_positions=1024)


@pytest.mark.heavy
def test_bench_cpu_smoke(tiny_hf_dir, mt_bench_path, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["bench", "--model", tiny_hf_dir, "--random-draft", "--device", "cpu",
               "--prompts", mt_bench_path, "--num-prompts", "2", "--max-tokens", "8",
               "--max-model-len", "1024", "--batch-sizes", "1", "2", "--shape", "tiny",
               "--shape-prompts", "1", "--shape-max-tokens", "4", "--out-dir", str(out)])
    assert rc == 0
    # Each variant's rows are in the log as it finishes (a later variant's CUDA fault aborts
    # the process before the report is written): the same rows as the report's, ours only.
    logged = [json.loads(line[4:]) for line in capsys.readouterr().out.splitlines()
              if line.startswith("ROW ")]
    data = json.loads((out / "benchmarks.json").read_text())
    md = (out / "BENCHMARKS.md").read_text()
    rows = {(r["engine"], r["batch"]): r for r in data["rows"]}
    ours = ["ours vanilla eager", "ours vanilla compiled + graphs", "ours EAGLE k=3 eager",
            "ours EAGLE k=3 compiled + graphs"]
    hf = ["transformers generate eager", "transformers static cache + torch.compile",
          "transformers prompt lookup decoding"]
    assert set(rows) == {(e, b) for e in ours for b in (1, 2)} | {(e, 1) for e in hf}
    for (engine, batch), r in rows.items():
        assert r["tokens_per_s"] > 0 and r["ms_per_token"] > 0, (engine, batch)
        assert (r["tau"] is not None) == ("EAGLE" in engine), (engine, r["tau"])
        assert (r["propose_ms"] is not None) == ("EAGLE" in engine)
        if batch == 1:  # fp32 greedy: every engine writes our vanilla output
            assert r["identical"] == 1.0, (engine, r["identical"])
        if engine.startswith("ours"):  # per engine step: its time, and the host's GPU wait in it
            x = r["extra"]
            assert 0 < x["host_wait_ms"] < x["step_ms"], (engine, x)
            # the prompt steps apart from the decode steps: every prompt is prefilled in the
            # timed run, and the two parts add up to the steps' total
            assert x["prefill_steps"] >= 1 and x["prefill_ms"] > 0 and x["decode_step_ms"] > 0
            total = x["step_ms"] * x["steps"]
            parts = x["decode_step_ms"] * (x["steps"] - x["prefill_steps"]) + x["prefill_ms"]
            assert abs(total - parts) <= 1e-3 * x["steps"] + 1e-3 * total, (engine, x)
            pre_p50, pre_max = x["prefill_step_ms_p50_max"]
            assert 0 < pre_p50 <= pre_max <= x["prefill_ms"], (engine, x)
            p50, p90, top = x["decode_step_ms_p50_p90_max"]
            assert 0 < p50 <= p90 <= top and p50 <= x["decode_step_ms"] * 3, (engine, x)
            # the host's share: this process's CPU time over the wall (threads may add past 1)
            hc = x["host_cpu"]
            assert 0 < hc["process_cpu_per_wall"] <= 2 * hc["cpus"], hc
            assert len(hc["loadavg_1m"]) == 2 and min(hc["loadavg_1m"]) >= 0, hc
        if "compiled" in engine and engine.startswith("ours") and batch == 1:
            # Start-up split and the compile cache's hits / misses, on the first batch's row.
            split, cache = r["extra"]["startup_split_s"], r["extra"]["compile_cache"]
            assert {"load", "compile", "capture"} <= split.keys(), split
            # compile + capture by step (on the CPU no graph is captured: compile_models only)
            assert "compile_models" in r["extra"]["startup_detail_s"], r["extra"]
            assert cache["fxgraph_hit"] + cache["fxgraph_miss"] > 0, cache
        elif engine.startswith("ours"):
            assert "compile_cache" not in r["extra"], (engine, batch)
        assert engine in md
    ours_rows = [r for r in data["rows"] if r["engine"].startswith("ours")]
    assert [(r["engine"], r["batch"], r["tokens_per_s"]) for r in logged[:len(ours_rows)]] == [
        (r["engine"], r["batch"], r["tokens_per_s"]) for r in ours_rows]
    assert [p["tau"] for p in data["projection"]] == [2.0, 3.0, 4.0]
    assert data["max_tokens"] == 8 and data["num_prompts"] == 2
    assert "Projection (not a measurement)" in md

    # A later call (device calls are capped at 10 minutes) merges this run into its report and
    # scores its own rows against the merged reference outputs.
    out2 = tmp_path / "out2"
    assert main(["bench", "--model", tiny_hf_dir, "--device", "cpu", "--prompts", mt_bench_path,
                 "--num-prompts", "2", "--max-tokens", "8", "--max-model-len", "1024",
                 "--batch-sizes", "1", "--variants", "hf_eager", "--out-dir", str(out2),
                 "--merge", str(out / "benchmarks.json")]) == 0
    merged = json.loads((out2 / "benchmarks.json").read_text())
    assert len(merged["rows"]) == len(data["rows"]) + 1
    assert merged["rows"][-1]["identical"] == 1.0 and merged["projection"] == data["projection"]
    assert "merged with" in (out2 / "BENCHMARKS.md").read_text()


@pytest.mark.heavy
def test_bench_runs_draft_trees_beside_chains(tiny_hf_dir, mt_bench_path, tmp_path):
    """--trees adds a tree row per EAGLE variant: tau and the tree verify's time are
    reported, and fp32 greedy output equals vanilla's."""
    out = tmp_path / "out"
    assert main(["bench", "--model", tiny_hf_dir, "--random-draft", "--device", "cpu",
                 "--prompts", mt_bench_path, "--num-prompts", "2", "--max-tokens", "8",
                 "--max-model-len", "1024", "--batch-sizes", "1", "2", "--variants",
                 "ours_vanilla_eager", "ours_eagle_eager", "--trees", "2:4", "2:4:2", "--adaptive",
                 "--late-propose",
                 "--out-dir", str(out), "--trace-dir", str(tmp_path / "traces")]) == 0
    rows = {(r["engine"], r["batch"]): r for r in
            json.loads((out / "benchmarks.json").read_text())["rows"]}
    tree = "ours EAGLE tree topk 2, 4 tokens, depth 3 eager"
    shallow = "ours EAGLE tree topk 2, 4 tokens, depth 2 eager"  # 2:4:2, a depth of its own
    adaptive = "ours EAGLE k=3 adaptive eager"
    late = "ours EAGLE k=3 late propose eager"
    assert set(rows) == {(e, b) for e in ("ours vanilla eager", "ours EAGLE k=3 eager", tree,
                                          shallow, adaptive, late) for b in (1, 2)}
    assert len(rows[(shallow, 1)]["extra"]["acceptance_per_position"]) == 2
    assert rows[(shallow, 1)]["identical"] == 1.0
    # --late-propose: the chain with early propose off, lossless, every step said late ("off");
    # eager engines have no early graph, so their steps are late too, and say why.
    assert rows[(late, 1)]["identical"] == 1.0
    assert rows[(late, 1)]["extra"]["early_propose"]["late_reasons"].keys() == {"off"}
    assert "no_graph" in rows[("ours EAGLE k=3 eager", 1)]["extra"]["early_propose"][
        "late_reasons"]
    # --adaptive: the chain again under speculation_policy="adaptive", lossless, its choices
    # at each batch size in the row
    assert rows[(adaptive, 1)]["identical"] == 1.0
    for b in (1, 2):
        pol = rows[(adaptive, b)]["extra"]["policy"]
        assert pol["drafted_steps"] > 0, (b, pol)
    for b in (1, 2):
        r = rows[(tree, b)]
        assert r["tau"] is not None and r["tau"] >= 1.0
        assert r["verify_ms"] is not None and r["propose_ms"] is not None
        assert 0 < r["extra"]["host_wait_ms"] < r["extra"]["step_ms"], (b, r["extra"])
        # tau by depth, this row's steps alone: the rates sum to tau - 1
        pos = r["extra"]["acceptance_per_position"]
        assert len(pos) == 3 and abs(sum(pos) - (r["tau"] - 1)) < 1e-3, (b, pos, r["tau"])
    assert rows[(tree, 1)]["identical"] == 1.0
    # --trace-dir: one trace per variant, taken on the warm engine, with the tree's phases in it
    traces = {p.parent.name: p for p in (tmp_path / "traces").glob("*/*.pt.trace.json")}
    assert set(traces) == {"ours_vanilla_eager", "ours_EAGLE_k_3_eager",
                           "ours_EAGLE_tree_topk_2__4_tokens__depth_3_eager",
                           "ours_EAGLE_tree_topk_2__4_tokens__depth_2_eager",
                           "ours_EAGLE_k_3_adaptive_eager", "ours_EAGLE_k_3_late_propose_eager"}
    from compiled_spec.profile import phase_latencies
    lat = phase_latencies(str(traces["ours_EAGLE_tree_topk_2__4_tokens__depth_3_eager"]))
    assert lat["propose"]["count"] > 0 and lat["verify"]["count"] > 0
    for bad in ("8x32", "8:32:0", "8:32:4:1"):
        with pytest.raises(SystemExit):
            main(["bench", "--trees", bad])


def test_bench_temperature_samples_and_stays_lossless(tiny_hf_dir, mt_bench_path, tmp_path):
    """--temperature: our engines sample (a seed per request), and the EAGLE engine still
    writes vanilla's tokens; the report says how the rows decoded."""
    def bench(out, *extra: str) -> dict:
        assert main(["bench", "--model", tiny_hf_dir, "--random-draft", "--device", "cpu",
                     "--prompts", mt_bench_path, "--num-prompts", "2", "--max-tokens", "8",
                     "--max-model-len", "1024", "--batch-sizes", "1", "2", "--variants",
                     "ours_vanilla_eager", "ours_eagle_eager", "--out-dir", str(out),
                     *extra]) == 0
        return json.loads((out / "benchmarks.json").read_text())

    hot = bench(tmp_path / "hot", "--temperature", "0.8")
    greedy = bench(tmp_path / "greedy")
    assert hot["temperature"] == 0.8 and greedy["temperature"] == 0.0
    # sampled, not the argmax: a random model's sampled tokens are not its greedy ones
    assert hot["reference_outputs"] != greedy["reference_outputs"]
    for r in hot["rows"]:
        if r["batch"] == 1:
            assert r["identical"] == 1.0, r["engine"]
    assert "sampled at temperature 0.8" in (tmp_path / "hot" / "BENCHMARKS.md").read_text()
    with pytest.raises(SystemExit):
        main(["bench", "--temperature", "-1"])


def test_waves_refill_freed_slots_with_at_most_b_running(tiny_hf_dir, mt_bench_path, tmp_path,
                                                          monkeypatch):
    """--waves W: batch B submits W x B requests and runs at most B at once, so the batch
    stays full (a fixed batch waits for its slowest request: at 64 on the H200 an EAGLE-3
    batch ran 132 steps for requests needing 96 on average at tau 2.66)."""
    from compiled_spec import LLM, SamplingParams
    from compiled_spec.bench.ours import running_at_most
    from compiled_spec.engine.scheduler import Scheduler

    running: list[int] = []
    schedule = Scheduler.schedule

    def spy(self):
        batch = schedule(self)
        running.append(len(self.running))
        return batch
    monkeypatch.setattr(Scheduler, "schedule", spy)
    llm = LLM(model=tiny_hf_dir, device="cpu", max_model_len=256, max_num_seqs=4)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[3, 7, 1, 4], [5, 2, 9], [9, 2, 4, 4, 1], [11, 12]] * 2
    with running_at_most(llm, 2):
        outs = llm.generate(prompts, sp, use_tqdm=False)
    assert max(running) == 2 and len(outs) == 8 and all(len(o.token_ids) == 6 for o in outs)
    assert llm.engine.scheduler.cfg.max_num_seqs == 4  # restored
    running.clear()
    llm.generate(prompts, sp, use_tqdm=False)
    assert max(running) == 4

    out = tmp_path / "out"
    assert main(["bench", "--model", tiny_hf_dir, "--device", "cpu", "--prompts", mt_bench_path,
                 "--num-prompts", "2", "--max-tokens", "4", "--max-model-len", "1024",
                 "--batch-sizes", "2", "--waves", "3", "--variants", "ours_vanilla_eager",
                 "--min-admit", "2", "--out-dir", str(out)]) == 0
    (row,) = json.loads((out / "benchmarks.json").read_text())["rows"]
    assert row["extra"]["waves"] == 3 and row["extra"]["requests"] == 6, row["extra"]
    # the admission size the row ran with, and what it cost the queued requests' first tokens
    p50, p90 = row["extra"]["ttft_ms_p50_p90"]
    assert row["extra"]["min_admit"] == 2 and 0 < p50 <= p90, row["extra"]
    with pytest.raises(SystemExit):
        main(["bench", "--waves", "0"])


def test_ab_runs_each_compiled_engine_with_the_flag_off_then_on() -> None:
    from compiled_spec.bench.run import _variants

    vs = _variants(["ours_vanilla_eager", "ours_vanilla_compiled", "ours_eagle_compiled"],
                   "head", 5, trees=[(8, 32)], ab="pdl")
    assert [(v.name, v.flags) for v in vs] == [
        ("ours vanilla eager", {}),  # eager: no Inductor kernels, nothing to compare
        ("ours vanilla compiled + graphs", {"pdl": False}),
        ("ours vanilla compiled + graphs + PDL", {"pdl": True}),
        ("ours EAGLE k=5 compiled + graphs", {"pdl": False}),
        ("ours EAGLE k=5 compiled + graphs + PDL", {"pdl": True}),
        ("ours EAGLE tree topk 8, 32 tokens, depth 5 compiled + graphs", {"pdl": False}),
        ("ours EAGLE tree topk 8, 32 tokens, depth 5 compiled + graphs + PDL", {"pdl": True})]
    assert vs[6].tree == (8, 32) and vs[6].draft == "head"
    assert all(v.flags == {} for v in _variants(["ours_eagle_compiled"], "head", 5))
    skinny = _variants(["ours_eagle_compiled"], "head", 5, ab="skinny_gemm")
    assert [(v.name, v.flags) for v in skinny] == [
        ("ours EAGLE k=5 compiled + graphs", {"skinny_gemm": False}),
        ("ours EAGLE k=5 compiled + graphs + skinny GEMMs", {"skinny_gemm": True})]
    ahead = _variants(["ours_vanilla_compiled", "ours_eagle_compiled"], "head", 5,
                      trees=[(8, 32)], ab="verify_ahead")
    assert [(v.name, v.verify_ahead, v.flags) for v in ahead] == [
        ("ours vanilla compiled + graphs", False, {}),
        ("ours vanilla compiled + graphs + verify ahead", True, {}),
        ("ours EAGLE k=5 compiled + graphs", False, {}),
        ("ours EAGLE k=5 compiled + graphs + verify ahead", True, {}),
        ("ours EAGLE tree topk 8, 32 tokens, depth 5 compiled + graphs", False, {}),
        ("ours EAGLE tree topk 8, 32 tokens, depth 5 compiled + graphs + verify ahead", True,
         {})]
    # a draft-only flag: the vanilla engine once (its pair would be the same engine twice)
    draft = _variants(["ours_vanilla_compiled", "ours_eagle_compiled"], "head", 5,
                      ab="skinny_gemm_draft")
    assert [(v.name, v.flags) for v in draft] == [
        ("ours vanilla compiled + graphs", {}),
        ("ours EAGLE k=5 compiled + graphs", {"skinny_gemm_draft": False}),
        ("ours EAGLE k=5 compiled + graphs + skinny draft", {"skinny_gemm_draft": True})]
    # deferral: only the adaptive engine pauses, so only its rows pair up
    defer = _variants(["ours_vanilla_compiled", "ours_eagle_compiled"], "head", 5,
                      adaptive=True, ab="defer_paused_first_pass")
    assert [(v.name, v.defer_paused_first_pass) for v in defer] == [
        ("ours vanilla compiled + graphs", True),
        ("ours EAGLE k=5 compiled + graphs", True),
        ("ours EAGLE k=5 adaptive compiled + graphs", False),
        ("ours EAGLE k=5 adaptive compiled + graphs + deferred first pass", True)]
    # flush depth: k + 1 paused steps per flush against the default
    deep = _variants(["ours_eagle_compiled"], "head", 5, adaptive=True, ab="deep_flush")
    assert [(v.name, v.paused_flush_depth) for v in deep] == [
        ("ours EAGLE k=5 compiled + graphs", None),
        ("ours EAGLE k=5 adaptive compiled + graphs", 6),
        ("ours EAGLE k=5 adaptive compiled + graphs + deep flushes", None)]
    # losing probes: run their length (the default) against cut
    cut = _variants(["ours_eagle_compiled"], "head", 5, adaptive=True, ab="cut_probes")
    assert [(v.name, v.cut_losing_probes) for v in cut] == [
        ("ours EAGLE k=5 compiled + graphs", False),
        ("ours EAGLE k=5 adaptive compiled + graphs", False),
        ("ours EAGLE k=5 adaptive compiled + graphs + losing probes cut", True)]
    # the probe back-off (the default) against the forty-fifth session's schedule
    back = _variants(["ours_eagle_compiled"], "head", 5, adaptive=True, ab="probe_backoff")
    assert [(v.name, v.probe_backoff) for v in back] == [
        ("ours EAGLE k=5 compiled + graphs", True),
        ("ours EAGLE k=5 adaptive compiled + graphs", False),
        ("ours EAGLE k=5 adaptive compiled + graphs + probes backing off", True)]
    # a full ring's flush before the next launch against behind it (the default)
    behind = _variants(["ours_eagle_compiled"], "head", 5, adaptive=True,
                       ab="flush_behind_launch")
    assert [(v.name, v.flush_behind_launch) for v in behind] == [
        ("ours EAGLE k=5 compiled + graphs", True),
        ("ours EAGLE k=5 adaptive compiled + graphs", False),
        ("ours EAGLE k=5 adaptive compiled + graphs + flush behind launch", True)]
    with pytest.raises(SystemExit):
        main(["bench", "--ab", "fast_mode"])


def test_build_engine_takes_the_variants_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """A variant's flags override the run's (--pdl and the like), the rest stay the run's."""
    import compiled_spec
    from compiled_spec.bench.ours import Variant, build_engine

    seen = []
    monkeypatch.setattr(compiled_spec, "LLM", lambda **kw: seen.append(kw) or object())
    kw = dict(model="m", pdl=False, skinny_gemm=True, skinny_gemm_layer=True, page_size=16)
    for flags in ({}, {"pdl": False}, {"pdl": True}):
        build_engine(Variant("v", None, True, flags=flags), dict(kw), [[1, 2]], [1], 4)
    build_engine(Variant("v", None, True), dict(kw, pdl=True), [[1, 2]], [1], 4)
    build_engine(Variant("v", None, True, flags={"skinny_gemm": False}), dict(kw), [[1, 2]],
                 [1], 4)
    cfgs = [s["compile_config"] for s in seen]
    assert [c.pdl for c in cfgs] == [False, False, True, True, False]
    assert [c.skinny_gemm for c in cfgs] == [True, True, True, True, False]
    # the layer fusions ride on the skinny GEMMs: the --ab skinny_gemm "off" engine has neither
    assert [c.skinny_gemm_layer for c in cfgs] == [True, True, True, True, False]
    # a draft variant's flush depth reaches the engine only where it sets one
    seen.clear()
    for depth in (None, 6):
        build_engine(Variant("d", "head", False, policy="adaptive", paused_flush_depth=depth),
                     dict(model="m", num_speculative_tokens=5), [[1, 2]], [1], 4)
    assert ["paused_flush_depth" in s for s in seen] == [False, True]
    assert seen[1]["paused_flush_depth"] == 6
    # an adaptive variant says whether it cuts losing probes; one that drafts always does not
    seen.clear()
    for policy, cut in (("adaptive", False), ("adaptive", True), ("always", False)):
        build_engine(Variant("d", "head", False, policy=policy, cut_losing_probes=cut),
                     dict(model="m", num_speculative_tokens=5), [[1, 2]], [1], 4)
    assert [s.get("cut_losing_probes") for s in seen] == [False, True, None]
    seen.clear()
    for policy, back in (("adaptive", False), ("adaptive", True), ("always", False)):
        build_engine(Variant("d", "head", False, policy=policy, probe_backoff=back),
                     dict(model="m", num_speculative_tokens=5), [[1, 2]], [1], 4)
    assert [s.get("probe_backoff") for s in seen] == [False, True, None]
    seen.clear()
    for policy, behind in (("adaptive", False), ("adaptive", True), ("always", False)):
        build_engine(Variant("d", "head", False, policy=policy, flush_behind_launch=behind),
                     dict(model="m", num_speculative_tokens=5), [[1, 2]], [1], 4)
    assert [s.get("flush_behind_launch") for s in seen] == [False, True, None]


def test_timed_engine_reads_the_graphs_logits(tiny_hf_dir, monkeypatch) -> None:
    """The bench times the target by wrapping it: the wrapped target must still hand the
    engine its graphs' logits (``GraphedTarget.logits_for``). A bare timed function in its
    place (until the twenty-fifth session) made every benchmarked decode and verify step read
    its logits out eagerly, an lm_head GEMM and an fp32 upcast that users' engines never run."""
    from capture import CapturePolicy
    from compiled_spec import LLM
    from compiled_spec.bench.ours import Variant, time_engine
    from compiled_spec.compile import CompileConfig, capture_graphs, compile_models

    llm = LLM(model=tiny_hf_dir, device="cpu", max_model_len=128, max_num_seqs=2,
              dtype="float32")
    runner = llm.engine.runner
    llm._compiled = models = compile_models(runner, CompileConfig(inductor=False))
    policy = CapturePolicy(max_batch_size=2, num_speculative_tokens=0, max_model_len=128,
                           batch_sizes=(1, 2), seq_len_buckets=(128,))
    capture_graphs(runner, models, policy, llm.config.cache.page_size, emulate=True)
    from compiled_spec.engine.graphs import GraphedTarget

    taken: list[bool] = []
    logits_for = GraphedTarget.logits_for

    def counted(self: GraphedTarget, hidden: torch.Tensor) -> torch.Tensor | None:
        out = logits_for(self, hidden)
        taken.append(out is not None)
        return out
    monkeypatch.setattr(GraphedTarget, "logits_for", counted)  # on the class, as the method
    prompts = [[3, 7, 1, 4], [5, 2, 9]]
    rows, _ = time_engine(llm, Variant("vanilla", None, True), prompts, [1, 2], 6, 0.0)
    assert [r.batch for r in rows] == [1, 2]
    # Every decode step (warm-up runs included) took its replay's logits; prompt steps (no
    # graph here) read out eagerly.
    decode_steps = sum(r.extra["steps"] - r.extra["prefill_steps"] for r in rows)
    assert decode_steps > 0 and sum(taken) >= decode_steps, (taken, decode_steps)
    # each row says whether the target ran the fused layer, and why (gemm_policy.py)
    assert rows[0].extra["skinny_gemm"]["gemm"] is False
    assert rows[0].extra["skinny_gemm"]["why"].startswith("auto: off on cpu")


def test_read_bandwidth_times_a_streaming_read() -> None:
    # The floor's yardstick on a GPU the table does not list (profiles/scripts/graphs_h200.py);
    # on the CPU only its arithmetic: bytes read per second, finite and positive.
    from compiled_spec.bench.timing import read_bandwidth

    bw = read_bandwidth(torch.device("cpu"), nbytes=1 << 20, iters=3, warmup=1)
    assert 0 < bw < float("inf")


def test_floor_takes_a_listed_gpu_figure_else_measures_once(monkeypatch) -> None:
    """The bench's `x floor` on a GPU ``HBM_BYTES_PER_S`` does not list (an H100): the
    streaming read measured on it, once per process; the listed H200 is never measured. CPU
    only: the CUDA calls are stood in for, a cuda device object needs no GPU."""
    from compiled_spec.bench import report, timing

    reads: list[torch.device] = []
    monkeypatch.setattr(timing, "read_bandwidth", lambda dev: reads.append(dev) or 2.0e12)
    timing._measured_bandwidth.cache_clear()
    model = torch.nn.Linear(1000, 1000, bias=False)  # 4e6 bytes of fp32 weights
    gpu = torch.device("cuda", 0)
    assert timing.floor_ms(model, torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "NVIDIA H100 80GB HBM3")
    assert timing.floor_ms(model, gpu) == pytest.approx(4e6 / 2.0e12 * 1e3)
    assert timing.floor_bandwidth(gpu) == (2.0e12, "streaming read measured on NVIDIA H100 "
                                                   "80GB HBM3")
    assert reads == [gpu]  # the second and third calls reused the first measurement
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "NVIDIA H200")
    assert timing.floor_ms(model, gpu) == pytest.approx(4e6 / 4.27e12 * 1e3)
    assert reads == [gpu]
    timing._measured_bandwidth.cache_clear()
    # the report names the yardstick its x floor column used
    meta = {"floor_bandwidth": {"tb_per_s": 2.0, "source": "streaming read measured on X"}}
    assert report._floor_yardstick(meta) == "2.0 TB/s (streaming read measured on X)"
    assert report._floor_yardstick({"floor_bandwidth": None}) == "the GPU's bandwidth"


def test_adaptive_variant_carries_the_shrunk_k() -> None:
    """`bench --adaptive --adaptive-k 2 1`: the adaptive chain pausing only, then with k
    shrinking too (one process compares them); only that row's engine gets adaptive_k (the
    always-drafting chain would refuse it)."""
    from compiled_spec.bench.run import _variants

    vs = _variants(["ours_eagle_eager"], "head", 3, adaptive=True, adaptive_k=(2, 1))
    assert [(v.name, v.policy, v.adaptive_k) for v in vs] == [
        ("ours EAGLE k=3 eager", "always", ()),
        ("ours EAGLE k=3 adaptive eager", "adaptive", ()),
        ("ours EAGLE k=3 adaptive (k shrinks to 2, 1) eager", "adaptive", (2, 1))]


def test_rounds_build_each_engine_once_and_time_them_in_turn(tiny_hf_dir, mt_bench_path,
                                                              tmp_path, monkeypatch) -> None:
    """--rounds R: every engine built once, then timed in turn R times (A B A B ...); a row
    is its median round and lists every round's tokens/s. The timing wrappers come off after
    each round: stacked, a later round would pay every earlier round's timers."""
    from compiled_spec.bench import suite
    from compiled_spec.bench.ours import TimedTarget

    built, order = [], []
    build, time_engine = suite.build_engine, suite.time_engine

    def spy_build(v, *a, **k):
        built.append(v.name)
        return build(v, *a, **k)

    def spy_time(llm, v, *a, **k):
        runner = llm.engine.runner
        before = runner.target_fn
        out = time_engine(llm, v, *a, **k)
        assert runner.target_fn is before and not isinstance(runner.target_fn, TimedTarget)
        assert "propose" not in vars(runner.proposer) if runner.proposer is not None else True
        order.append(v.name)
        return out
    monkeypatch.setattr(suite, "build_engine", spy_build)
    monkeypatch.setattr(suite, "time_engine", spy_time)
    out = tmp_path / "out"
    assert main(["bench", "--model", tiny_hf_dir, "--random-draft", "--device", "cpu",
                 "--prompts", mt_bench_path, "--num-prompts", "1", "--max-tokens", "4",
                 "--max-model-len", "1024", "--batch-sizes", "1", "2", "--rounds", "3",
                 "--variants", "ours_vanilla_eager", "ours_eagle_eager",
                 "--out-dir", str(out)]) == 0
    names = ["ours vanilla eager", "ours EAGLE k=3 eager"]
    assert built == names and order == names * 3, (built, order)
    rows = json.loads((out / "benchmarks.json").read_text())["rows"]
    assert [(r["engine"], r["batch"]) for r in rows] == [(n, b) for n in names for b in (1, 2)]
    for r in rows:
        per_round = r["extra"]["rounds_tokens_per_s"]
        assert len(per_round) == 3 and round(r["tokens_per_s"], 1) == sorted(per_round)[1], r
    with pytest.raises(SystemExit):
        main(["bench", "--rounds", "0"])
