"""Issue 16 (cold start): can torch's regional compilation (``torch.compiler.nested_compile_region``
on the decoder layer, compiled once and reused by every layer) shorten the target's compile?

    PYTHONPATH=. COMPILED_SPEC_PROGRESS=0 python profiles/scripts/regional_compile_cpu.py \
        {0|1} LAYERS

0: the engine as it is (the whole target one graph); 1: ``DecoderLayer.forward`` marked as a
nested compile region, the attention metadata cloned before the layers (the region refuses
inputs that alias one another, and the metadata are views of one staging buffer). A tiny
synthetic Llama of LAYERS layers (tests/spec_models.py), compile=True on the CPU, one greedy
request; prints the seconds, torch's compile timers, and the tokens against the eager engine's.
Thirty-fourth session (torch 2.13.0+cpu): the region does not compile. Inside it, torch's
functionalization refuses our KV-writing custom ops (``compiled_spec::rope_write_kv`` mutates
the caches), so the engine's compile fails and the step is reported failed.
"""
from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.spec_models import write_bigram_target  # noqa: E402


def main() -> None:
    region, layers = sys.argv[1] == "1", int(sys.argv[2])
    from compiled_spec.models import decoder

    if region:
        decoder.DecoderLayer.forward = torch.compiler.nested_compile_region(
            decoder.DecoderLayer.forward)
        forward = decoder.CausalLM.forward

        def cloned_metadata(self, input_ids, positions, attn_meta, aux_layer_ids=()):
            m = attn_meta
            attn_meta = dataclasses.replace(
                m, slot_mapping=m.slot_mapping.clone(), block_tables=m.block_tables.clone(),
                seq_lens=m.seq_lens.clone(), query_start_loc=m.query_start_loc.clone())
            return forward(self, input_ids, positions, attn_meta, aux_layer_ids)

        decoder.CausalLM.forward = cloned_metadata
    from compiled_spec import LLM, SamplingParams
    from compiled_spec.compile import CompileConfig
    from compiled_spec.models.gguf_loader import find_default_gguf

    target = write_bigram_target(Path(tempfile.mkdtemp()) / "t", layers=layers, hidden=64,
                                 attention=True)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    llm = LLM(model=target, tokenizer=find_default_gguf(), max_model_len=128, device="cpu",
              compile=True, compile_config=CompileConfig(cache_dir=tempfile.mkdtemp()))
    out = llm.generate([[3, 5, 7, 9]], sp)[0].token_ids
    print({"region": region, "layers": layers, "seconds": round(time.perf_counter() - t0, 1),
           "tokens": out, "compile_s": llm.compile_cache.get("seconds"),
           "step_faults": llm.stats.num_step_faults})
    eager = LLM(model=target, tokenizer=find_default_gguf(), max_model_len=128, device="cpu")
    print({"eager_tokens": eager.generate([[3, 5, 7, 9]], sp)[0].token_ids})


if __name__ == "__main__":
    main()
