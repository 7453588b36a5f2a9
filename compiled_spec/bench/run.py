"""``compiled-spec bench``: every engine on the same prompts in one process, then the reports."""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from compiled_spec.bench import hf, report
from compiled_spec.bench.ours import Variant
from compiled_spec.bench.suite import bench_ours
from compiled_spec.bench.prompts import encode_chat, load_mt_bench
from compiled_spec.bench.timing import Row, floor_bandwidth
from compiled_spec.engine_args import compile_flags

OURS = ("ours_vanilla_eager", "ours_vanilla_compiled", "ours_eagle_eager", "ours_eagle_compiled")
ALL_VARIANTS = (*hf.KINDS, *OURS)
PROJECTED_TAUS = (2.0, 3.0, 4.0)
# What `--ab` can compare, with the label of their "on" rows: CompileConfig flags, and the
# engine options of AB_ENGINE
AB_FLAGS = {"pdl": "PDL", "skinny_gemm": "skinny GEMMs", "autotune_gemm": "GEMM autotuning",
            "verify_ahead": "verify ahead", "size_oblivious": "size-oblivious",
            "skinny_gemm_draft": "skinny draft", "skinny_gemm_wide": "wide skinny GEMMs",
            "skinny_gemm_readout": "skinny lm_head",
            "defer_paused_first_pass": "deferred first pass", "pdl_narrow": "PDL on narrow calls",
            "deep_flush": "deep flushes", "cut_probes": "losing probes cut",
            "probe_backoff": "probes backing off", "flush_behind_launch": "flush behind launch",
            "early_prompt_head": "early prompt heads", "sample_graphs": "sample graphs",
            "sample_compile": "compiled draws"}
AB_ENGINE = ("verify_ahead", "defer_paused_first_pass", "probe_backoff", "flush_behind_launch",
             "early_prompt_head")
# Flags that change only a draft's engine: a vanilla engine runs once, not twice the same
# (pdl_narrow: a vanilla engine's widest call, max_num_seqs rows, is narrow up to batch 64);
# likewise an engine that never pauses
AB_DRAFT_ONLY = ("skinny_gemm_draft", "pdl_narrow", "early_prompt_head")
AB_ADAPTIVE_ONLY = ("defer_paused_first_pass", "deep_flush", "cut_probes", "probe_backoff",
                    "flush_behind_launch")
LLAMA8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
           "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
           "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
           "bos_token_id": 128000, "eos_token_id": 128009}
