"""Gathering 64-row blocks of (batch, head) pairs: from block layouts, or straight from the caller's tensors.

When a run of (batch, head) pairs fits the budget, its keys and values (and, in inference, its
queries) are laid out once as contiguous 64-row blocks (:class:`BlockTable`, :class:`QueryBlocks`),
and every chunk moves whole blocks. Otherwise no copy of a whole head is
made: a ``(B, T, H, D)`` tensor with any strides is read as a table of D-element rows
(:class:`RowTable`), and a chunk's query, key and value blocks are ``index_select``-ed from it
by row number. Working memory is then the chunk's gathers only, whatever T and H are.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ...routing.stats import parallel_cpu
from ...validation import BLOCK


class Workspace:
    """Scratch buffers reused by every chunk of one call in inference. With gradients
    (``enabled=False``) every request allocates, since ``out=`` ops do not record autograd."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.buffers = {}

    def empty(self, name: str, shape, dtype, device) -> torch.Tensor:
        if not self.enabled:
            return torch.empty(shape, dtype=dtype, device=device)
        numel = math.prod(shape)
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = self.buffers[name] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel].view(shape)


class RowTable:
    """A ``(B, T, H, D)`` tensor as rows of D elements addressed by ``(b, t, h)``.

    The rows are an ``as_strided`` view of the tensor's own storage with row stride
    ``g = gcd`` of the b, t and h strides, so row ``(b, t, h)`` is number
    ``(b sB + t sT + h sH) / g``. That holds for every stride pattern (contiguous, permuted
    from ``(B, H, T, D)``, sliced), so no layout copy is needed.
    """

    def __init__(self, x: torch.Tensor):
        B, T, H, D = x.shape
        if x.requires_grad:
            self.rows, self.row_strides = _row_view(x)
        else:
            strides = [s if size > 1 else 0 for s, size in zip(x.stride()[:3], (B, T, H))]
            g = math.gcd(*strides) or 1
            self.row_strides = tuple(s // g for s in strides)        # rows per step in b, t, h
            rows = sum((size - 1) * s for size, s in zip((B, T, H), self.row_strides)) + 1
            self.rows = x.as_strided((rows, D), (g, x.stride(3)))
        self.D, self.T = D, T
        n = (T + BLOCK - 1) // BLOCK
        # row offset of every (block, slot); slots past T read token T - 1 (the caller masks them)
        tokens = torch.arange(n * BLOCK, device=x.device).clamp_(max=T - 1)
        self.slot_rows = (tokens * self.row_strides[1]).view(n, BLOCK)

    def block_rows(self, b: torch.Tensor, h: torch.Tensor, blocks: torch.Tensor,
                   slots: int = BLOCK) -> torch.Tensor:
        """``(N, count * slots)`` row numbers of the first ``slots`` rows of key or query blocks
        ``blocks`` (``(N, count)``) of (batch, head) pairs ``b``, ``h`` (``(N,)``): one gather and one
        add per chunk."""
        sb, _, sh = self.row_strides
        base = (b * sb + h * sh)[:, None, None]
        rows = self.slot_rows[:, :slots][blocks]                             # (N, count, slots)
        return rows.add_(base).flatten(1)

    def gather(self, rows: torch.Tensor, work: Workspace, name: str) -> torch.Tensor:
        """``(*rows.shape, D)``: the rows, in a reused buffer when ``work`` is enabled."""
        flat = rows.reshape(-1)
        if not work.enabled:
            return self.rows.index_select(0, flat).view(*rows.shape, self.D)
        buf = work.empty(name, (flat.numel(), self.D), self.rows.dtype, self.rows.device)
        return torch.index_select(self.rows, 0, flat, out=buf).view(*rows.shape, self.D)


def _row_view(x: torch.Tensor):
    """``(rows, row_strides)`` of a ``(B, T, H, D)`` tensor through view operations only, for the
    autograd path: ``as_strided``'s backward has no batching rule when the gradients are vmapped
    (``torch.autograd.functional.jacobian(vectorize=True)``, ``torch.func.jacrev``), while
    ``permute`` and ``view`` have. The b, t, h dims are put outermost-stride first, so a
    contiguous tensor and a ``(B, H, T, D)`` one transposed to ``(B, T, H, D)`` are viewed, not
    copied; strides that do not nest (a slice of a packed qkv tensor) are copied once."""
    order = sorted(range(3), key=lambda i: -x.stride(i))
    y = x.permute(*order, 3)
    if not y.is_contiguous():
        y = y.contiguous()
    rows = y.view(-1, x.shape[3])
    sizes = y.shape[:3]
    step = (sizes[1] * sizes[2], sizes[2], 1)            # rows per step in y's first three dims
    row_strides = [0, 0, 0]
    for pos, dim in enumerate(order):
        row_strides[dim] = step[pos]
    return rows, tuple(row_strides)


def zero_dead(x: torch.Tensor, dead: Optional[torch.Tensor]) -> torch.Tensor:
    """Zero the dead slots (``dead``: ``x.shape[:-1]`` bool) so that nothing in a dead row,
    not even a NaN, reaches the arithmetic. In place in inference, out of place with autograd."""
    if dead is None:
        return x
    if x.requires_grad:
        return x.masked_fill(dead[..., None], 0)
    return x.masked_fill_(dead[..., None], 0)


class BlockTable:
    """The keys, values or queries of a run of (batch, head) pairs laid out as contiguous 64-row blocks.

    ``blocks`` is ``(pairs * n + 1, 64, D)``: block ``(P - first) n + j`` is key block ``j`` of
    pair ``P = b H + h``, and the last block is zeros (the tail slots gather it). One strided
    pass over the input builds it, after which every gather moves whole blocks (16 KB in bf16 at
    D = 128) instead of D-element rows: on an H200 row gathers ran about 3x slower. Rows past T
    and dead rows (``live`` False) are zeroed here once, so nothing in them, not even a NaN,
    reaches the arithmetic.

    In inference, an input whose heads are already contiguous ``(T, D)`` rows (``(B, H, T, D)``
    memory transposed to ``(B, T, H, D)``, as hosts that attend in that layout pass it), with T a
    multiple of 64 and no dead rows, is its own layout: ``blocks`` is a view of it, nothing is
    copied, and :meth:`take` zeroes the tail rows it gathers (there is no zero block).
    """

    def __init__(self, x: torch.Tensor, first: int, last: int, live: Optional[torch.Tensor],
                 work: Workspace, name: str):
        B, T, H, D = x.shape
        n = (T + BLOCK - 1) // BLOCK
        self.first, self.n, self.D = first, n, D
        pairs = last - first
        heads_first = x.permute(0, 2, 1, 3)
        if work.enabled and live is None and T % BLOCK == 0 and heads_first.is_contiguous():
            self.flat = heads_first.reshape(B * H * n, BLOCK * D)[first * n:last * n]
            self.zero_block = None
            return
        buf = work.empty(name, (pairs * n + 1, BLOCK, D), x.dtype, x.device)
        heads = buf[:pairs * n].view(pairs, n * BLOCK, D)
        for b, h0, h1, off in _pair_spans(B, H, first, last):   # one strided copy per batch
            heads[off:off + h1 - h0, :T].copy_(x[b, :, h0:h1].transpose(0, 1))
        if n * BLOCK > T:
            heads[:, T:].zero_()
        if live is not None:
            heads.view(pairs, n, BLOCK, D).masked_fill_(~live[None, :, :, None], 0)
        buf[pairs * n:].zero_()
        self.flat = buf.view(-1, BLOCK * D)
        self.zero_block = pairs * n

    def block_index(self, pairs: torch.Tensor, blocks: torch.Tensor, extra_rows: int) -> torch.Tensor:
        """``(N, count [+ 1])`` numbers into this table of key blocks ``blocks`` (``(N, count)``) of
        pairs ``pairs`` (``(N,)``), plus the zero block when ``extra_rows`` are asked for (a view
        of the input has none: its first block, whose rows :meth:`take` zeroes)."""
        idx = (pairs - self.first)[:, None] * self.n + blocks
        if extra_rows:
            extra = idx[:, :1] if self.zero_block is None else idx.new_full((idx.shape[0], 1), self.zero_block)
            idx = torch.cat([idx, extra], dim=1)
        return idx

    def take(self, idx: torch.Tensor, count: int, extra_rows: int, work: Workspace, name: str) -> torch.Tensor:
        """``(N, count * 64 + extra_rows, D)``: the blocks ``idx`` (from :meth:`block_index`); with
        extra rows the result is a view whose batch stride is ``(count + 1) 64 D``: one whole zero
        block is gathered and its first ``extra_rows`` rows are kept."""
        N = idx.shape[0]
        flat = idx.reshape(-1)
        if work.enabled:
            buf = work.empty(name, (flat.numel(), BLOCK * self.D), self.flat.dtype, self.flat.device)
            g = torch.index_select(self.flat, 0, flat, out=buf)
        else:
            g = self.flat.index_select(0, flat)
        g = g.view(N, idx.shape[1] * BLOCK, self.D)[:, :count * BLOCK + extra_rows]
        if extra_rows and self.zero_block is None:       # inference only: g is the workspace's
            g[:, count * BLOCK:].zero_()
        return g


def _pair_spans(B: int, H: int, first: int, last: int):
    """``(b, h0, h1, offset)`` for each batch the pairs ``[first, last)`` touch: heads ``[h0, h1)``
    of batch ``b`` are pairs ``offset .. offset + h1 - h0`` of the run."""
    P = first
    while P < last:
        b, h = divmod(P, H)
        h1 = min(H, h + last - P)
        yield b, h, h1, P - first
        P += h1 - h


class QueryBlocks:
    """The queries of a run of (batch, head) pairs as contiguous 64-row blocks in the order the
    chunks take them, each block then overwritten by its output.

    ``rows``: ``(N,)`` the run's query blocks (``(b H + h) n + i``) in that order. One row gather
    from the caller's q builds it (no per-chunk gather: a chunk's queries are the slice
    :meth:`chunk`); each chunk writes its output over the queries it has consumed (:meth:`put`, a
    contiguous copy); :meth:`flush` gathers the rows into the ``(B, T, H, D)`` output, in place of
    a scatter per chunk (an element-wise ``index_copy_``: 1.4 GB/s on a 16-core Xeon) and a
    transposed copy of the whole output. Dead query rows (``live`` False) are zeroed, so nothing in
    them, not even a NaN, reaches the arithmetic; slots past T hold token T - 1 and are never read
    (the ragged last block is attended with its live rows only). ``parallel``: the row gathers
    run on the caller's threads (see :func:`solattn.routing.stats.parallel_cpu`), the index
    arithmetic on the forward's one.
    """

    def __init__(self, q: RowTable, rows: torch.Tensor, H: int, n: int, live: Optional[torch.Tensor],
                 work: Workspace, name: str, parallel: bool):
        N, D = rows.shape[0], q.D
        self.rows, self.H, self.n, self.parallel = rows, H, n, parallel
        i = rows % n
        slots = q.block_rows(rows // (H * n), (rows // n) % H, i[:, None])          # (N, 64)
        self.blocks = work.empty(name, (N, BLOCK, D), q.rows.dtype, q.rows.device)
        with parallel_cpu(parallel):
            torch.index_select(q.rows, 0, slots.view(-1), out=self.blocks.view(N * BLOCK, D))
            if live is not None:
                self.blocks.masked_fill_(~live[i][:, :, None], 0)

    def chunk(self, start: int, count: int, rows: int) -> torch.Tensor:
        """``(count, rows, D)``: the query blocks at positions ``[start, start + count)``, a view."""
        return self.blocks[start:start + count, :rows]

    def put(self, start: int, o: torch.Tensor) -> None:
        """Write a chunk's output ``o`` (``(N, Lq, D)``, any strides) over its query blocks."""
        self.blocks[start:start + o.shape[0], :o.shape[1]].copy_(o)

    def flush(self, out: torch.Tensor, first: int, last: int, work: Workspace, scratch: str) -> None:
        """Gather the outputs of pairs ``[first, last)`` into ``out`` (``(B, T, H, D)``, contiguous):
        straight into it for whole batches, else through the workspace's buffer ``scratch`` (the
        run's key layout, done with) and one strided copy per batch."""
        B, T, H, D = out.shape
        n = self.n
        N = self.rows.shape[0]
        position = torch.empty(N, dtype=torch.int64, device=self.rows.device)
        position[self.rows - first * n] = torch.arange(N, device=self.rows.device)
        position = position.view(last - first, n)
        src = self.blocks.view(N * BLOCK, D)
        token = torch.arange(n * BLOCK, device=src.device)[:T]
        slot = token % BLOCK
        for b, h0, h1, off in _pair_spans(B, H, first, last):
            heads = h1 - h0
            # row of token t of pair (b, h) in the blocks: its block's position * 64 + t % 64
            idx = (position[off:off + heads].t()[token // BLOCK] * BLOCK + slot[:, None]).view(-1)  # (T heads,)
            with parallel_cpu(self.parallel):
                if heads == H:
                    torch.index_select(src, 0, idx, out=out[b].view(T * H, D))
                else:
                    part = work.empty(scratch, (T * heads, D), out.dtype, out.device)
                    torch.index_select(src, 0, idx, out=part)
                    out[b, :, h0:h1].copy_(part.view(T, heads, D))
