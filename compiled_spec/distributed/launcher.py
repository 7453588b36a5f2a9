"""``LLM(tensor_parallel_size=N)`` from a plain Python process: N worker processes, one per rank
(one GPU each, or CPU threads over gloo), each running the whole engine on its shard (SPMD).

Every rank gets the same requests in the same order, so each rank's scheduler makes the same
decisions; activations and logits are bit-identical across ranks after each all-reduce /
all-gather, and sampling is a counter-based hash of (seed, position), so every rank accepts the
same drafts and writes the same tokens without any extra broadcast. Rank 0's results are
returned; the other ranks' are compared with them (a disagreement would be a bug, and raises).
Under torchrun (torch.distributed already initialised) no processes are launched: each rank's
``LLM`` is one shard of the SPMD program.

The launcher is handed the class each worker builds (``factory``, pickled by reference), so it
does not import ``llm.py``, which imports it.
"""
from __future__ import annotations

import atexit
import os
import tempfile
import traceback
from typing import Any, Callable


def _worker_main(rank: int, world: int, init_file: str, factory: Callable[..., Any],
                 kwargs: dict[str, Any], conn) -> None:
    import torch
    import torch.distributed as dist

    try:
        on_gpu = str(kwargs.get("device") or "").startswith("cuda")
        if on_gpu:
            torch.cuda.set_device(rank)
            kwargs = dict(kwargs, device=f"cuda:{rank}")
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"file://{init_file}",
                                rank=rank, world_size=world)
        llm = factory(**kwargs)
        conn.send(("ok", None))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        method, args, kw = conn.recv()
        if method == "shutdown":
            break
        try:
            if method == "attr":  # a property / attribute of rank 0's LLM (config, stats, ...)
                result = getattr(llm, args[0])
            else:
                result = getattr(llm, method)(*args, **kw)
            conn.send(("ok", result))
        except Exception:
            conn.send(("error", traceback.format_exc()))
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()
    conn.close()
    # Interpreter teardown after gloo has run aborts now and then (a C++ thread destroyed while
    # joinable, after destroy_process_group returned); everything is sent, so skip it.
    os._exit(0)


class TPLauncher:
    def __init__(self, world: int, kwargs: dict[str, Any], factory: Callable[..., Any]) -> None:
        """``world`` worker processes, each running ``factory(**kwargs)`` (the ``LLM`` class: it
        must be picklable, i.e. importable by name in a spawned process) on its rank."""
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        fd, self._init_file = tempfile.mkstemp(prefix="compiled_spec_tp_")
        os.close(fd)
        os.unlink(self._init_file)  # the file store creates it
        self.conns, self.procs = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(rank, world, self._init_file, factory,
                                                       kwargs, child), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        self._gather("starting the tensor-parallel workers")
        atexit.register(self.close)

    def _gather(self, what: str) -> list[Any]:
        replies = [c.recv() for c in self.conns]
        errors = [f"rank {r}:\n{msg}" for r, (kind, msg) in enumerate(replies) if kind == "error"]
        if errors:
            raise RuntimeError(f"{what} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
        return [msg for _, msg in replies]

    def call(self, method: str, *args: Any, **kw: Any) -> Any:
        for c in self.conns:
            c.send((method, args, kw))
        results = self._gather(f"{method}()")
        if method == "generate":  # lockstep check: every rank wrote the same tokens
            ref = [o.token_ids for o in results[0]]
            for r, res in enumerate(results[1:], 1):
                if [o.token_ids for o in res] != ref:
                    raise RuntimeError(f"tensor-parallel rank {r} produced different tokens "
                                       "than rank 0 (ranks must stay in lockstep)")
        return results[0]

    def close(self) -> None:
        for c, p in zip(self.conns, self.procs):
            if p.is_alive():
                try:
                    c.send(("shutdown", (), {}))
                except (BrokenPipeError, OSError):
                    pass
        for p in self.procs:
            p.join(timeout=30)
        self.procs = []