TINY = dict(LLAMA8B, vocab_size=49152, hidden_size=64, intermediate_size=128,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=4096, rope_scaling=None, bos_token_id=1, eos_token_id=2)
# SmolLM2-135M-Instruct's shape (the GGUF's metadata), for random-weight runs
SMOLLM2 = dict(LLAMA8B, vocab_size=49152, hidden_size=576, intermediate_size=1536,
               num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
               max_position_embeddings=8192, rope_theta=100000.0, rope_scaling=None,
               tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def _variants(names: list[str], draft: str | None, k: int,
              trees: list[tuple[int, ...]] = (), adaptive: bool = False,
              late_propose: bool = False, ab: str | None = None,
              adaptive_k: tuple[int, ...] = ()) -> list[Variant]:
    """Our engines to run; each EAGLE variant also runs once per draft tree of ``trees``
    ((topk, tokens[, depth]): EAGLE-2 trees of that depth, else k), with ``adaptive`` once
    more as a chain under speculation_policy="adaptive" (and once more with k shrinking to
    ``adaptive_k``, if given), and with ``late_propose`` once more as a chain whose proposals
    all launch after the acceptance is read (early_propose=False), in the same compile mode.
    With ``ab`` (a key of ``AB_FLAGS``) every compiled engine runs twice in a row, with the
    flag off and on (rows named "+ <label>"): an A/B in one process on one GPU, where two
    device calls differ by more than the effects measured (vanilla 771-871 tok/s between
    sessions)."""
    out = []
    for n in names:
        if n not in OURS:
            continue
        spec = "eagle" in n
        if spec and draft is None:
            raise ValueError(f"variant {n} needs a draft head (--draft, or --random-draft)")
        mode = " compiled + graphs" if n.endswith("compiled") else " eager"
        label = (f"ours EAGLE k={k}" if spec else "ours vanilla") + mode
        out.append(Variant(label, draft if spec else None, n.endswith("compiled")))
        if spec and late_propose:
            out.append(Variant(f"ours EAGLE k={k} late propose" + mode, draft,
                               n.endswith("compiled"), early_propose=False))
        if spec and adaptive:  # with adaptive_k: pausing alone, then k shrinking too
            for ks in ((), adaptive_k) if adaptive_k else ((),):
                shrinks = f" (k shrinks to {', '.join(map(str, ks))})" if ks else ""
                out.append(Variant(f"ours EAGLE k={k} adaptive{shrinks}" + mode, draft,
                                   n.endswith("compiled"), policy="adaptive", adaptive_k=ks))
        for topk, tokens, *depth in trees if spec else ():
            d = depth[0] if depth else None  # (None too: the run's k)
            out.append(Variant(f"ours EAGLE tree topk {topk}, {tokens} tokens, depth {d or k}"
                               + mode, draft, n.endswith("compiled"), (topk, tokens),
                               tree_depth=d))
    if ab is not None:
        if ab == "deep_flush":  # a flush per k + 1 paused steps (forty-first session) vs default
            off, on = {"paused_flush_depth": k + 1}, {"paused_flush_depth": None}
        elif ab == "cut_probes":  # probes of drafting run their length (forty-third session)
            off, on = {"cut_losing_probes": False}, {"cut_losing_probes": True}
        else:
            off, on = (({ab: False}, {ab: True}) if ab in AB_ENGINE
                       else ({"flags": {ab: False}}, {"flags": {ab: True}}))
        out = [w for v in out for w in (
            [replace(v, **off), replace(v, name=f"{v.name} + {AB_FLAGS[ab]}", **on)]
            if v.compile and (v.draft is not None or ab not in AB_DRAFT_ONLY)
            and (v.policy == "adaptive" or ab not in AB_ADAPTIVE_ONLY) else [v])]
    return out


def _tree_spec(text: str) -> tuple[int, int, int | None]:
    """TOPK:TOKENS[:DEPTH] -> (topk, tokens, depth or None: the run's -k)."""
    try:
        parts = [int(x) for x in text.split(":")]
        if len(parts) not in (2, 3) or min(parts) < 1:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"--trees {text!r}: expected TOPK:TOKENS[:DEPTH] of "
                                         "positive integers, e.g. 8:32 or 4:16:4") from None
    return parts[0], parts[1], (parts[2] if len(parts) == 3 else None)


