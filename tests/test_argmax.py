"""``spec.argmax.rowwise_argmax`` against ``torch.argmax``: exact indices, ties to the first,
NaN and -inf rows as there, eager and through Inductor. ``python tests/test_argmax.py --cuda``
runs the same checks on a GPU (the device script's setup0)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compiled_spec.spec.argmax import rowwise_argmax  # noqa: E402

VOCABS = (32768, 49152, 5000, 2048)  # draft vocab, SmolLM2's, not a chunk multiple, unsplit


def _cases(device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for v in VOCABS:
        # integers in [-3, 3): every row has its maximum many times over
        out[f"ties_{v}"] = torch.randint(-3, 3, (7, v), generator=g).float()
        x = torch.randn(7, v, generator=g).bfloat16()
        out[f"bf16_{v}"] = x.clone()
        x[2, 3001 % v] = x[2, 4003 % v] = float("nan")
        out[f"nan_{v}"] = x
        out[f"ninf_{v}"] = torch.full((3, v), float("-inf"))
        y = torch.randn(4, v, generator=g)
        y[:, -1] = 100.0  # the maximum in the padded last chunk
        out[f"last_{v}"] = y
    return {k: t.to(device) for k, t in out.items()}


def check(device: str) -> dict[str, bool]:
    compiled = torch.compile(rowwise_argmax, dynamic=False)
    res = {}
    for name, x in _cases(device).items():
        want = x.argmax(-1)
        res[name] = torch.equal(rowwise_argmax(x), want)
        res[name + "_compiled"] = torch.equal(compiled(x), want)
    return res


@pytest.mark.parametrize("vocab", VOCABS)
def test_rowwise_argmax_equals_argmax(vocab: int) -> None:
    res = {k: ok for k, ok in check("cpu").items() if k.endswith(f"_{vocab}")
           or k.endswith(f"_{vocab}_compiled")}
    assert len(res) == 10 and all(res.values()), res


def test_the_maximum_in_a_later_chunk() -> None:
    """The split is real (the checks above would pass trivially otherwise): a row whose
    maximum sits in a later chunk, and the chunk sizes the pick uses."""
    x = torch.zeros(1, 4096)
    x[0, 3000] = 1.0
    vals, idx = x.view(1, 4, 1024).max(-1)
    assert vals.argmax().item() == 2 and rowwise_argmax(x).item() == 3000


if __name__ == "__main__" and "--cuda" in sys.argv:
    r = check("cuda")
    print("RESULTS " + json.dumps(r))
    bad = [k for k, ok in r.items() if not ok]
    print("all equal" if not bad else f"MISMATCH: {bad}")
