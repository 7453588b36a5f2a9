"""Training-time test (EAGLE-3): unroll the draft's own multi-step chain during training.

Index convention (0-based, one training sequence t_0..t_{L-1}; H_i = target aux states at i).
From the inference chain in ``compiled_spec/spec/proposer.py``:
  * the first pass at position i reads (t_{i+1}, H_i) and predicts the token at position i+2;
  * step s of the chain rooted at i sits at position i+s-1, reads (d_{s-1}, the draft's own
    feed_back from step s-1, which sat at position i+s-2) and predicts the token at i+s+1.
Indexing every step by the position j = i+s-1 where it sits (and teacher-forcing d_{s-1} = t_{i+s}
= t_{j+1}, since the data are the target's own tokens):
  * step s input at j: token t_{j+1} (the same for every step) and hidden
      s = 1: fc(aux_j);   s > 1: feed_back of step s-1 at position j-1;
  * it predicts t_{j+2} for every s, whose target distribution is softmax(target_logits[j+1])
    (the target's logits at j+1 are its distribution for the token at j+2);
  * it exists only when its chain root j-s+1 >= 0, and is trained only when position j+2 is a
    response token inside the sequence.
Attention at step s, position j (inference: the first pass wrote step-1 K/V at positions 0..i,
then each step t >= 2 of the same chain wrote one entry at i+t-1):
  * step-1 keys at positions k <= j-s+1, and step-t keys (2 <= t <= s) only at k = j-s+t.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from compiled_spec.draft.model import EagleDraft, project_qkv
from compiled_spec.models.decoder import Attention


def ttt_attention_mask(seq_len: int, step: int,
                       device: torch.device | str = "cpu") -> torch.Tensor:  # [S, step*S] bool
    """Which keys query j of step ``step`` (1-based) sees; keys are the per-step K/V blocks
    [step 1 | step 2 | ... | step s] concatenated, S entries each (True = attend)."""
    q = torch.arange(seq_len, device=device)[:, None]  # [S, 1]
    k = torch.arange(seq_len, device=device)[None, :]  # [1, S]
    blocks = [k <= q - step + 1]  # the first pass's K/V up to the chain root
    blocks += [k == q - step + t for t in range(2, step + 1)]  # one entry per later step
    return torch.cat(blocks, dim=1)


def _ttt_attention(attn: Attention, x: torch.Tensor,  # [B, S, in_features]
                   cos: torch.Tensor, sin: torch.Tensor,  # [B*S, head_dim]
                   kv: list[tuple[torch.Tensor, torch.Tensor]],  # this layer's earlier steps
                   mask: torch.Tensor,  # [S, s*S] bool
                   ) -> torch.Tensor:  # [B, S, h]
    """The paged Attention's math (same modules, same rope) over this step's K/V appended to the
    earlier steps' ones; ``kv`` grows by one (k, v) pair, each [B, kv_heads, S, head_dim]."""
    b, s, _ = x.shape
    q, k, v = project_qkv(attn, x, cos, sin)
    kv.append((k, v))
    keys = torch.cat([kk for kk, _ in kv], dim=2)  # [B, kv_heads, s*S, head_dim]
    values = torch.cat([vv for _, vv in kv], dim=2)
    group = attn.num_heads // attn.num_kv_heads  # GQA: query head j reads kv head j // group
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    # Every row sees at least its own step-s entry (k = j), so no row is fully masked.
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scale)
    return attn.o_proj(out.transpose(1, 2).reshape(b, s, attn.num_heads * attn.head_dim))


def ttt_forward(draft: EagleDraft,
                input_ids: torch.Tensor,  # [B, S] draft input ids: position j holds t_{j+1}
                hidden: torch.Tensor,  # [B, S, h] step-1 hidden: combine_aux(aux_j)
                positions: torch.Tensor,  # [B, S] int64
                num_steps: int,
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:  # per step (feed_back, for_logits)
    """Unrolled chain with the draft's own modules; step 1 is ``forward_dense``'s function."""
    if num_steps < 1:
        raise ValueError(f"num_steps={num_steps} must be >= 1")
    seq_len = input_ids.shape[1]
    embeds = draft.embed(input_ids)  # [B, S, h]; the token input is the same at every step
    cos, sin = draft.rotary_emb(positions.reshape(-1), embeds.dtype)  # [B*S, head_dim]
    kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in draft.layers]
    outs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for step in range(1, num_steps + 1):
        mask = ttt_attention_mask(seq_len, step, input_ids.device)
        # _prologue/_outputs are EagleDraft's own (EAGLE-1 fc / EAGLE-3 final norm), reused so
        # this stays the same function as the inference forward.
        x = draft._prologue(embeds, hidden)
        for layer, layer_kv in zip(draft.layers, kv):
            attn_in, residual = layer.attn_input(x, embeds)
            x = layer.finish(_ttt_attention(layer.self_attn, attn_in, cos, sin, layer_kv, mask),
                             residual)
        feed, for_logits = draft._outputs(x)
        outs.append((feed, for_logits))
        # Step s+1 at position j reads step s's feed_back at j-1; position 0 has no predecessor
        # (its chain root would be -1): zeros, never trained on.
        hidden = F.pad(feed[:, :-1], (0, 0, 1, 0))
    return outs


