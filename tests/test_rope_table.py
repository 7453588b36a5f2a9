"""The rope table op (``compiled_spec::rope_table``): a step's cos / sin rows are one buffer each
in the Inductor-compiled target, read by every layer. Gathered inline, Inductor copied them for
each layer's rope op (it copies an unrealized input for every op that takes it): two
[T, head_dim] buffers per layer in the CPU wrapper code, 10 gather kernels in SmolLM2's decode
call on the H200. With the op the wrapper allocates no such buffer, calls the op once, and the
compiled target returns exactly the eager model's logits."""
from __future__ import annotations

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from compiled_spec.models.layers import RotaryEmbedding
from passes import make_backend
from tests.test_passes import TABLE_A, make_meta
from tests.test_skinny_gemm_pass import LAYERS, tiny_lm

HEAD_DIM = 8  # tiny_lm's; no other activation of the graph is that wide


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield


def test_rope_rows_are_one_buffer_for_every_layer() -> None:
    assert LAYERS >= 2  # what would be copied is one copy per layer
    model = tiny_lm(torch.float32)
    backend = make_backend(hoist_fc=False, per_layer_metadata=False, inductor=True)
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    meta = make_meta([3, 2], [4, 0], TABLE_A)
    ids, pos = torch.randint(0, 64, (5,)), torch.tensor([4, 5, 6, 0, 1])
    with torch.no_grad(), torch._dynamo.config.patch(specialize_float=True):
        want = model(ids, pos, meta)
        got, codes = run_and_get_code(compiled, ids, pos, meta)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    code = "\n".join(codes)
    assert code.count("torch.ops.compiled_spec.rope_table.default(") == 1, code
    assert code.count("torch.ops.compiled_spec.rope_write_kv.default(") == LAYERS
    # no [T, head_dim] buffer besides the op's two outputs (before: two per layer)
    assert re.findall(rf"empty_strided_cpu\(\(s\d+, {HEAD_DIM}\)", code) == [], code


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_equals_the_inline_gather(dtype: torch.dtype) -> None:
    rope = RotaryEmbedding(16, 40, 10000.0, None)
    pos = torch.tensor([0, 39, 7, 7, 12])
    cos, sin = rope(pos, dtype)
    assert cos.dtype == sin.dtype == dtype and cos.shape == (5, 16)
    assert torch.equal(cos, rope.cos_cache[pos].to(dtype))
    assert torch.equal(sin, rope.sin_cache[pos].to(dtype))
