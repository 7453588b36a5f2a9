"""``compiled-spec bench``: our engine next to Hugging Face transformers, in one process and one run.

* ``prompts``: MT-bench first turns with the chat template.
* ``timing``: result rows, per-phase timers (CUDA events: no host sync in the loop), floors.
* ``ours``: our engine (vanilla / EAGLE, eager / compiled + CUDA graphs) at several batch sizes.
* ``hf``: transformers ``generate`` eager, with its static cache + torch.compile, and with prompt
  lookup decoding.
* ``report``: JSON, ``BENCHMARKS.md`` and a tokens/s-by-batch-size PNG.
* ``run``: the ``compiled-spec bench`` entry point.
"""
from compiled_spec.bench.prompts import load_mt_bench, mt_bench_prompts

__all__ = ["load_mt_bench", "mt_bench_prompts", "run_bench"]


def run_bench(args):  # noqa: ANN001 - argparse.Namespace; keeps torch out of CLI start-up
    from compiled_spec.bench.run import run_bench as _run

    return _run(args)
