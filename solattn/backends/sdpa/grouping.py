"""Grouping query blocks so that each SDPA call sees equal shapes and no padding.

Query blocks ("rows": one per (batch, head, query block), numbered ``(b H + h) n + i``) that keep
the same number ``c`` of exact key blocks gather key tensors of one length, so a group runs as
one batched SDPA call. Within a count, blocks that need no mask are kept apart from those that
do (the device's fastest kernel runs without one), the ragged last query block (T not a
multiple of 64) is kept apart because it has fewer than 64 query rows, and with the tail, blocks
whose tail logit needs one mask row per query row are kept apart from those that take one mask
row per block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from ...routing import Plan
from ...validation import BLOCK


@dataclass(frozen=True)
class Group:
    count: int            # exact key blocks of every row of the group
    masked: bool          # rows whose keys include a masked slot (bias, dead row, tail)
    ragged: bool          # rows of the ragged last query block (T % 64 != 0)
    rows: torch.Tensor    # (N,) int64 row numbers, ascending
    row_mask: bool = False  # the tail's mask entry differs per query row (one mask row per query row)


def needs_mask(plan: Plan, any_bias: bool, tail: bool) -> Optional[torch.Tensor]:
    """``(B, H, n)`` bool of query blocks that need a mask, or None when none does. A key bias
    or the tail masks every block; otherwise only blocks that keep a key block with dead rows."""
    if any_bias or tail:
        return torch.ones(plan.kv_num_blocks.shape, dtype=torch.bool, device=plan.block_len.device)
    if bool((plan.block_len < BLOCK).any()):
        return plan.touches_dead
    return None


def group_rows(counts: torch.Tensor, masked: Optional[torch.Tensor], ragged: Optional[torch.Tensor],
               row_mask: Optional[torch.Tensor] = None) -> List[Group]:
    """Split rows by (count, row_mask, masked, ragged). ``counts``: ``(R,)`` int; ``masked``,
    ``ragged``, ``row_mask``: ``(R,)`` bool or None (all False). Groups come in ascending key
    order; one host sync per group."""
    key = counts.long() * 8
    if row_mask is not None:
        key = key + row_mask.long() * 4
    if masked is not None:
        key = key + masked.long() * 2
    if ragged is not None:
        key = key + ragged.long()
    groups = []
    for k in torch.unique(key).tolist():
        rows = torch.nonzero(key == k).squeeze(1)
        groups.append(Group(count=k // 8, masked=bool(k & 2), ragged=bool(k & 1), rows=rows,
                            row_mask=bool(k & 4)))
    return groups


def split_rows(tables, step: int) -> List[tuple]:
    """Row tables (tensors with rows first, or None) cut into chunks of ``step`` rows: one tuple
    of views (None stays None) per chunk, one ``split`` call per table."""
    parts = [None if t is None else t.split(step) for t in tables]
    count = len(next(p for p in parts if p is not None))
    return [tuple(None if p is None else p[c] for p in parts) for c in range(count)]