@dataclass
class TTTOutput:
    loss: torch.Tensor  # scalar: sum_s decay^(s-1) * mean soft CE of step s
    step_losses: list[float]
    step_accuracy: list[float]  # draft argmax == target argmax (both over the draft vocab)
    step_counts: list[int]  # trained positions per step
    # The same over positions a context lookup does not predict (TrainSequence.copyable):
    # packed path only, empty otherwise.
    step_accuracy_novel: list[float] = field(default_factory=list)
    step_counts_novel: list[int] = field(default_factory=list)


def label_mask(loss_mask: torch.Tensor) -> torch.Tensor:  # [B, S] -> [B, S]
    """Position j is trainable when the token it predicts, t_{j+2}, is a response token (the
    loss mask is False on prompts, padding and past the sequence end)."""
    return F.pad(loss_mask[:, 2:], (0, 2), value=False)


def ttt_loss(draft: EagleDraft,
             input_ids: torch.Tensor,  # [B, S] sequence token ids t_0..t_{S-1}, right-padded
             aux: torch.Tensor,  # [B, S, n*target_h] target aux states
             target_logits: torch.Tensor,  # [B, S, V_draft] target logits at the draft vocab
             loss_mask: torch.Tensor,  # [B, S] bool, response tokens
             num_steps: int, decay: float = 0.8) -> TTTOutput:
    b, s = input_ids.shape
    n_aux = len(draft.aux_layer_ids) or 1
    hidden = draft.combine_aux(list(aux.chunk(n_aux, dim=-1)))  # [B, S, h]
    draft_in = F.pad(input_ids[:, 1:], (0, 1))  # [B, S]: t_{j+1}; the last one is never trained
    positions = torch.arange(s, device=input_ids.device).expand(b, s)
    outs = ttt_forward(draft, draft_in, hidden, positions, num_steps)
    # Only trainable positions reach the readout and the loss: prompts and padding (a third of
    # chat data) never pay for [*, V_draft] logits. One host sync per batch for their indices.
    rows = label_mask(loss_mask).reshape(-1).nonzero().squeeze(1)  # [N] flat b*S + j
    # Label of position j: the target's distribution for t_{j+2}, i.e. its logits at j+1 (same
    # sequence: a trainable j is at most S-3).
    labels = target_logits.reshape(b * s, -1)[rows + 1].float()  # [N, V_draft]
    target_p = torch.softmax(labels, dim=-1)
    target_top = labels.argmax(dim=-1)  # [N]
    root = rows % s  # [N] j; step s needs a chain root j - s + 1 >= 0
    total = aux.new_zeros((), dtype=torch.float32)
    stats = []  # per step [loss, hits, count], read back with one device sync at the end
    for step, (_, for_logits) in enumerate(outs, 1):
        m = root >= step - 1  # [N]
        logits = draft.compute_logits(for_logits.reshape(b * s, -1)[rows]).float()  # [N, V]
        ce = -(target_p * torch.log_softmax(logits, dim=-1)).sum(-1)  # [N]
        n = m.sum()
        # where, not multiply: garbage rows (no chain root) must not leak NaN/inf into the sum.
        step_loss = torch.where(m, ce, torch.zeros_like(ce)).sum() / n.clamp(min=1)
        total = total + decay ** (step - 1) * step_loss
        hits = ((logits.argmax(-1) == target_top) & m).sum()
        stats.append(torch.stack([step_loss.detach(), hits.float(), n.float()]))
    host = torch.stack(stats).tolist()
    return TTTOutput(total, [r[0] for r in host], [r[1] / max(r[2], 1) for r in host],
                     [int(r[2]) for r in host])
