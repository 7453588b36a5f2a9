"""``compiled_spec.compile_guard``: a shape whose compile failed raises once (where it failed:
a capture records it, a step's fault path recovers it), then runs eagerly, counted in the
compile stats, without compiling again; shapes that compiled stay compiled."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch._dynamo.exc import BackendCompilerFailed

from compiled_spec.compile import CompileConfig, CompiledModels, compile_callable
from compiled_spec.compile_guard import shape_key


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield


def _scale(x: torch.Tensor) -> torch.Tensor:  # [B, 4]
    return x * 2 + 1


def test_failed_shape_runs_eagerly_and_is_counted() -> None:
    compiles = []

    def backend(gm, example_inputs):  # fails for every batch but 1 (specialised there)
        compiles.append([tuple(x.shape) for x in example_inputs if isinstance(x, torch.Tensor)])
        assert all(x.shape[0] == 1 for x in example_inputs if isinstance(x, torch.Tensor))
        return gm.forward

    # 0/1 specialization on, so batch 1 is a graph of its own (the default keeps it symbolic)
    f = compile_callable(_scale, backend, CompileConfig(size_oblivious=False))
    one = torch.ones(1, 4)
    assert torch.equal(f(one), _scale(one)) and len(compiles) == 1  # B = 1: compiled
    three = torch.arange(12.0).view(3, 4)
    with pytest.raises(BackendCompilerFailed):  # the first call of the shape raises
        f(three)
    n = len(compiles)
    assert torch.equal(f(three), _scale(three))  # then eagerly, no compile attempted
    assert torch.equal(f(three), _scale(three)) and len(compiles) == n
    assert torch.equal(f(one), _scale(one))  # the compiled shape is untouched
    five = torch.ones(5, 4)  # another failing shape: raises once too, then eager
    with pytest.raises(BackendCompilerFailed):
        f(five)
    assert torch.equal(f(five), _scale(five))
    st = f.guard.stats()
    assert st["failed_shapes"] == 2 and st["eager_calls"] == 3
    assert len(st["errors"]) == 2 and all(
        "AssertionError" in e and "test_compile_guard.py" in e and "TORCHDYNAMO" not in e
        for e in st["errors"])
    stats = CompiledModels(eager={}, compiled={"scale": f, "other": _scale}).stats()
    assert stats["compile_failures"] == {"scale": st}
    assert "compile_failures" not in CompiledModels(eager={}, compiled={}).stats()


def test_size_one_shares_the_general_graph_by_default() -> None:
    """CompileConfig.size_oblivious: batch 1 and batch 3 run one graph (a second compile of the
    whole target at start-up otherwise); with it off, batch 1 is specialised."""
    for oblivious, graphs in ((True, 1), (False, 2)):
        torch._dynamo.reset()
        seen = []
        f = compile_callable(_scale, lambda gm, ex: seen.append(gm) or gm.forward,
                             CompileConfig(size_oblivious=oblivious))
        for b in (1, 3, 1, 5):
            x = torch.arange(4.0 * b).view(b, 4)
            assert torch.equal(f(x), _scale(x))
        assert len(seen) == graphs, (oblivious, len(seen))


def test_runtime_errors_are_not_remembered() -> None:
    """Only compile failures: an error of the computation itself raises every time."""
    f = compile_callable(lambda x: x.view(5), lambda gm, ex: gm.forward, CompileConfig())
    for _ in range(2):
        with pytest.raises(Exception, match="view|shape"):
            f(torch.ones(3))
    assert f.guard.failures == {} and f.guard.eager_calls == 0


@dataclass
class _Meta:
    lens: torch.Tensor
    max_len: int


def test_shape_key_reads_sizes_scalars_and_dataclass_fields() -> None:
    a = shape_key((torch.ones(2, 3), 5, _Meta(torch.ones(2), 16)), {"k": [torch.ones(4)]})
    assert a == ((2, 3), 5, ((2,), 16), ((4,),))
    assert shape_key((torch.ones(2, 3), 5, _Meta(torch.ones(2), 32)), {"k": [torch.ones(4)]}) != a
    assert shape_key((torch.zeros(2, 3), 5, _Meta(torch.zeros(2), 16)),
                     {"k": [torch.zeros(4)]}) == a  # values do not matter, sizes do
