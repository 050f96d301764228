"""The transposed selection of an n-wide plan (:meth:`.plan.Plan.query_lists`) in one Triton
kernel; importing this module imports Triton.

The torch path builds the query lists from a dense mask in about a dozen small operations, each
20-40 us of host time on a GPU; here they take one launch and the two outputs' allocations, and
no host synchronisation. It runs where Triton runs (:func:`solattn.triton_runtime.triton_runs_on`);
the torch path stays for every other plan and device (see :meth:`.plan.Plan.query_lists`).

:func:`query_lists_kernel` runs one program per (tile of BJ key blocks, batch * head). A program
owns the rows ``j0 .. j0 + BJ`` of ``q_indices`` of its batch * head and uses them as its scratch,
so no program reads what another writes and nothing else is allocated:

1. it zeroes its rows;
2. it marks ``q_indices[j, i] = 1`` for every query block i whose list holds a key block j of its
   tile: the lists are ascending, so a binary search finds where each list reaches ``j0`` and the
   next BJ entries at most lie in the tile;
3. it compacts each of its rows in place, left to right: chunk by chunk, the marked columns i go
   to positions ``count + cumsum - 1`` (never past the chunk being read), then every position
   from the row's count on is zeroed, and the count is written to ``q_num_blocks``.

Barriers separate the phases (and each chunk's read from its writes), which order the global
memory traffic of the program's threads as they do in the fused plan's select kernel.
"""

from __future__ import annotations

from typing import Tuple

import torch
import triton.language as tl

from ..triton_runtime import interpret_on, on_device, pow2
from ..triton_runtime.jit import compiled, gpu_jit

#: elements of one program's largest register tile (its window of list entries, its chunk of
#: rows of q_indices): a few thousand, as the fused plan's kernels keep
_TILE_ELEMS = 4096

#: list entries read per query block and step in the marking phase
_WINDOW = 16


@gpu_jit
def query_lists_kernel(KvNum, KvIdx, QNum, QIdx, n, H, steps,
                       snb, snh, sni, sib, sih, sii, sip,
                       BJ: tl.constexpr, BI: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr):
    """For the key blocks ``jj = j0 .. j0 + BJ`` of one batch * head (program ids: key-block tile,
    batch * head), the query blocks i whose list (``KvIdx[b, h, i, :KvNum[b, h, i]]``, ascending,
    any strides) holds them: ``QIdx[g, j]`` ascending then 0, and their count ``QNum[g, j]`` (both
    contiguous ``(B * H, n, ...)``). ``steps``: binary-search steps that settle any list of at most
    n entries (``n.bit_length()``). BI query blocks per search, BW list entries per step, BC columns
    per chunk of the zeroing and compaction."""
    g = tl.program_id(1).to(tl.int64)
    b, h = g // H, g % H
    j0 = tl.program_id(0) * BJ
    jj = j0 + tl.arange(0, BJ)
    j_ok = (jj < n)[:, None]
    out = QIdx + (g * n + jj)[:, None] * n                     # the rows this program owns
    cc = tl.arange(0, BC)
    none = tl.zeros([BJ, BC], tl.int32)

    for c0 in range(0, n, BC):                                 # 1. zero
        cols = (c0 + cc)[None, :]
        tl.store(out + cols, none, mask=j_ok & (cols < n))
    tl.debug_barrier()

    ww = tl.arange(0, BW)[None, :]
    for i0 in range(0, n, BI):                                 # 2. mark
        ii = i0 + tl.arange(0, BI)
        cnt = tl.load(KvNum + b * snb + h * snh + ii * sni, mask=ii < n, other=0)
        row = KvIdx + b * sib + h * sih + ii.to(tl.int64) * sii
        # lo: the first list position holding a key block >= j0 (lower bound within [0, cnt))
        lo = tl.zeros([BI], tl.int32)
        hi = cnt
        for _ in range(steps):
            open_ = lo < hi
            mid = (lo + hi) >> 1
            right = open_ & (tl.load(row + mid * sip, mask=open_, other=0) < j0)
            lo = tl.where(right, mid + 1, lo)
            hi = tl.where(open_ & ~right, mid, hi)
        for w0 in tl.static_range(0, BJ, BW):
            pos = lo[:, None] + w0 + ww
            listed = pos < cnt[:, None]
            j = tl.load(row[:, None] + pos * sip, mask=listed, other=0)
            hit = listed & (j < j0 + BJ)
            tl.store(QIdx + (g * n + j) * n + ii[:, None], tl.full([BI, BW], 1, tl.int32), mask=hit)
    tl.debug_barrier()

    count = tl.zeros([BJ], tl.int32)
    for c0 in range(0, n, BC):                                 # 3. compact in place
        cols = (c0 + cc)[None, :]
        mark = tl.load(out + cols, mask=j_ok & (cols < n), other=0)
        tl.debug_barrier()              # every thread has read the chunk before any writes into it
        pos = count[:, None] + tl.cumsum(mark, 1) - 1
        tl.store(out + pos, none + cols, mask=mark != 0)
        count += tl.sum(mark, 1)
    tl.debug_barrier()
    for c0 in range(0, n, BC):                                 # padding after the count
        cols = (c0 + cc)[None, :]
        tl.store(out + cols, none, mask=j_ok & (cols < n) & (cols >= count[:, None]))
    tl.store(QNum + g * n + jj, count, mask=jj < n)


def query_lists(kv_num_blocks: torch.Tensor, kv_indices: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The selection ``kv_num_blocks (B, H, n)``, ``kv_indices (B, H, n, n)`` (integers, each list
    ascending in its first ``kv_num_blocks`` entries; any strides; read as int32) transposed: ``(q_num_blocks
    (B, H, n), q_indices (B, H, n, n))`` int32, contiguous, for each key block j the query blocks
    whose list holds it, ascending, then 0. One launch, no host synchronisation: the result of
    :meth:`.plan.Plan.query_lists`'s torch path, bit for bit."""
    B, H, n = kv_num_blocks.shape
    dev = kv_indices.device
    # the binary search's bounds stay int32 across its loop only from int32 counts and entries (a
    # compiled kernel refuses a loop variable whose type changes; the interpreter does not check)
    kv_num_blocks, kv_indices = (t if t.dtype == torch.int32 else t.to(torch.int32)
                                 for t in (kv_num_blocks, kv_indices))
    q_num = torch.empty(B, H, n, dtype=torch.int32, device=dev)
    q_idx = torch.empty(B, H, n, n, dtype=torch.int32, device=dev)
    NP = pow2(n)
    # 8 or more programs per batch * head up to n = 128, then 64 key blocks each (10 at n = 583, 32
    # at 2048); the other tiles at about _TILE_ELEMS elements
    bj = min(64, max(16, NP // 8))
    bi = max(16, min(NP, _TILE_ELEMS // _WINDOW))
    bc = max(16, min(NP, _TILE_ELEMS // bj))
    launch = compiled(interpret_on(dev), query_lists_kernel)[(-(-n // bj), B * H)]
    args = (kv_num_blocks, kv_indices, q_num, q_idx, n, H, n.bit_length(), *kv_num_blocks.stride(),
            *kv_indices.stride())
    with on_device(dev):
        launch(*args, BJ=bj, BI=bi, BW=_WINDOW, BC=bc, num_warps=4)
    return q_num, q_idx


__all__ = ["query_lists", "query_lists_kernel"]
