"""Attention for packed rows (learner.shared_prompt), segment by segment.

A packed row is a prompt followed by its completions; each completion attends to the prompt and to its own
earlier tokens. Under SDPA with the row's [L, L] mask every query is scored against every key of the row,
most of them masked: with 8 completions of ~50 tokens behind a ~90-token prompt, 3-4x the attention
arithmetic that is needed (learner.profile_step on the bench_trl workload: the attention's forward and
backward took 28 % of a training step's operator time). Here each row's prompt attends causally to
itself, and all of its completions at once, padded to the longest, to [the prompt's keys, their own]:
the arithmetic that is needed, plus the padding. Same values as the masked SDPA (the reference, kept as
the fallback; tests/learner/test_shared_prompt.py compares both with the plain path).

The model's attention is registered as "tandem_packed"; it computes segment by segment when the row mask
it is given carries the rows' segments (`with_layout`, learner/step.py: on the mask, so that gradient
checkpointing's recomputation, outside the forward call, finds them too), and is plain SDPA under that
mask otherwise, so any other use of the model stays correct.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

NAME = "tandem_packed"
Layout = list[list[tuple[int, int]]]  # per row: (start, end) of the prompt, then of each completion


def with_layout(mask: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The packed rows' [R, 1, L, L] mask, carrying their segments for segment_attention."""
    mask.tandem_layout = layout
    return mask


def _padded(x: torch.Tensor, start: int, end: int, length: int) -> torch.Tensor:
    """x[:, start:end] ([H, n, D]) right-padded with zeros to `length` positions."""
    return F.pad(x[:, start:end], (0, 0, 0, length - (end - start)))


def segment_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query [R, H, L, D], key/value [R, KV, L, D] -> ([R, L, H, D], None), as transformers' SDPA."""
    layout = getattr(attention_mask, "tandem_layout", None)
    if layout is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    R, H, L, D = query.shape
    gqa = {"enable_gqa": True} if key.shape[1] != H else {}
    rows = []
    for r, (prompt, *completions) in enumerate(layout):
        q, k, v = query[r], key[r], value[r]
        P = prompt[1]
        parts = [
            F.scaled_dot_product_attention(
                q[None, :, :P], k[None, :, :P], v[None, :, :P], is_causal=True, scale=scaling, **gqa
            )[0]
        ]
        if completions:
            lengths = [e - s for s, e in completions]
            G, C = len(completions), max(lengths)
            qc = torch.stack([_padded(q, s, e, C) for s, e in completions])  # [G, H, C, D]
            kc = torch.cat(
                [
                    k[None, :, :P].expand(G, -1, -1, -1),
                    torch.stack([_padded(k, s, e, C) for s, e in completions]),
                ],
                dim=2,
            )  # [G, KV, P + C, D]
            vc = torch.cat(
                [
                    v[None, :, :P].expand(G, -1, -1, -1),
                    torch.stack([_padded(v, s, e, C) for s, e in completions]),
                ],
                dim=2,
            )
            n = torch.tensor(lengths, device=q.device)
            own = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()[None] & (
                torch.arange(C, device=q.device)[None, None, :] < n[:, None, None]
            )  # [G, C, C]: causal within the completion, none of its padding
            mask = torch.cat([own.new_ones(G, C, P), own], dim=2)[:, None]  # [G, 1, C, P + C]
            out = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, scale=scaling, **gqa)
            parts += [out[g, :, : lengths[g]] for g in range(G)]
            P += sum(lengths)
        if P < L:  # the row's padding: attended by nothing, its output never read
            parts.append(q.new_zeros(H, L - P, D))
        rows.append(torch.cat(parts, dim=1))
    return torch.stack(rows).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, segment_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)
