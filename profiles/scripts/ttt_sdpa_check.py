"""Issue 5 diagnosis on the GPU: does the training-time-test attention (a boolean [S, s*S] mask
through F.scaled_dot_product_attention, bf16 autocast) compute the same thing on every SDPA
backend? The shipped head's logged held-out accuracy (0.64, H200) does not reproduce on the CPU
(0.50) with the same code, so the CUDA attention path is the suspect.

python profiles/scripts/ttt_sdpa_check.py --model ~/m/model.gguf [--draft smollm2-eagle3]
Prints, per TTT step and backend, the max |logits - fp32 math reference| and the fraction of
positions whose argmax agrees with the reference.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from compiled_spec.draft.loader import load_draft  # noqa: E402
from compiled_spec.heads import resolve_draft  # noqa: E402
from compiled_spec.models.loader import load_model  # noqa: E402
from compiled_spec.train.ttt import ttt_forward  # noqa: E402


def run(draft, ids, hidden, pos, steps, backend, autocast: bool) -> list[torch.Tensor]:
    ctx = torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast)
    with torch.no_grad(), ctx:
        if backend is None:
            outs = ttt_forward(draft, ids, hidden, pos, steps)
        else:
            with sdpa_kernel([backend]):
                outs = ttt_forward(draft, ids, hidden, pos, steps)
        return [draft.compute_logits(f).float() for _, f in outs]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", default="smollm2-eagle3")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    dev = torch.device("cuda")
    target, cfg = load_model(a.model, torch.bfloat16, dev)
    draft = load_draft(resolve_draft(a.draft), target, torch.float32, dev)
    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), device=dev, generator=g)
    hidden = torch.randn(a.batch, a.seq, draft.config.hidden_size, device=dev, generator=g)
    pos = torch.arange(a.seq, device=dev).expand(a.batch, a.seq)
    ref = run(draft, ids, hidden, pos, a.steps, SDPBackend.MATH, autocast=False)
    cases = [("default", None, True), ("math", SDPBackend.MATH, True),
             ("efficient", SDPBackend.EFFICIENT_ATTENTION, True),
             ("cudnn", SDPBackend.CUDNN_ATTENTION, True), ("default_fp32", None, False)]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, batch {a.batch}, "
          f"seq {a.seq}", flush=True)
    for name, backend, ac in cases:
        try:
            got = run(draft, ids, hidden, pos, a.steps, backend, ac)
        except RuntimeError as e:  # a backend that refuses these inputs
            print(f"{name:13s} unavailable: {str(e).splitlines()[0][:100]}")
            continue
        row = []
        for s, (x, r) in enumerate(zip(got, ref), 1):
            err = (x - r).abs().max().item()
            agree = (x.argmax(-1) == r.argmax(-1)).float().mean().item()
            row.append(f"step{s} err {err:8.3f} agree {agree:.3f}")
        print(f"{name:13s} " + " | ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
