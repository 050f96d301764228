"""Timing: progress lines and per-call times.

One timing method for every benchmark: each timed call starts with the device idle and, on a
GPU, with its L2 cache flushed (a write over a buffer larger than any L2), so no call is timed
on data a previous call left in the cache: a model's attention reads inputs that the layers
before it wrote, not the same tensors again. CUDA times come from events around the call,
elsewhere from ``perf_counter`` between two synchronisations. :func:`paired_rounds` times
several contenders in rounds with a rotating order, so that a drift in the machine's speed
reaches all of them alike."""

from __future__ import annotations

import statistics
import sys
import time
from typing import Callable, Dict, List, Sequence

import torch

from ..devices import current_device, entry, synchronize, timing_events

_T0 = time.perf_counter()


def reset_clock() -> None:
    """Start :func:`log`'s elapsed-time column from zero (each ``bench`` run does)."""
    global _T0
    _T0 = time.perf_counter()


def log(msg: str) -> None:
    """One progress line on stderr with the elapsed time, flushed."""
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


#: bytes written to flush a GPU's L2 before a timed call (an H200 has 60 MiB of L2)
L2_FLUSH_BYTES = 256 << 20
_flush_buffers: Dict[torch.device, torch.Tensor] = {}


def flush_l2(device: torch.device) -> None:
    """Evict the device's L2 cache by writing over a 256 MiB buffer (where its entry in
    :mod:`solattn.devices` asks for it: CUDA and XPU; a no-op on the CPU and MPS). The buffer is
    allocated once per device and kept."""
    device = torch.device(device)
    if not entry(device.type).l2_flush:
        return
    device = current_device(device)
    buf = _flush_buffers.get(device)
    if buf is None:
        buf = _flush_buffers[device] = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
    buf.zero_()


def time_calls(fn: Callable[[], object], device: torch.device, repeats: int,
               warmup: int = 0) -> List[float]:
    """Milliseconds of ``repeats`` calls of ``fn``, after ``warmup`` untimed calls: the device
    synchronised and (GPU) its L2 flushed before each call; events around the call where the
    device's entry times by events (CUDA), elsewhere ``perf_counter`` until the device is
    synchronised again."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        flush_l2(device)
        events = timing_events(device)
        if events is not None:
            start, end = events
            synchronize(device)
            start.record()
            fn()
            end.record()
            synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            synchronize(device)
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def round_order(names: List[str], rnd: int) -> List[str]:
    """The order of the contenders in timed round ``rnd``: rotated by one each round, so that no
    contender always runs right after the same other one (on an H200 the row after dense SDPA
    measured up to 1.8 ms slower at H3 than the same call later in the round)."""
    if not names:
        return []
    r = rnd % len(names)
    return names[r:] + names[:r]


def paired_rounds(fns: Dict[str, Callable[[], object]], device: torch.device, rounds: int = 20,
                  warmup: int = 2) -> Dict[str, List[float]]:
    """``{name: [ms per round]}``: ``warmup`` untimed calls of each function, then ``rounds``
    rounds that time every function once (:func:`time_calls`), the order rotated by one each
    round, so ratios can be taken round by round (:func:`ratio_summary`)."""
    names = list(fns)
    for name in names:
        time_calls(fns[name], device, 0, warmup)
    times: Dict[str, List[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in round_order(names, r):
            times[name] += time_calls(fns[name], device, 1)
    return times


def ratio_summary(num: Sequence[float], den: Sequence[float]) -> str:
    """Median and range of the per-round ratios ``num / den``, e.g. ``'4.02x (3.97-4.06)'``."""
    ratios = sorted(a / b for a, b in zip(num, den))
    return f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})"
