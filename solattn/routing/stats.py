"""Block statistics: live lengths and fp32 means of q, k, v over the live rows of each block.

Everything downstream of this module works at block granularity: means are
``(B, H, n, D)``; nothing of size ``T x n`` or ``T x T`` is formed.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from ..budget import current_budget
from ..validation import BLOCK, Problem

#: fp32 bytes of one block-mean chunk off the CPU; bounds the upcast copy made while pooling
#: (further capped by a quarter of the memory budget in force)
_POOL_CHUNK_BYTES = 256 << 20

#: fp32 staging buffer of the CPU block means (stays in cache; reused chunk after chunk)
_CPU_POOL_CHUNK_BYTES = 8 << 20

#: intra-op threads from which the CPU block means' chunk ops run on all of them (see _block_sums_cpu)
_POOL_PARALLEL_THREADS = 4


_serial_lock = threading.RLock()
_serial_state = threading.local()


@contextlib.contextmanager
def serial_cpu(enabled: bool = True):
    """Run the enclosed CPU ops with one intra-op thread, then restore the thread count.

    The routing plan's CPU ops are small (block-level tensors, cache-sized chunks of the block
    means: well under a millisecond each). With several intra-op threads each of them is an
    OpenMP parallel region, and when other processes keep the cores busy every region waits for
    its descheduled workers: measured ~100x slower on a 2-core CPU (1 s instead of 10 ms) while
    one thread stayed at ~10 ms. Quiet, the second thread saved at most a few ms.

    ``torch.set_num_threads`` is the only knob and is process-wide in some builds, so the
    enclosed section holds a lock: plans in other Python threads wait for it (they would share
    the same cores anyway) and each section restores exactly the value it found. Re-entry from
    the same thread is a no-op. Other code running in another thread meanwhile may see one
    thread in builds whose thread count is global (OpenMP builds keep it per thread).
    """
    if not enabled or getattr(_serial_state, "depth", 0):
        yield
        return
    with _serial_lock:
        _serial_state.depth = 1
        before = _serial_state.before = torch.get_num_threads()
        try:
            if before != 1:
                torch.set_num_threads(1)
            yield
        finally:
            if before != 1:
                torch.set_num_threads(before)
            _serial_state.depth = 0


@contextlib.contextmanager
def parallel_cpu(enabled: bool = True):
    """Inside a :func:`serial_cpu` section of this thread, run the enclosed ops with the thread
    count that section found (for the few ops large enough to pay for a parallel region), then
    go back to one thread. Elsewhere, or with ``enabled`` False, a no-op."""
    before = getattr(_serial_state, "before", 1)
    if not enabled or not getattr(_serial_state, "depth", 0) or before == 1:
        yield
        return
    torch.set_num_threads(before)
    try:
        yield
    finally:
        torch.set_num_threads(1)


@dataclass(frozen=True, eq=False)
class BlockStats:
    """fp32 block means over live rows, ``(B, H, n, D)``, and the key centroid ``m`` ``(B, H, 1, D)``."""

    qm: torch.Tensor
    km: torch.Tensor
    vm: torch.Tensor
    m: torch.Tensor
    L: torch.Tensor  # (n,) int32 live rows per block


def live_lengths(problem: Problem) -> torch.Tensor:
    """``L_j`` (SPEC.md, "Blocks") as an ``(n,)`` int32 tensor on the problem's device."""
    n, T = problem.n, problem.T
    if problem.block_len is None:
        return _full_lengths(T, problem.device).clone()   # the plan exposes it: never share it
    L = problem.block_len.clamp(1, BLOCK).to(torch.int32)
    last = torch.full((1,), T - BLOCK * (n - 1), dtype=torch.int32, device=problem.device)
    return torch.cat([L[:-1], torch.minimum(L[-1:], last)])


