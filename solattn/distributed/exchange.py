"""The all-to-all exchanges of :mod:`solattn.distributed`, one head group at a time.

Layouts, for a group of ``P`` ranks, this rank's shard length ``T_r``, all shard lengths
``lens`` (``T = sum(lens)``), ``hp = H / P`` heads per rank and a head group ``[a, b)`` of
``hg = b - a`` heads within every rank's slice:

- **shard**: ``(B, T_r, H, D)``, the caller's tensors; rank j's slice is heads
  ``[j hp, (j + 1) hp)``, and the group is heads ``[j hp + a, j hp + b)`` of it;
- **in** (:func:`start_in`): ``m`` shards of one dtype -> a buffer ``(T, m, B, hg, D)``: the
  whole sequence (the senders' shards in rank order) for this rank's heads ``[rank hp + a,
  rank hp + b)``; :func:`heads_view` gives ``(B, T, hg, D)`` views of it;
- **out** (:func:`start_out`): a buffer ``(T, m, B, hg, D)`` -> ``(P T_r, m, B, hg, D)``:
  this rank's tokens of every rank's group heads, which :func:`place` writes into shards.

Every exchange is one ``torch.distributed.all_to_all_single`` started with ``async_op=True``
(NCCL, XCCL and Gloo run it on their own stream or thread while this one computes, and all of
them implement uneven splits), waited on through :class:`Pending`.
"""

from __future__ import annotations

from datetime import timedelta
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .group import wait

Tensor = torch.Tensor


def head_groups(hp: int, groups: int) -> List[Tuple[int, int]]:
    """``[a, b)`` ranges splitting ``hp`` heads into ``min(groups, hp)`` groups, sizes differing
    by at most one (the larger first)."""
    g = max(1, min(groups, hp))
    base, extra = divmod(hp, g)
    bounds, a = [], 0
    for i in range(g):
        b = a + base + (i < extra)
        bounds.append((a, b))
        a = b
    return bounds


class Pending:
    """An exchange in flight: ``result(timeout)`` waits for it and returns the receive buffer.
    It holds the send buffer until then too (the backends also keep it until the work is done)."""

    def __init__(self, work, send: Tensor, recv: Tensor, what: str):
        self.work, self.send, self.recv, self.what = work, send, recv, what

    def result(self, timeout: Optional[timedelta], fn: str) -> Tensor:
        if self.work is not None:
            wait(self.work, timeout, fn, self.what)
            self.work = self.send = None
        return self.recv


def _start(send: Tensor, recv: Tensor, in_splits, out_splits, group, what: str) -> Pending:
    work = dist.all_to_all_single(recv, send, output_split_sizes=list(out_splits),
                                  input_split_sizes=list(in_splits), group=group, async_op=True)
    return Pending(work, send, recv, what)


def start_in(xs: Sequence[Tensor], lens: List[int], rank: int, world: int, a: int, b: int, group,
             what: str = "an input exchange") -> Pending:
    """Start sending heads ``[a, b)`` of every rank's slice of the shards ``xs`` (one dtype) to
    their ranks; the result is the ``(T, m, B, hg, D)`` buffer of this rank's heads."""
    B, Tr, H, D = xs[0].shape
    hp = H // world
    # (destination rank, token, tensor, b, head, d): the one copy each exchange needs
    send = torch.stack([x.reshape(B, Tr, world, hp, D)[:, :, :, a:b].permute(2, 1, 0, 3, 4) for x in xs],
                       dim=2)
    recv = send.new_empty((sum(lens), len(xs), B, b - a, D))
    return _start(send.reshape(world * Tr, len(xs), B, b - a, D), recv, [Tr] * world, lens, group, what)


def heads_view(buf: Tensor, i: int) -> Tensor:
    """Tensor ``i`` of an in-direction buffer as ``(B, T, hg, D)`` (a view)."""
    return buf[:, i].permute(1, 0, 2, 3)


def start_out(buf: Tensor, lens: List[int], rank: int, world: int, group,
              what: str = "an output exchange") -> Pending:
    """Start returning a ``(T, m, B, hg, D)`` buffer's tokens to the ranks that hold them."""
    buf = buf.contiguous()
    Tr = lens[rank]
    recv = buf.new_empty((world * Tr,) + tuple(buf.shape[1:]))
    return _start(buf, recv, lens, [Tr] * world, group, what)


def place(recv: Tensor, dsts: Sequence[Optional[Tensor]], a: int, b: int, world: int) -> None:
    """Write an out-direction result ``(P T_r, m, B, hg, D)`` into the heads ``[j hp + a, j hp + b)``
    of the shards ``dsts`` (``(B, T_r, H, D)``, contiguous; None: skipped)."""
    m = recv.shape[1]
    for i in range(m):
        dst = dsts[i]
        if dst is None:
            continue
        B, Tr, H, D = dst.shape
        part = recv.view(world, Tr, m, B, b - a, D)[:, :, i].permute(2, 1, 0, 3, 4)
        dst.view(B, Tr, world, H // world, D)[:, :, :, a:b].copy_(part)
