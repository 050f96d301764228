"""Timing: progress lines, device synchronisation and per-call wall times."""

from __future__ import annotations

import sys
import time
from typing import Callable, List

import torch

_T0 = time.perf_counter()


def reset_clock() -> None:
    """Start :func:`log`'s elapsed-time column from zero (each ``bench`` run does)."""
    global _T0
    _T0 = time.perf_counter()


def log(msg: str) -> None:
    """One progress line on stderr with the elapsed time, flushed."""
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (no-op on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu":
        torch.xpu.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def time_calls(fn: Callable[[], object], device: torch.device, repeats: int,
               warmup: int = 0) -> List[float]:
    """Milliseconds of ``repeats`` calls of ``fn``, the device synchronised around each
    (CUDA: events; elsewhere ``perf_counter``), after ``warmup`` untimed calls."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            synchronize(device)
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            times.append((time.perf_counter() - t0) * 1e3)
    return times