# On a GPU the routing plan is launch-bound at small T, and this table depends only on
# (T, device); the cached tensor is never handed out (live_lengths clones it).
@functools.lru_cache(maxsize=64)
def _full_lengths(T: int, device: torch.device) -> torch.Tensor:
    n = (T + BLOCK - 1) // BLOCK
    L = torch.full((n,), BLOCK, dtype=torch.int32, device=device)
    L[-1] = T - BLOCK * (n - 1)
    return L


def live_token_mask(L: torch.Tensor) -> torch.Tensor:
    """``(n, 64)`` bool: row ``r`` of block ``j`` is live when ``r < L_j``."""
    return torch.arange(BLOCK, device=L.device)[None, :] < L[:, None]


def block_means(x: torch.Tensor, L: torch.Tensor, all_live: bool = False,
                chunk_bytes: Optional[int] = None) -> torch.Tensor:
    """Mean over the live rows of each 64-token block.

    ``x``: ``(B, T, H, D)`` any float dtype and strides; ``L``: ``(n,)`` int32; ``all_live``:
    the caller knows every row before T is live (no ``block_len``) or that the dead rows hold
    zeros, so no mask is applied.
    Returns ``(B, H, n, D)`` fp32. Sums read x in its own dtype and accumulate in fp32;
    masking (dead rows) works chunk by chunk, so at most ``chunk_bytes`` of temporaries exist
    at a time (default: 256 MiB, at most a quarter of the ``sdpa`` memory budget). No host
    synchronisation.
    """
    B, T, H, D = x.shape
    n = L.shape[0]
    if x.device.type == "cpu" and not (torch.is_grad_enabled() and x.requires_grad):
        return _block_means_cpu(x, L, all_live)
    if chunk_bytes is None:
        chunk_bytes = min(_POOL_CHUNK_BYTES, current_budget("sdpa") // 4)
    full = T // BLOCK                                                     # blocks with 64 rows in x
    sums = []
    if all_live:
        if full:
            sums.append(x[:, :full * BLOCK].unflatten(1, (full, BLOCK)).sum(dim=2, dtype=torch.float32))
        if full < n:                                                      # ragged last block
            sums.append(x[:, full * BLOCK:].sum(dim=1, keepdim=True, dtype=torch.float32))
    else:
        live = live_token_mask(L)                                         # (n, 64)
        step = max(1, chunk_bytes // (B * BLOCK * H * D * 4))
        for b0 in range(0, n, step):
            b1 = min(n, b0 + step)
            xs = x[:, b0 * BLOCK:min(b1 * BLOCK, T)]
            pad = (b1 - b0) * BLOCK - xs.shape[1]
            if pad:                                                       # ragged last block
                xs = torch.nn.functional.pad(xs, (0, 0, 0, 0, 0, pad))
            keep = live[b0:b1][None, :, :, None, None]                    # dead rows contribute 0,
            xs = torch.where(keep, xs.unflatten(1, (b1 - b0, BLOCK)), 0)  # even if they hold NaN
            sums.append(xs.sum(dim=2, dtype=torch.float32))
    return _means_from_sums(sums, L)


def _means_from_sums(sums, L: torch.Tensor) -> torch.Tensor:
    """Per-chunk ``(B, blocks, H, D)`` fp32 sums of live rows -> ``(B, H, n, D)`` means."""
    total = torch.cat(sums, dim=1) if len(sums) > 1 else sums[0]
    return (total / L.to(torch.float32)[None, :, None, None]).permute(0, 2, 1, 3)


def _block_means_cpu(x: torch.Tensor, L: torch.Tensor, all_live: bool) -> torch.Tensor:
    """CPU inference path of :func:`block_means` (see :func:`_block_sums_cpu`)."""
    B, T, H, D = x.shape
    sums = torch.empty(1, B, L.shape[0], H, D, dtype=torch.float32)
    with serial_cpu():
        _block_sums_cpu((x,), L, all_live, sums)
        return sums[0].div_(L.to(torch.float32)[None, :, None, None]).permute(0, 2, 1, 3)


def _block_sums_cpu(xs, L: torch.Tensor, all_live: bool, out: torch.Tensor) -> None:
    """fp32 sums over the live rows of each block of every ``(B, T, H, D)`` tensor of ``xs`` into
    ``out[i]`` ``(B, n, H, D)``. Each chunk of blocks is converted to fp32 into one reused buffer,
    then summed into its slice of ``out``. On a 2-core CPU ``sum(dtype=float32)`` over bf16 ran at
    ~2 ns per element; converting into a cached buffer and summing fp32 was ~7x faster, with
    identical fp32 results. Where the caller has :data:`_POOL_PARALLEL_THREADS` threads or more,
    the conversion and the sum of a chunk (8 MB) run on all of them (:func:`parallel_cpu`): on a
    16-core Xeon the one-threaded pooling of T=8192 H=16 D=128 bf16 took 33 ms, a third of a
    top-k call there. With fewer they stay on one: on a 2-core CPU two threads saved little when
    quiet and, with the cores busy, made it 2-10x slower (33 ms against 67-381 ms)."""
    B, T, H, D = xs[0].shape
    wide = getattr(_serial_state, "before", 1) >= _POOL_PARALLEL_THREADS
    n = L.shape[0]
    step = max(1, _CPU_POOL_CHUNK_BYTES // (B * BLOCK * H * D * 4))
    buf = torch.empty(B, min(step, n) * BLOCK, H, D, dtype=torch.float32)
    dead = None if all_live else ~live_token_mask(L)[None, :, :, None, None]
    for i, x in enumerate(xs):
        for b0 in range(0, n, step):
            b1 = min(n, b0 + step)
            rows = min(b1 * BLOCK, T) - b0 * BLOCK
            view = buf[:, :(b1 - b0) * BLOCK]
            with parallel_cpu(wide):
                view[:, :rows].copy_(x[:, b0 * BLOCK:b0 * BLOCK + rows])
            if rows < view.shape[1]:                                      # past T (ragged block)
                view[:, rows:].zero_()
            blocks = view.unflatten(1, (b1 - b0, BLOCK))
            if dead is not None:                                          # dead rows: 0, even NaN
                blocks.masked_fill_(dead[:, b0:b1], 0.0)
            with parallel_cpu(wide):
                torch.sum(blocks, dim=2, out=out[i, :, b0:b1])


def block_stats(problem: Problem) -> BlockStats:
    """Block means of q, k, v over live rows and the key centroid ``m`` (SPEC.md, "Pooled statistics")."""
    if problem.rows is not None:
        raise ValueError("block_stats: argument 'problem' received a problem with a row table "
                         "(Problem.rows); allowed: its tiled copy (only the fused plan reads a row table)")
    L = live_lengths(problem)
    # the dead rows need masking out of the sums unless they hold zeros (VSA's tiled layout)
    all_live = problem.block_len is None or problem.dead_rows_zero
    qkv = (problem.q, problem.k, problem.v)
    if problem.device.type == "cpu" and not (torch.is_grad_enabled() and any(x.requires_grad for x in qkv)):
        # q, k, v summed into one buffer and divided by L in one op (fewer, larger ops)
        B, T, H, D = problem.q.shape
        sums = torch.empty(3, B, L.shape[0], H, D, dtype=torch.float32)
        with serial_cpu():
            _block_sums_cpu(qkv, L, all_live, sums)
            qm, km, vm = sums.div_(L.to(torch.float32)[None, None, :, None, None]).permute(0, 1, 3, 2, 4)
            m = km.mean(dim=2, keepdim=True)
        return BlockStats(qm=qm, km=km, vm=vm, m=m, L=L)
    qm, km, vm = (block_means(x, L, all_live) for x in qkv)
    return BlockStats(qm=qm, km=km, vm=vm, m=km.mean(dim=2, keepdim=True), L=L)
