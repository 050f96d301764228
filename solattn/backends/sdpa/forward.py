"""The portable forward: group query blocks, size chunks by the memory model, gather, call SDPA."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ...budget import BUDGETS
from ...config import current_tuning
from ...routing import Plan, live_token_mask
from ...routing.stats import parallel_cpu, serial_cpu
from ...validation import BLOCK, Problem
from ..base import add_coarse
from . import masks
from .grouping import Group, group_rows, needs_mask, split_rows
from .layout import BlockTable, QueryBlocks, RowTable, Workspace, zero_dead
from .tail import TailRows, append_tail, tail_rows
from .tuning import SdpaTuning
from .memory import (TAIL_ROWS, ChunkShape, fixed_bytes, layout_bytes, packs_kv, pairs_per_layout,
                     residual_tokens, rows_per_chunk, slice_bytes_per_row)

#: working memory beyond inputs, output and the routing plan, bytes (``solattn.set_memory_budget``,
#: ``solattn.memory_budget`` or ``SOLATTN_SDPA_BUDGET``; 1 GiB by default)
budget = BUDGETS["sdpa"]


def new_output(shape, dtype, device) -> torch.Tensor:
    """The output buffer every element of which the backend writes (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


@dataclass
class _Call:
    """What every chunk of one call reads."""

    p: Problem
    plan: Plan
    q: RowTable
    k: RowTable
    v: RowTable
    indices: torch.Tensor              # (B H n, M) int64 exact key blocks per row
    slot_bias: Optional[torch.Tensor]  # (Bk n, 64) fp32 per key slot, or None
    slot_entries: Optional[torch.Tensor]  # (n, 64) the same in the mask dtype when it is only
                                          # 0 / -inf (dead slots, no key_bias), else None
    live: Optional[torch.Tensor]       # (n, 64) bool live rows, when block_len is given
    out: RowTable                      # row numbers of the (contiguous) output
    mdt: torch.dtype
    work: Workspace
    tune: SdpaTuning
    wide: bool                         # the caller has SdpaTuning.chunk_threads threads or more
    tail_mean: Optional[torch.Tensor] = None  # (B H n,) fp32 mean tail residual per query block


@dataclass
class _Layouts:
    """The block layouts of one run of (batch, head) pairs: keys and values, and in inference the
    queries in the chunks' order, which become the output (with autograd recording, None: rows
    of q and of the output)."""

    k: BlockTable
    v: BlockTable
    q: Optional[QueryBlocks] = None


def sdpa_forward(p: Problem, plan: Plan, nbytes: Optional[int] = None) -> torch.Tensor:
    """SPEC.md's output for ``p`` from ``plan`` through SDPA. ``(B, T, H, D)``, v's dtype.

    On the CPU: one intra-op thread but for the ops at or above :class:`SdpaTuning`'s thresholds."""
    threads = torch.get_num_threads()
    with serial_cpu(p.device.type == "cpu"):
        return _forward(p, plan, nbytes, threads)


def _forward(p: Problem, plan: Plan, nbytes: Optional[int], threads: int) -> torch.Tensor:
    B, T, H, D, n = p.B, p.T, p.H, p.D, p.n
    dev, dt = p.device, p.dtype
    nbytes = nbytes or budget.bytes
    tail = plan.tail_lse is not None
    grad = p.requires_grad or (torch.is_grad_enabled() and p.key_bias is not None
                               and p.key_bias.requires_grad)
    slot_bias = masks.key_slot_bias(p, plan)
    # rows are written into the flat base, not through a view of it: under autograd an in-place
    # write through a view records CopySlices, whose backward calls as_strided, which has no
    # batching rule when the gradients are vmapped (jacobian(vectorize=True), torch.func.jacrev)
    # (and the (B, T, H, D) view is taken after the writes: one taken before them would be
    # replayed through as_strided too)
    flat = new_output((B * T * H, D), dt, dev)
    mdt = masks.mask_dtype(dev, dt)
    tune = current_tuning(SdpaTuning)
    call = _Call(p=p, plan=plan, q=RowTable(p.q), k=RowTable(p.k), v=RowTable(p.v),
                 out=RowTable(flat.view(B, T, H, D)),
                 indices=plan.kv_indices.reshape(B * H * n, -1).long(),
                 slot_bias=None if slot_bias is None else slot_bias.flatten(0, 1),
                 slot_entries=(None if slot_bias is None or masks.all_keys_can_die(p)
                               else slot_bias.flatten(0, 1).to(mdt)),
                 live=live_token_mask(plan.block_len) if p.block_len is not None else None,
                 mdt=mdt, work=Workspace(enabled=not grad), tune=tune, wide=threads >= tune.chunk_threads)
    masked = needs_mask(plan, p.key_bias is not None, tail)
    rows = torch.arange(B * H * n, device=dev)
    chunk_budget = nbytes - fixed_bytes(B, T, H, n, 0 if slot_bias is None else slot_bias.shape[0],
                                        masked is not None, tail)
    row_mask = None
    if tail:   # before any layout or chunk exists, so the pass may use the whole chunk budget
        step = residual_tokens(chunk_budget, B, H, D, dev)
        with parallel_cpu(B * min(step, T) * H * D * 4 >= call.tune.parallel_bytes):   # fp32 copies of q
            tail_mean, row_mask = masks.tail_residuals(p, plan, step)
        call.tail_mean, row_mask = tail_mean.reshape(-1), row_mask.reshape(-1)
    groups = group_rows(plan.kv_num_blocks.reshape(-1),
                        None if masked is None else masked.reshape(-1),
                        None if T % BLOCK == 0 else rows % n == n - 1, row_mask)
    elt, mask_elt = torch.finfo(dt).bits // 8, torch.finfo(call.mdt).bits // 8
    # Keys and values (in inference the queries too) laid out as contiguous blocks per run of
    # (batch, head) pairs, when one pair's layouts fit in half the budget (the common case); else
    # rows straight from the inputs. Whole blocks move faster than rows, in fewer ops.
    tables = 3 if call.work.enabled else 2
    run = pairs_per_layout(chunk_budget, B * H, n, D, elt, tables)
    if run:
        chunk_budget -= layout_bytes(run, n, D, elt, tables)
    edges = list(range(0, B * H, run or B * H)) + [B * H]
    plans = []
    for g in groups:
        shape = ChunkShape(q_rows=T - BLOCK * (n - 1) if g.ragged else BLOCK, key_blocks=g.count,
                           D=D, elt=elt, mask_elt=mask_elt if g.masked else 0, tail=tail,
                           blocks=bool(run), row_mask=g.row_mask, packed_kv=packs_kv(dev, dt))
        cuts = torch.searchsorted(g.rows, torch.tensor(edges, device=dev) * n).tolist()
        plans.append((g, shape, cuts))
    # Index tables of a slice of rows (q and output row numbers, key block numbers, tail terms)
    # are built for many chunks at once: per-chunk index arithmetic made the GPU wait on the
    # host. They may take a sixteenth of the chunk budget.
    slice_budget = chunk_budget // 16
    chunk_budget -= slice_budget
    for e in range(len(edges) - 1):
        kv = None
        big_layout = (edges[e + 1] - edges[e]) * T * D * elt >= call.tune.parallel_bytes
        if run:
            first, last = edges[e], edges[e + 1]
            with parallel_cpu(big_layout):
                kv = _Layouts(BlockTable(p.k, first, last, call.live, call.work, "kb"),
                              BlockTable(p.v, first, last, call.live, call.work, "vb"))
            if tables == 3:        # the run's query blocks in the order the chunks below take them
                order = torch.cat([g.rows[cuts[e]:cuts[e + 1]] for g, _, cuts in plans])
                kv.q = QueryBlocks(call.q, order, H, n, call.live, call.work, "qb", big_layout)
        start = 0                  # position of the group's first row of this run in kv.q
        for g, shape, cuts in plans:
            step = rows_per_chunk(chunk_budget, shape, dev)
            span = max(step, slice_budget // slice_bytes_per_row(shape) // step * step)
            for s0 in range(cuts[e], cuts[e + 1], span):
                sl = _prepare(call, g, g.rows[s0:min(s0 + span, cuts[e + 1])], shape, kv,
                              start + s0 - cuts[e])
                for chunk in sl.split(step):
                    _attend_rows(call, g, chunk, shape, flat, kv)
                del sl
            start += cuts[e + 1] - cuts[e]
        if kv is not None and kv.q is not None:
            kv.q.flush(flat.view(B, T, H, D), edges[e], edges[e + 1], call.work, "kb")
        del kv
    out = flat.view(B, T, H, D)
    if plan.coarse is not None and p.coarse_gate is not None:
        out = _add_coarse(out, p.coarse_gate, plan.coarse, nbytes, grad, call.tune.parallel_bytes)
    return out


@dataclass
class _Slice:
    """Per-row index tables of consecutive rows of one group (one run of pairs), sliced per chunk."""

    N: int
    rows: torch.Tensor                 # (N,) row numbers (b H + h) n + i
    b: torch.Tensor
    h: torch.Tensor
    i: torch.Tensor
    blocks: torch.Tensor               # (N, count) exact key blocks
    q_rows: Optional[torch.Tensor]     # (N, Lq) row numbers of the query rows in q (None: layouts)
    out_rows: Optional[torch.Tensor]   # (N, Lq) the same in the output
    q_dead: Optional[torch.Tensor]     # (N, Lq) bool dead query rows (block_len), or None
    kv_idx: Optional[torch.Tensor]     # (N, count [+ 1]) block numbers in the run's BlockTables
    q_pos: Optional[int]               # position of the first row in the run's QueryBlocks
    tail: Optional["TailRows"] = None

    def split(self, step: int) -> List["_Slice"]:
        """The slice cut into chunks of ``step`` rows: one ``split`` per table for the whole slice
        (each chunk's rows are then views at no further dispatch; slicing every table once per
        chunk made small problems host bound). A slice of one chunk is returned as it is."""
        if self.N <= step:
            return [self]
        chunks = split_rows((self.rows, self.b, self.h, self.i, self.blocks, self.q_rows, self.out_rows,
                              self.q_dead, self.kv_idx), step)
        tails = self.tail.split(step) if self.tail is not None else [None] * len(chunks)
        return [_Slice(tables[0].shape[0], *tables, q_pos=None if self.q_pos is None else self.q_pos + c * step,
                       tail=tail) for c, (tables, tail) in enumerate(zip(chunks, tails))]


def _prepare(call: _Call, g: Group, rows: torch.Tensor, s: ChunkShape, kv: Optional[_Layouts],
             position: int) -> _Slice:
    """The index tables of ``rows``, which sit at ``position`` in the run's query blocks."""
    H, n = call.p.H, call.p.n
    Lq = s.q_rows
    b, h, i = rows // (H * n), (rows // n) % H, rows % n
    blocks = call.indices[rows, :g.count]
    q_rows = out_rows = q_dead = q_pos = None
    if kv is not None and kv.q is not None:
        q_pos = position
    else:
        q_rows = call.q.block_rows(b, h, i[:, None], Lq)
        out_rows = (q_rows if call.out.row_strides == call.q.row_strides
                    else call.out.block_rows(b, h, i[:, None], Lq))
        q_dead = ~call.live[i, :Lq] if call.live is not None else None
    kv_idx = kv.k.block_index(rows // n, blocks, TAIL_ROWS if s.tail else 0) if kv is not None else None
    tail = None
    if s.tail and g.masked:
        tail = tail_rows(call, b, h, i, None if g.row_mask else call.tail_mean[rows])
    return _Slice(N=rows.shape[0], rows=rows, b=b, h=h, i=i, blocks=blocks, q_rows=q_rows,
                  out_rows=out_rows, q_dead=q_dead, kv_idx=kv_idx, q_pos=q_pos, tail=tail)


def _attend_rows(call: _Call, g: Group, sl: _Slice, s: ChunkShape, flat: torch.Tensor, kv=None):
    """One SDPA call for the rows of chunk ``sl`` (see :meth:`_Slice.split`) of group ``g``; writes
    their output rows into ``flat``, the output as ``(B T H, D)`` rows.
    ``kv``: the :class:`_Layouts` holding these rows' pairs, or None (gather rows).

    With autograd recording, the chunk is a checkpoint: autograd keeps none of its gathered keys
    and values (which, over every chunk, would be the kept fraction of a T x T x D tensor: tens of
    GB at B=1, T=37296, H=56) and gathers them again, one chunk at a time, in the backward pass."""
    if call.work.enabled:
        o = _chunk_output(call, g, sl, s, kv)
    else:
        o = checkpoint(_chunk_output, call, g, sl, s, kv, use_reentrant=False,
                       preserve_rng_state=False)                # nothing random inside
    if sl.q_pos is not None:
        with parallel_cpu(_chunk_parallel(call, o.numel() * o.element_size())):
            kv.q.put(sl.q_pos, o)
    else:
        flat.index_copy_(0, sl.out_rows.reshape(-1), o.reshape(-1, call.p.D))


def _chunk_output(call: _Call, g: Group, sl: _Slice, s: ChunkShape, kv) -> torch.Tensor:
    """The ``(nr, Lq, D)`` attention output of the rows of chunk ``sl`` (see :func:`_attend_rows`)."""
    p, work = call.p, call.work
    count = g.count
    b, h, blocks = sl.b, sl.h, sl.blocks

    if sl.q_pos is not None:                     # a slice of the run's blocks; dead rows zero
        q = kv.q.chunk(sl.q_pos, sl.N, s.q_rows)                         # (nr, Lq, D)
    else:
        q = call.q.gather(sl.q_rows, work, "q")                          # (nr, Lq, D)
    if sl.q_dead is not None:                    # dead rows enter nothing, even holding NaN
        q = zero_dead(q, sl.q_dead)
    if kv is not None:                           # whole blocks; dead rows already zero
        extra = TAIL_ROWS if s.tail else 0
        with parallel_cpu(sl.N * s.gathered_keys * p.D * s.elt >= call.tune.parallel_bytes):
            k = kv.k.take(sl.kv_idx, count, extra, work, "gk")        # (nr, L, D)
            v = kv.v.take(sl.kv_idx, count, extra, work, "gv")
    else:
        k_rows = call.k.block_rows(b, h, blocks)                             # (nr, count * 64)
        v_rows = (call.v.block_rows(b, h, blocks) if call.v.row_strides != call.k.row_strides
                  else k_rows)
        if s.tail:  # slots for the tail rows, overwritten in append_tail
            k_rows = torch.cat([k_rows, k_rows[:, :TAIL_ROWS]], dim=1)
            v_rows = torch.cat([v_rows, v_rows[:, :TAIL_ROWS]], dim=1)
        k = call.k.gather(k_rows, work, "k")                                 # (nr, L, D)
        v = call.v.gather(v_rows, work, "v")
        if call.live is not None:
            dead_keys = ~call.live[blocks].flatten(1)
            if s.tail:
                dead_keys = F.pad(dead_keys, (0, TAIL_ROWS))
            k, v = zero_dead(k, dead_keys), zero_dead(v, dead_keys)

    mask = dead = None
    if g.masked:
        with parallel_cpu(_chunk_parallel(call, sl.N * (s.q_rows if s.row_mask else 1) * s.keys * 4)):
            k, v, mask, dead = _chunk_mask(call, sl, s, q, k, v, kv is not None)
    o = _sdpa(call, q, k, v, mask)                                       # (nr, Lq, D)
    # every term -inf: SPEC.md says 0, not NaN. Off the CPU the select runs unconditionally:
    # testing for a dead row first would stall the device queue once per SDPA call.
    if dead is not None and (o.device.type != "cpu" or bool(dead.any())):
        o = torch.where(dead[..., None], torch.zeros((), dtype=o.dtype, device=o.device), o)
    return o


def _chunk_parallel(call: _Call, nbytes: int) -> bool:
    """Whether a small per-chunk pass of ``nbytes`` takes the caller's threads (SdpaTuning.chunk_threads)."""
    return call.wide and nbytes >= call.tune.parallel_bytes


def _chunk_mask(call: _Call, sl: _Slice, s: ChunkShape, q, k, v, from_layouts: bool):
    """``(k, v, mask, dead)`` of a masked chunk: the tail slots filled (see :func:`.tail.append_tail`)
    or the key bias and dead slots as a mask; ``dead``: query rows that lose every term, or None."""
    p, b, blocks = call.p, sl.b, sl.blocks
    mask = dead = None
    if s.tail:
        base = None
        if call.slot_entries is not None:
            base = _slot_rows(call, b, blocks, call.slot_entries)            # mask dtype, 0 / -inf
        elif call.slot_bias is not None:
            base = _key_bias_rows(call, b, blocks)
        k, v, mask, dead = append_tail(call, q, k, v, base, sl.tail, zeroed=from_layouts)
    elif call.slot_entries is not None:          # dead slots only: the entries as they are
        mask = _slot_rows(call, b, blocks, call.slot_entries)[:, None, None, :]
    else:
        base = _key_bias_rows(call, b, blocks)                               # (nr, count * 64) fp32
        if masks.all_keys_can_die(p):
            dead = torch.isneginf(base).all(dim=1)[:, None]                  # (nr, 1)
        mask = masks.finish_mask(base, call.mdt)[:, None, None, :]
    return k, v, mask, dead


def _sdpa(call: _Call, q, k, v, mask) -> torch.Tensor:
    """``(nr, Lq, D)``: one SDPA call, each query block (``q``: ``(nr, Lq, D)``) against its keys
    (``k``, ``v``: ``(nr, L, D)``; ``mask``: ``(nr, 1, 1 or Lq, L)`` or None) as one head of
    ``(1 or 64 / query_rows, nr, rows, D)`` views (items of ``tune.query_rows`` rows share keys,
    stride-0; see SdpaTuning). As a batch of one-head items, PyTorch's CPU flash kernel ran 68 bf16
    blocks x 960 keys (D=128) in 16 ms on 16 AMX cores, as heads 1.7 ms (one core: 16.6, 18.6)."""
    nr, Lq, D = q.shape
    L, rows = k.shape[1], call.tune.query_rows
    split = Lq // rows if rows < Lq and Lq % rows == 0 else 1
    mask = None if mask is None else mask.transpose(0, 1)           # (1, nr, 1 or Lq, L)
    with parallel_cpu(4 * nr * Lq * L * D >= call.tune.parallel_flops):
        if split == 1:
            return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                                  scale=call.p.scale)[0]
        if mask is not None and mask.shape[2] > 1:
            mask = mask.reshape(nr, split, rows, L).transpose(0, 1)  # (split, nr, rows, L)
        o = F.scaled_dot_product_attention(q.reshape(nr, split, rows, D).transpose(0, 1),
                                           k[None].expand(split, nr, L, D), v[None].expand(split, nr, L, D),
                                           attn_mask=mask, scale=call.p.scale)    # (split, nr, rows, D)
    return o.transpose(0, 1).reshape(nr, Lq, D)


def _key_bias_rows(call: _Call, b: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``(nr, count * 64)`` fp32 additive bias of the gathered key slots (zeros without a bias table)."""
    if call.slot_bias is None:
        return torch.zeros(blocks.shape[0], blocks.shape[1] * BLOCK, dtype=torch.float32, device=blocks.device)
    return _slot_rows(call, b, blocks, call.slot_bias)


def _slot_rows(call: _Call, b: torch.Tensor, blocks: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``(nr, count * 64)``: the rows of a per-slot ``table`` (``(n, 64)``, or ``(B n, 64)`` per
    batch) for key blocks ``blocks`` (``(nr, count)``) of batches ``b``; one gather."""
    nr, count = blocks.shape
    n = call.p.n
    rows = blocks + b[:, None] * n if table.shape[0] > n else blocks
    return table.index_select(0, rows.reshape(-1)).view(nr, count * BLOCK)


def _add_coarse(out: torch.Tensor, gate: torch.Tensor, coarse: torch.Tensor, nbytes: int,
                grad: bool, parallel_bytes: int) -> torch.Tensor:
    """``out + (gate * coarse_of_block).to(dtype)`` (:func:`add_coarse`), in chunks of tokens whose
    fp32 terms fit ``nbytes``; each chunk on the caller's threads from ``parallel_bytes`` up."""
    B, T, H, D = out.shape
    return add_coarse(out, gate, coarse, nbytes // max(1, B * H * D * 12), grad,
                      lambda size: parallel_cpu(size >= parallel_bytes))
