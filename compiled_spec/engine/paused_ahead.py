"""A paused step launched ahead (issue 16): with speculation paused (the adaptive policy's
PLAIN mode), the next decode step is launched from the device token (argmax or sampled) before
the host reads this step's tokens, as vanilla decoding does (``VerifyAhead.decode``).

Why: a paused step used to run late. On the H100 (thirty-fourth session,
``adaptive_shrink.json``) the adaptive engine measured its paused steps at 1.63 ms at batch 1
and 1.79-2.06 ms at 16 / 64, against vanilla's decode steps of 0.80 / 0.97 / 1.44 ms in the same
process. The GPU idled while the host read the token, did the bookkeeping, staged the draft's
first pass and the next decode. Pausing could then never bring an EAGLE engine to vanilla's
speed, where drafting does not pay.

What has to come first: the draft's first pass over this step's token (``EagleProposer.sync``,
which keeps the draft's KV complete for when drafting resumes), or its deferral
(engine/deferred_first_pass.py: the step's aux rows copied into a ring, the default). Both
read this step's target states, which the next decode's replay overwrites (graph memory, and
the propose graph's fc buffer that its ``precombine`` rewrites). So the copy, or the sync
graph's replay with its token ids copied from the device token into its input buffer, is
issued here and the decode is launched behind it. The engine's ``propose`` then skips what it
would have run (``ModelRunner._synced``).

Taken only where the next step is a plain decode of every request, as vanilla's launch:
no prompt chunk, nobody at its budget or short of KV, no admission, and a
captured sync graph for this batch; anything else runs the step as before (late), the reason
counted in ``VerifyAheadStats.skipped``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from compiled_spec.engine.batch import Span
from compiled_spec.spec.propose_batch import ProposeBatch

if TYPE_CHECKING:
    from compiled_spec.engine.model_runner import ModelRunner
    from compiled_spec.engine.request import Request


def sync_ahead(rn: "ModelRunner", reqs: "list[Request]", num_new: list[int],
               tok: torch.Tensor,  # [B] this step's tokens (argmax or sampled), on the device
               row_start: list[int],  # each request's row in target_hidden
               target_hidden: torch.Tensor | list[torch.Tensor]) -> str | None:
    """The paused step's draft first pass replayed now, from ``tok``, once the decode launch's
    own checks passed (``VerifyAhead.launch_decode`` calls it): None when it ran, else why not
    (the launch is then skipped, counted under that reason)."""
    prop = rn.proposer
    if prop is None or prop.sync_graph is None or not prop.sync_graph.enabled:
        return "paused_no_graph"
    if max(num_new) != 1:
        return "prefill"  # a prompt's last chunk: its first pass spans the chunk
    for r in reqs:  # the late path leaves such a request out of the first pass: it drafts
        # no more (k_next below is <= 0 within two tokens of its KV limit)
        if not r.spec_enabled or r.kv_limit - r.num_tokens <= 2:
            return "not_spec"
    starts = [r.num_computed for r in reqs]
    d = rn.deferred
    # Deferred: no KV to grow now (the flush writes positions the target already holds)
    if d is not None and d.defer(reqs, starts, row_start, target_hidden) is None:
        rn._synced = "deferred"  # kept for a later first pass (engine/deferred_first_pass.py)
        return None
    k, look, grow_cap = rn.k, rn.lookahead, rn._grow_cap
    limits, wants = [], []
    for r in reqs:
        n_tok = r.num_tokens + 1  # with this step's token
        # the draft's positions of a later proposal, as ``propose`` grows them
        wants.append((r.req_id, min(n_tok + look, grow_cap(r))))
        limits.append(n_tok - 2 + min(k, r.kv_limit - n_tok - 1))
    # One check for the batch: a grow per request was a third of this function's host time
    # at batch 64 (CPU cProfile, fortieth session); all or none, as the late path then retries.
    if not rn.allocator.grow_all(wants):
        return "kv_exhausted"
    n = len(reqs)
    first_pass = [Span(r.req_id, p, 1) for r, p in zip(reqs, starts)]
    batch = ProposeBatch(first_pass=first_pass, token_ids=[0] * n,  # ids: from ``tok``
                         hidden_rows=list(row_start), step_limits=limits,
                         temperature=[r.params.temperature for r in reqs],
                         seeds=[r.seed for r in reqs])
    rn.flush_deferred("sync")  # before this first pass, which reads the KV they write
    if not prop.sync_graph.run(batch, target_hidden, ids=tok):
        return "paused_no_graph"
    for r, p in zip(reqs, starts):
        r.draft_computed = p + 1
    rn._synced = "synced"
    return None
