"""Benchmark output: JSON (everything), a Markdown page (the table) and a PNG (tokens/s by batch
size)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from compiled_spec.bench.timing import Row

COLUMNS = [("engine", "engine"), ("batch", "batch"), ("tokens/s", "tokens_per_s"),
           ("ms/token", "ms_per_token"), ("tau", "tau"), ("propose ms", "propose_ms"),
           ("verify ms", "verify_ms"), ("x floor", "floor_ratio"), ("peak GiB", "peak_mem_gib"),
           ("start-up s", "startup_s"), ("same output", "identical")]


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def table(rows: list[Row]) -> str:
    head = "| " + " | ".join(c for c, _ in COLUMNS) + " |"
    sep = "|" + "|".join("---" for _ in COLUMNS) + "|"
    body = ["| " + " | ".join(_fmt(getattr(r, f)) for _, f in COLUMNS) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def projection_table(proj: list[dict[str, Any]]) -> str:
    lines = ["| tau | projected tokens/s | projected ms/token | vs vanilla |", "|---|---|---|---|"]
    for p in proj:
        lines.append(f"| {p['tau']:.1f} | {p['tokens_per_s']:.1f} | {p['ms_per_token']:.3f} | "
                     f"{p['speedup']:.2f}x |")
    return "\n".join(lines)


def _decoding(meta: dict[str, Any]) -> str:
    t = meta.get("temperature") or 0.0
    return ("greedy" if not t else f"sampled at temperature {t} (seed 0 per request; "
            "transformers' rows greedy)")


def _floor_yardstick(meta: dict[str, Any]) -> str:
    fb = meta.get("floor_bandwidth")
    if not fb:
        return "the GPU's bandwidth"
    return f"{fb['tb_per_s']} TB/s ({fb['source']})"


def write_markdown(path: Path, meta: dict[str, Any], rows: list[Row],
                   shape_rows: list[Row] | None = None,
                   projection: list[dict[str, Any]] | None = None) -> None:
    m = meta
    parts = [
        "# Benchmarks",
        "",
        f"Written by `{m['command']}` on {m['date']}.",
        "",
        f"Machine: {m['machine']}; torch {m['torch']}, transformers {m['transformers']}, "
        f"triton {m.get('triton') or '-'}; {m['dtype']}.",
        f"Prompts: {m['num_prompts']} MT-bench first turns with the chat template, "
        f"{_decoding(m)}, "
        f"{m['max_tokens']} new tokens each (EOS ignored, so every engine writes the same "
        "count). Batch 1 runs the prompts one at a time; batch b submits b prompts at once.",
        "",
        "Columns: tokens/s = output tokens / wall time; ms/token = per request, decode time / "
        "(tokens - 1), median; tau = mean acceptance length; propose / verify ms = mean per "
        "call (CUDA events); x floor = ms/token over the time to read every weight once at "
        f"{_floor_yardstick(m)} (batch 1); peak GiB = peak allocated GPU memory (our KV pool "
        "is sized to the run); same output = fraction of prompts whose output equals our "
        "vanilla eager output at batch 1 (bf16 paths round differently, so below 1.0 is "
        "expected there; fp32 identity is what the test suite checks).",
        "",
        table(rows),
        "",
    ]
    if shape_rows:
        parts += [f"## {m['shape_label']} (random weights: latency only)", "",
                  "Step costs measured on random weights. A random head accepts almost nothing, "
                  "so tau is not measured here; the rows below are a projection of what a head "
                  "reaching the given tau would give: tokens/s = tau / (verify + propose).",
                  "", table(shape_rows), ""]
        if projection:
            parts += ["Projection (not a measurement):", "", projection_table(projection), ""]
    path.write_text("\n".join(parts))


def write_json(path: Path, meta: dict[str, Any], rows: list[Row],
               shape_rows: list[Row] | None, projection: list[dict[str, Any]] | None) -> None:
    path.write_text(json.dumps({**meta, "rows": [r.as_dict() for r in rows],
                                "shape_rows": [r.as_dict() for r in shape_rows or []],
                                "projection": projection or []}, indent=2, default=str))


def plot(path: Path, rows: list[Row], title: str) -> Path | None:
    """tokens/s against batch size: one line per engine of ours, HF engines as batch-1 points."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r.engine for r in rows):
        pts = sorted((r.batch, r.tokens_per_s) for r in rows if r.engine == name)
        ax.plot([b for b, _ in pts], [t for _, t in pts], "o-" if len(pts) > 1 else "s",
                label=name)
    ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="output tokens/s",
           title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