def _random_shape(cfg: dict[str, Any], tmp: Path) -> tuple[str, str]:
    """A ``random:`` target of config ``cfg`` and a random EAGLE-3 head of its shape."""
    from compiled_spec.draft.testing import write_eagle3_head
    from compiled_spec.models.config import ModelConfig

    (tmp / "target").mkdir(parents=True, exist_ok=True)
    (tmp / "target" / "config.json").write_text(json.dumps(cfg))
    n = cfg["num_hidden_layers"]
    head = write_eagle3_head(str(tmp / "head"), ModelConfig.from_hf_dict(cfg),
                             draft_vocab_size=min(32000, cfg["vocab_size"]),
                             aux_layer_ids=(2, n // 2, n - 3))
    return f"random:{tmp / 'target'}", head


def _projection(vanilla: Row, spec: Row) -> list[dict[str, Any]]:
    if spec.verify_ms is None or spec.propose_ms is None:
        return []
    step = spec.verify_ms + spec.propose_ms  # one drafting step emits tau tokens on average
    return [{"tau": t, "ms_per_token": step / t, "tokens_per_s": 1e3 * t / step,
             "speedup": vanilla.ms_per_token / (step / t)} for t in PROJECTED_TAUS]


def run_bench(a: argparse.Namespace) -> int:
    from compiled_spec.config import resolve_device, resolve_dtype
    from compiled_spec.models.gguf_loader import find_default_gguf
    from compiled_spec.tokenizer import load_tokenizer

    device = resolve_device(a.device)
    dtype = resolve_dtype(a.dtype, device)
    names = list(ALL_VARIANTS) if a.variants is None else a.variants
    unknown = sorted(set(names) - set(ALL_VARIANTS))
    if unknown:
        raise ValueError(f"unknown variants {unknown}; choose from {list(ALL_VARIANTS)}")
    model = a.model or find_default_gguf()
    tmp = Path(tempfile.mkdtemp(prefix="bench_"))
    draft = a.draft
    if draft is None and a.random_draft:
        from compiled_spec.draft.testing import write_eagle3_head
        from compiled_spec.models.loader import read_model_config

        cfg = read_model_config(model)  # the head's shape needs the config, not the weights

        draft = write_eagle3_head(str(tmp / "random_head"), cfg,
                                  draft_vocab_size=min(8192, cfg.vocab_size))
    elif draft is None and a.model is None:
        draft = "smollm2-eagle3"  # the head shipped for the default target
    k = a.num_speculative_tokens
    texts = load_mt_bench(a.prompts, a.num_prompts)
    kw = dict(model=model, tokenizer=a.tokenizer, dtype=a.dtype, device=device,
              max_model_len=a.max_model_len, page_size=a.page_size, method=a.method,
              num_speculative_tokens=k, draft_sampling=a.draft_sampling,
              min_admit=getattr(a, "min_admit", None), **compile_flags(a))
    batch_sizes = sorted(set(a.batch_sizes))

    merged = [json.loads(Path(p).read_text()) for p in a.merge or []]
    # Chat-encoded once; every engine (ours and transformers) gets the same ids.
    prompts = encode_chat(load_tokenizer(a.tokenizer or model), texts)
    variants = _variants(names, draft, k, a.trees, a.adaptive, getattr(a, "late_propose", False),
                         getattr(a, "ab", None), tuple(getattr(a, "adaptive_k", ())))
    rows, outs = bench_ours(variants, kw, prompts, batch_sizes, a.max_tokens,
                            Path(a.trace_dir) if a.trace_dir else None, waves=a.waves,
                            rounds=getattr(a, "rounds", 1),
                            temperature=getattr(a, "temperature", 0.0))
    # The reference for "same output": our vanilla eager batch-1 outputs, from this run or a
    # merged one (a device call is capped at 10 minutes, so a full run spans several calls).
    ref = outs.get("ours vanilla eager") or next(
        (m["reference_outputs"] for m in merged if m.get("reference_outputs")), None)
    for r in rows:
        if r.batch == 1 and ref is not None:
            r.identical = _same(outs[r.engine], ref)
    for kind in (n for n in names if n in hf.KINDS):
        row, hf_out = hf.bench_hf(kind, model, dtype, device, prompts, a.max_tokens,
                                  a.prompt_lookup_tokens)
        # (transformers' rows decode greedily: with --temperature there is nothing to compare)
        row.identical = (_same(hf_out, ref) if ref is not None and not a.temperature
                         else None)
        rows.append(row)
        print(f"{row.engine}: {row.tokens_per_s:.1f} tok/s", flush=True)

    shape_rows, projection = None, None
    if a.shape:
        cfg = LLAMA8B if a.shape == "llama8b" else TINY
        target, head = _random_shape(cfg, tmp / a.shape)
        skw = dict(kw, model=target, tokenizer=a.tokenizer or model)
        shape_rows, _ = bench_ours(
            [Variant("vanilla compiled + graphs", None, True),
             Variant(f"EAGLE-3 k={k} compiled + graphs (random head)", head, True)]
            if device.type == "cuda" else
            [Variant("vanilla eager", None, False),
             Variant(f"EAGLE-3 k={k} eager (random head)", head, False)],
            skw, prompts[:a.shape_prompts], [1], a.shape_max_tokens)
        projection = _projection(shape_rows[0], shape_rows[1])

    meta = {"date": time.strftime("%Y-%m-%d"), "command": "compiled-spec " + " ".join(sys.argv[1:]),
            "machine": (torch.cuda.get_device_name(device) if device.type == "cuda" else
                        f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"),
            "torch": torch.__version__, "transformers": _version("transformers"),
            "triton": _version("triton"), "dtype": str(dtype).replace("torch.", ""),
            "num_prompts": len(texts), "max_tokens": a.max_tokens, "model": str(model),
            "temperature": getattr(a, "temperature", 0.0),
            "draft": draft, "k": k, "shape_label": {"llama8b": "Llama-3.1-8B shape",
                                                    "tiny": "tiny Llama shape"}.get(a.shape)}
    meta["reference_outputs"] = ref
    fb = floor_bandwidth(device) if any(r.floor_ratio for r in rows) else None
    meta["floor_bandwidth"] = None if fb is None else {"tb_per_s": round(fb[0] / 1e12, 3),
                                                       "source": fb[1]}
    for prev in merged:  # rows of earlier runs, first
        rows = [Row(**r) for r in prev["rows"]] + rows
        if prev.get("shape_rows") and not shape_rows:
            shape_rows = [Row(**r) for r in prev["shape_rows"]]
            projection = prev.get("projection")
            meta["shape_label"] = prev.get("shape_label")
        meta["command"] += f"  (merged with: {prev['command']})"
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report.write_json(out / "benchmarks.json", meta, rows, shape_rows, projection)
    report.write_markdown(out / "BENCHMARKS.md", meta, rows, shape_rows, projection)
    report.plot(out / "benchmarks.png", rows, f"{meta['machine']}, {meta['dtype']}")
    print()
    print(report.table(rows))
    if shape_rows:
        print()
        print(report.table(shape_rows))
    print(f"\nwrote {out / 'BENCHMARKS.md'}, benchmarks.json, benchmarks.png")
    return 0


def _same(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b)) / max(1, len(b))


def _version(pkg: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


def _positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a positive integer")
    return n


def _non_negative(text: str) -> float:
    x = float(text)
    if not x >= 0:  # (NaN too)
        raise argparse.ArgumentTypeError(f"{text!r}: must be a number >= 0")
    return x


def add_bench_args(b: argparse.ArgumentParser) -> None:
    b.add_argument("--variants", nargs="*", default=None, metavar="NAME",
                   help=f"subset of {', '.join(ALL_VARIANTS)} (default: all)")
    b.add_argument("--trees", type=_tree_spec, nargs="+", default=[],
                   metavar="TOPK:TOKENS[:DEPTH]",
                   help="also run each EAGLE variant with these draft trees (TOKENS verified "
                   "per request, root included; DEPTH defaults to --num-speculative-tokens, so "
                   "4:16:4 beside -k 5 sets a depth-4 tree against the k=5 chain)")
    b.add_argument("--adaptive", action="store_true",
                   help="also run each EAGLE chain with speculation_policy='adaptive' (drafting "
                   "pauses where plain decoding measures faster)")
    b.add_argument("--late-propose", action="store_true",
                   help="also run each EAGLE chain with early_propose=False (every proposal "
                   "launched after the host reads the step's acceptance), to compare")
    b.add_argument("--ab", choices=sorted(AB_FLAGS), default=None,
                   help="run every compiled engine of ours twice in a row, with this compile "
                   "option off, then on (rows named '+ ...'), to compare in one process")
    b.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64],
                   help="batch sizes for our engines (transformers runs batch 1)")
    b.add_argument("--waves", type=_positive_int, default=1, metavar="W",
                   help="at batch B > 1, submit W x B requests with at most B running: a slot "
                   "freed is refilled, as in serving. With 1 (a fixed batch) the slowest "
                   "request sets the wall time, which charges speculation's per-request "
                   "spread in acceptance to its throughput")
    b.add_argument("--rounds", type=_positive_int, default=1, metavar="R",
                   help="build every engine first, then time them in turn R times (A B A B "
                   "...); each row is its median round, every round's tokens/s in its json. "
                   "The host's speed drifts within a process: one pass per engine charges "
                   "the drift to whichever engine ran then")
    b.add_argument("--temperature", type=_non_negative, default=0.0,
                   help="our engines sample at this temperature (seed 0 per request; 0: greedy). "
                   "Speculation is lossless: every engine of ours still writes vanilla's tokens. "
                   "transformers' rows stay greedy")
    b.add_argument("--tokenizer", default=None)
    b.add_argument("--random-draft", action="store_true",
                   help="speculate with a random EAGLE-3 head of the target's shape (tau ~ 1)")
    b.add_argument("--prompt-lookup-tokens", type=int, default=10)
    b.add_argument("--shape", choices=["llama8b", "tiny"], default=None,
                   help="also time a random-weight target of this shape (latency, projection)")
    b.add_argument("--shape-prompts", type=int, default=4)
    b.add_argument("--shape-max-tokens", type=int, default=64)
    b.add_argument("--out-dir", default="profiles", help="BENCHMARKS.md, benchmarks.json/.png")
    b.add_argument("--trace-dir", default=None, metavar="DIR",
                   help="after timing, a profiler trace (TensorBoard) of one batch of requests "
                   "(the first --batch-sizes value) per variant of ours, on its warm engine, "
                   "with a kernel table printed")
    b.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="benchmarks.json files of earlier runs to include in this report")
