"""The all-to-all exchanges of :mod:`solattn.distributed` (sequence shards <-> head slices)."""

from __future__ import annotations

from datetime import timedelta
from typing import List, Optional

import torch
import torch.distributed as dist

from .group import wait

Tensor = torch.Tensor


def all_to_all(x: Tensor, in_splits: List[int], out_splits: List[int], group,
               timeout: Optional[timedelta] = None, what: str = "an all-to-all") -> Tensor:
    """Rows ``[sum(in_splits[:j]), ...)`` of ``x`` go to rank j; the rows received from rank j
    land at ``sum(out_splits[:j])``. Every backend in use here (NCCL, XCCL, Gloo, MPI) implements
    ``all_to_all_single`` with uneven splits."""
    x = x.contiguous()
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    work = dist.all_to_all_single(out, x, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                  group=group, async_op=True)
    wait(work, timeout, "solattn.distributed", what)
    return out


class _AllToAll(torch.autograd.Function):
    """Differentiable all-to-all: the gradient of an exchange is the exchange with the splits
    swapped (every row goes back to the rank it came from)."""

    @staticmethod
    def forward(ctx, x, in_splits, out_splits, group, timeout):
        ctx.splits = (in_splits, out_splits)
        ctx.group, ctx.timeout = group, timeout
        return all_to_all(x, in_splits, out_splits, group, timeout)

    @staticmethod
    def backward(ctx, grad):
        in_splits, out_splits = ctx.splits
        return all_to_all(grad, out_splits, in_splits, ctx.group, ctx.timeout), None, None, None, None


class SumGrad(torch.autograd.Function):
    """Identity whose gradient is summed over the group: for a tensor every rank holds whole
    (``key_bias``) and uses for its own head slice, so each rank's gradient is its heads' share
    and the sum is the gradient of the whole computation, the same on every rank."""

    @staticmethod
    def forward(ctx, x, group, timeout):
        ctx.group, ctx.timeout = group, timeout
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        wait(dist.all_reduce(grad, group=ctx.group, async_op=True), ctx.timeout, "solattn.distributed",
             "the key_bias gradient's all-reduce")
        return grad, None, None


def seq_to_heads(xs: List[Tensor], lens: List[int], rank: int, world: int, group, timeout=None) -> List[Tensor]:
    """Shards ``(B, T_r, H, D)`` of one dtype -> ``(B, T, H/P, D)`` views of the whole sequence,
    head slice ``rank``; one all-to-all for all of them."""
    B, Tr, H, D = xs[0].shape
    hp = H // world
    # send buffer (destination rank, token, tensor, b, head within the slice, d): one copy per tensor
    send = torch.stack([x.reshape(B, Tr, world, hp, D).permute(2, 1, 0, 3, 4) for x in xs], dim=2)
    recv = _AllToAll.apply(send.reshape(world * Tr, len(xs), B, hp, D), [Tr] * world, lens, group, timeout)
    # received rows are the senders' shards in rank order, i.e. the whole sequence
    return [recv[:, i].permute(1, 0, 2, 3) for i in range(len(xs))]


def heads_to_seq(y: Tensor, lens: List[int], rank: int, world: int, group, timeout=None) -> Tensor:
    """``(B, T, H/P, D)`` -> this rank's shard ``(B, T_r, H, D)``, contiguous."""
    B, _, hp, D = y.shape
    Tr = lens[rank]
    recv = _AllToAll.apply(y.permute(1, 0, 2, 3), lens, [Tr] * world, group, timeout)   # (P*T_r, B, hp, D)
    return recv.reshape(world, Tr, B, hp, D).permute(2, 1, 0, 3, 4).reshape(B, Tr, world * hp, D).contiguous()


def exchange_in(xs: List[Optional[Tensor]], lens, rank, world, group, timeout=None) -> List[Optional[Tensor]]:
    """:func:`seq_to_heads` for tensors of possibly different dtypes (one all-to-all per dtype)."""
    out: List[Optional[Tensor]] = [None] * len(xs)
    for dtype in dict.fromkeys(x.dtype for x in xs if x is not None):
        idx = [i for i, x in enumerate(xs) if x is not None and x.dtype == dtype]
        for i, t in zip(idx, seq_to_heads([xs[i] for i in idx], lens, rank, world, group, timeout)):
            out[i] = t
    return out
