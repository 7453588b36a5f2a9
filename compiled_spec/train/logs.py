"""The trainer's log (``train_log.jsonl``: one row per logging interval, validation figures on the
rows where they were measured) and its PNG curves."""
from __future__ import annotations

import json
from pathlib import Path

LOG_FILE = "train_log.jsonl"


def truncate_log(path: Path, step: int) -> None:
    """Drop rows logged after the checkpoint we resume from (they will be re-run)."""
    if not path.exists():
        return
    rows = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(r + "\n" for r in rows))


def read_log(out: str | Path) -> list[dict]:
    path = Path(out) / LOG_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_curves(out: Path) -> Path | None:
    """Loss and per-step accuracy curves as a PNG, when matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = read_log(out)
    if not rows:
        return None
    steps = [r["step"] for r in rows]
    val = [r for r in rows if "val_loss" in r]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(steps, [r["loss"] for r in rows], label="train")
    if val:
        a.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="held out")
        a.legend()
    a.set(xlabel="step", ylabel="TTT loss", yscale="log")
    for i in range(len(rows[0]["acc"])):
        line, = b.plot(steps, [r["acc"][i] for r in rows], label=f"step {i + 1}")
        if val:
            b.plot([r["step"] for r in val], [r["val_acc"][i] for r in val], "o--",
                   color=line.get_color())
    b.set(xlabel="step", ylabel="top-1 accuracy (dashed: held out)", ylim=(0, 1))
    b.legend()
    fig.tight_layout()
    path = out / "train_curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
