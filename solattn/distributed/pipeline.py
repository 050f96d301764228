"""The pipelined exchange of :mod:`solattn.distributed`: attention on head group g while the
inputs of group g + 1 travel and the output of group g - 1 goes home; the backward the same way.

Issue order, forward (each exchange is asynchronous; ``in g`` = the inputs of head group g,
``out g`` its output)::

    in 0, in 1 | attend 0 | out 0, in 2 | attend 1 | out 1, in 3 | ... | attend G-1 | out G-1

so while group g is attended, ``in g+1`` (started before) and ``out g-1`` are in flight. The
backward: the output gradient of group g + 1 travels while the gradients of group g are
computed (from the graph kept for that group), and each group's q, k, v, gate gradients go
home as soon as they are computed; a float ``key_bias``'s gradient (every rank's heads' share)
is summed over the groups, then over the ranks with one all-reduce.

Attention on a head slice is exactly the single-device computation for those heads (every
statistic and routing decision is per (batch, head)), so any number of groups gives the
single-device result.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from .exchange import Pending, head_groups, heads_view, place, start_in, start_out
from .group import wait

Tensor = torch.Tensor

#: head groups per rank when the caller gives none (capped at the heads per rank)
DEFAULT_HEAD_GROUPS = 8


class _Layout:
    """What a call exchanges: shards ``xs`` (None entries skipped) bucketed by dtype, head groups."""

    def __init__(self, xs: Sequence[Optional[Tensor]], lens, rank, world, groups, group, fn, timeout):
        B, Tr, H, D = xs[0].shape
        self.shape, self.lens, self.rank, self.world = (B, Tr, H, D), lens, rank, world
        self.group, self.fn, self.timeout = group, fn, timeout
        self.heads = head_groups(H // world, groups)
        self.buckets = {}                 # dtype -> indices into xs
        for i, x in enumerate(xs):
            if x is not None:
                self.buckets.setdefault(x.dtype, []).append(i)

    def start_in(self, xs, g) -> List[Pending]:
        a, b = self.heads[g]
        return [start_in([xs[i] for i in idx], self.lens, self.rank, self.world, a, b, self.group,
                         f"the input exchange of head group {g}") for idx in self.buckets.values()]

    def wait(self, pending: List[Pending]) -> List[Tensor]:
        return [p.result(self.timeout, self.fn) for p in pending]


def _views(layout: _Layout, bufs: List[Tensor], n: int) -> List[Optional[Tensor]]:
    """The ``(B, T, hg, D)`` views of the ``n`` exchanged tensors (None where absent)."""
    out: List[Optional[Tensor]] = [None] * n
    for buf, idx in zip(bufs, layout.buckets.values()):
        for j, i in enumerate(idx):
            out[i] = heads_view(buf, j)
    return out


def _forward(layout: _Layout, xs, attn: Callable, keep_graph: bool):
    """Run the pipeline; returns the output shard and, with ``keep_graph``, each group's
    (receive buffers requiring grad, output) for the backward."""
    B, Tr, H, D = layout.shape
    fn, timeout, G = layout.fn, layout.timeout, len(layout.heads)
    out: Optional[Tensor] = None
    graphs, outs = [], []
    ahead = layout.start_in(xs, 0)
    for g, (a, b) in enumerate(layout.heads):
        current, ahead = ahead, (layout.start_in(xs, g + 1) if g + 1 < G else None)
        bufs = layout.wait(current)
        if keep_graph:
            bufs = [buf.requires_grad_() for buf in bufs]
        with torch.set_grad_enabled(keep_graph):
            y = attn(*_views(layout, bufs, len(xs)))
        if out is None:
            out = y.new_empty((B, Tr, H, D))
        if keep_graph:
            graphs.append((bufs, y))
        outs.append(start_out(y.detach().permute(1, 0, 2, 3).unsqueeze(1), layout.lens, layout.rank,
                              layout.world, layout.group, f"the output exchange of head group {g}"))
    for (a, b), pending in zip(layout.heads, outs):
        place(pending.result(timeout, fn), [out], a, b, layout.world)
    return out, graphs


class _Pipelined(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layout, attn, kb_box, kb, *xs):
        out, graphs = _forward(layout, xs, attn, keep_graph=True)
        ctx.layout, ctx.graphs, ctx.kb_leaf = layout, graphs, kb_box[0]
        ctx.present = [x is not None for x in xs]
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        layout, graphs, kb_leaf = ctx.layout, ctx.graphs, ctx.kb_leaf
        B, Tr, H, D = layout.shape
        want = ctx.needs_input_grad[4:]
        n = len(want)
        dxs = [grad_out.new_empty((B, Tr, H, D), dtype=bufdt) if w else None
               for w, bufdt in zip(want, _dtypes(layout, n))]
        kb_need = kb_leaf is not None and ctx.needs_input_grad[3]
        kb_grad = None
        go = grad_out.contiguous()
        G = len(layout.heads)

        def start(g):
            a, b = layout.heads[g]
            return start_in([go], layout.lens, layout.rank, layout.world, a, b, layout.group,
                            f"the output-gradient exchange of head group {g}")

        outs = []
        ahead = start(0)
        for g in range(G):
            current, ahead = ahead, (start(g + 1) if g + 1 < G else None)
            gy = heads_view(current.result(layout.timeout, layout.fn), 0)
            bufs, y = graphs[g]
            graphs[g] = None                      # free the group's graph as soon as it is used
            inputs = list(bufs) + ([kb_leaf] if kb_need else [])
            grads = torch.autograd.grad(y, inputs, gy.to(y.dtype), allow_unused=True)
            for buf, gb in zip(bufs, grads):
                gb = torch.zeros_like(buf) if gb is None else gb
                outs.append(start_out(gb, layout.lens, layout.rank, layout.world, layout.group,
                                      f"the input-gradient exchange of head group {g}"))
            if kb_need and grads[-1] is not None:
                kb_grad = grads[-1] if kb_grad is None else kb_grad + grads[-1]
        k = 0
        for g, (a, b) in enumerate(layout.heads):
            for idx in layout.buckets.values():
                place(outs[k].result(layout.timeout, layout.fn), [dxs[i] for i in idx], a, b, layout.world)
                k += 1
        if kb_need:
            kb_grad = torch.zeros_like(kb_leaf) if kb_grad is None else kb_grad.contiguous()
            wait(dist.all_reduce(kb_grad, group=layout.group, async_op=True), layout.timeout, layout.fn,
                 "the key_bias gradient's all-reduce")
        return (None, None, None, kb_grad, *dxs)


def _dtypes(layout: _Layout, n: int):
    out = [None] * n
    for dt, idx in layout.buckets.items():
        for i in idx:
            out[i] = dt
    return out


def run(attn: Callable, xs: Sequence[Optional[Tensor]], key_bias: Optional[Tensor], lens: List[int], rank: int,
        world: int, group, groups: int, timeout: Optional[timedelta], fn: str) -> Tensor:
    """This rank's output shard of ``attn`` (called per head group as ``attn(q, k, v, gate,
    key_bias)`` on ``(B, T, hg, D)`` views) over the sharded ``xs`` (q, k, v, gate)."""
    layout = _Layout(xs, lens, rank, world, groups, group, fn, timeout)
    grad = torch.is_grad_enabled() and (any(x is not None and x.requires_grad for x in xs)
                                        or (key_bias is not None and key_bias.requires_grad))
    if not grad:
        return _forward(layout, xs, lambda *h: attn(*h, key_bias), keep_graph=False)[0]
    kb_leaf = None
    if key_bias is not None and key_bias.requires_grad:
        kb_leaf = key_bias.detach().requires_grad_()
    bias = key_bias if kb_leaf is None else kb_leaf
    return _Pipelined.apply(layout, lambda *h: attn(*h, bias), [kb_leaf], key_bias, *xs)
