"""Tensor parallelism over torch.distributed (NCCL on GPUs, gloo on the CPU).

* ``group``: the tensor-parallel group a model is sharded over (passed explicitly, no global).
* ``layers``: column / row parallel linears, vocabulary-parallel embedding and lm_head.
* ``shard``: shard a loaded ``CausalLM`` (and optionally its EAGLE draft) in place for one rank.
"""
from compiled_spec.distributed.group import TPGroup
from compiled_spec.distributed.shard import shard_causal_lm, shard_draft

__all__ = ["TPGroup", "shard_causal_lm", "shard_draft"]
