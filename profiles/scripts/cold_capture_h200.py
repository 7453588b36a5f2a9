"""Issue 16: what each step of a cold start compiles. The twenty-eighth session's cold starts
on the H200 spent 0.5-1.0 s in each prefill size's capture (0.05 s warm): this says which
binaries those seconds built.

Runs a start-up script in this process (``graphs_h200.py --startup-only`` for the 8B shape, or
``-m compiled_spec.cli bench ...``) with three probes:
- every component's capture (``GraphRegistry.capture_all``) and the attention warm-up
  (``kernels.warmup.warm_model_attention``) timed, with the Triton binaries that appeared in
  ``TRITON_CACHE_DIR`` meanwhile (``*.cubin`` names: compiled here, in Inductor's compile
  workers or in the attention warm-up's workers);
- Triton's JIT hook: our own kernels compiled (or loaded from disk) in this process;
- Inductor's run-time autotuning (``CachingAutotuner.benchmark_all_configs``): kernels
  benchmarked over several configs at their first launch, and the seconds that took.

    TRITON_CACHE_DIR=/tmp/tc COMPILED_SPEC_CACHE_DIR=/tmp/cc python \\
        profiles/scripts/cold_capture_h200.py profiles/scripts/graphs_h200.py --shape llama8b \\
        --startup-only --tokenizer ~/m/model.gguf --out /tmp/8b.json
    ... cold_capture_h200.py -m compiled_spec.cli bench --model ~/m/model.gguf ...

Prints one ``STEP`` line per step and a summary; TRITON_CACHE_DIR must be set (and empty for
a cold start).
"""
from __future__ import annotations

import collections
import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

JIT: list[str] = []
REPRS: list[tuple[str, str]] = []  # (kernel, spec_repr)
AUTOTUNE: list[tuple[str, float]] = []


def cubins(root: Path) -> set[str]:
    return {str(p) for p in root.rglob("*.cubin")} if root.is_dir() else set()


def spec_repr(compile: dict[str, Any]) -> str:
    """One binary's specialisation as "; "-joined items: constexpr values (c:), argument types
    (s:) and attributes such as 16-divisibility (a:). Triton's own ``repr`` argument cannot
    serve: it indexes the string cache key as if it were a tuple."""
    items = [f"c:{k}={v}" for k, v in sorted((compile.get("constants") or {}).items(),
                                             key=str)]
    items += [f"s:{k}={v}" for k, v in sorted((compile.get("signature") or {}).items(),
                                              key=str)]
    for attrs in (compile.get("configs") or [{}])[:1]:
        items += [f"a:{k}={v}" for k, v in sorted(attrs.items(), key=str)]
    items.append(f"o:warps={compile.get('num_warps')},stages={compile.get('num_stages')}")
    return "; ".join(items)


def _args(rep: str) -> list[str]:
    return rep.split("; ")


def closest_diff(name: str, rep: str, earlier: list[tuple[str, str]]) -> list[str]:
    """How ``rep`` differs from the nearest earlier binary of the same kernel: its items
    missing here (-) and new here (+)."""
    mine = _args(rep)
    best: list[str] | None = None
    for n, r in earlier:
        if n != name or r == rep:
            continue
        theirs = _args(r)
        diff = [f"-{b}" for b in theirs if b not in mine] + [f"+{a}" for a in mine
                                                            if a not in theirs]
        if best is None or len(diff) < len(best):
            best = diff
    return best if best is not None else ["(first of its kernel)"]


def stepped(name: str, fn: Callable[[], Any], root: Path) -> Any:
    """Run ``fn`` and print its seconds and what it compiled."""
    before, j0, a0, r0 = cubins(root), len(JIT), len(AUTOTUNE), len(REPRS)
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    new = collections.Counter(Path(p).stem for p in cubins(root) - before)
    tuned = AUTOTUNE[a0:]
    print(f"STEP {name}: {dt:.2f} s; new binaries {sum(new.values())} {dict(new)}; "
          f"JIT here {collections.Counter(JIT[j0:])}; autotuned {len(tuned)} kernels "
          f"{sum(s for _, s in tuned):.2f} s {[n for n, _ in tuned][:8]}", flush=True)
    if r0:  # a binary of a kernel met before: which specialisation is new
        for kname, rep in REPRS[r0:]:
            print(f"  NEW {kname}: {closest_diff(kname, rep, REPRS[:r0])}", flush=True)
    return out


def install(root: Path) -> None:
    from capture.registry import GraphRegistry

    def capture_all(self: GraphRegistry) -> None:
        for name, runner in self.runners.items():
            t0 = time.perf_counter()
            stepped(f"capture {name}", runner.capture, root)
            self.capture_s[name] = time.perf_counter() - t0

    GraphRegistry.capture_all = capture_all  # type: ignore[method-assign]

    import kernels.warmup as kw
    import compiled_spec.engine.engine as eng
    import compiled_spec.llm_compile as lc

    plain = kw.warm_model_attention

    def warm(*a: Any, **k: Any) -> Any:  # (gdc=True: COMPILED_SPEC_PDL_WARMUP=1's GDC=1 pass)
        name = "attention warm-up (PDL)" if k.get("gdc") else "attention warm-up"
        return stepped(name, lambda: plain(*a, **k), root)

    kw.warm_model_attention = warm
    for mod in (eng, lc):  # modules that imported the name
        if getattr(mod, "warm_model_attention", None) is plain:
            mod.warm_model_attention = warm  # type: ignore[attr-defined]

    try:
        from triton import knobs

        def hook(*args: Any, **kwargs: Any) -> bool:
            fn = kwargs.get("fn")
            name = getattr(fn, "name", None) or getattr(
                getattr(fn, "jit_function", None), "__name__", repr(fn))
            JIT.append(f"{name}{' (in memory)' if kwargs.get('already_compiled') else ''}")
            REPRS.append((str(name), spec_repr(kwargs.get("compile") or {})))
            return False

        knobs.runtime.jit_post_compile_hook = hook
    except (ImportError, AttributeError) as e:
        print(f"no Triton JIT hook: {e}", flush=True)
    try:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner

        bench = CachingAutotuner.benchmark_all_configs

        def timed(self: Any, *a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return bench(self, *a, **k)
            finally:
                AUTOTUNE.append((getattr(self.fn, "__name__", "?"), time.perf_counter() - t0))

        CachingAutotuner.benchmark_all_configs = timed  # type: ignore[method-assign]
    except (ImportError, AttributeError) as e:
        print(f"no autotune probe: {e}", flush=True)


def main() -> None:
    if "TRITON_CACHE_DIR" not in os.environ:
        raise SystemExit("set TRITON_CACHE_DIR (an empty directory for a cold start)")
    root = Path(os.environ["TRITON_CACHE_DIR"])
    install(root)
    args = sys.argv[1:]
    t0 = time.perf_counter()
    if args[:1] == ["-m"]:
        sys.argv = [args[1], *args[2:]]
        try:
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        except SystemExit:
            pass
    else:
        sys.argv = args
        try:
            runpy.run_path(args[0], run_name="__main__")
        except SystemExit:
            pass
    print(f"TOTAL {time.perf_counter() - t0:.1f} s; binaries {len(cubins(root))}; "
          f"autotuned {len(AUTOTUNE)} kernels {sum(s for _, s in AUTOTUNE):.2f} s", flush=True)


if __name__ == "__main__":
    main()
