"""Peak memory of one call: the allocator's high-water mark where the device keeps one (CUDA /
XPU, :func:`solattn.devices.allocator`), the resident set size on a Linux CPU (a lower bound),
and no number elsewhere.

Nothing here needs a POSIX module at import time: ``resource`` is imported when used, and
where it (or ``/proc``) is missing the figure degrades to what can still be measured.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Callable, Optional, Tuple

import torch

from ..devices import allocator, synchronize


def _rss_bytes() -> Optional[int]:
    """Resident set size from ``/proc/self/statm`` (Linux), else None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _maxrss_bytes() -> Optional[int]:
    """The process's RSS high-water mark (``getrusage``), or None without ``resource`` (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    scale = 1 if sys.platform == "darwin" else 1024   # Linux reports KiB, macOS bytes
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _release_freed_heap() -> None:
    """Hand memory freed by earlier calls back to the OS (glibc ``malloc_trim``), so that this
    call's allocations show up as RSS growth instead of silently reusing resident pages."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass   # not glibc: the figure stays a lower bound, as documented


class RssSampler:
    """Peak RSS seen by a background thread polling ``/proc/self/statm`` every ~1 ms."""

    def __init__(self) -> None:
        self.peak = _rss_bytes() or 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = _rss_bytes()
            if rss is not None and rss > self.peak:
                self.peak = rss
            self._stop.wait(0.001)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        rss = _rss_bytes()
        if rss is not None and rss > self.peak:
            self.peak = rss


def measure_peak(fn: Callable[[], torch.Tensor],
                 device: torch.device) -> Tuple[torch.Tensor, Optional[float], str]:
    """Run ``fn`` once; return its output, the extra memory it needed (MiB, or None) and the
    basis: ``allocator`` (exact), ``rss>=`` (CPU resident set, a lower bound) or ``n/a``."""
    device = torch.device(device)
    kind = device.type
    mod = allocator(device)
    if mod is not None:
        synchronize(device)
        mod.reset_peak_memory_stats(device)
        before = mod.memory_allocated(device)
        out = fn()
        synchronize(device)
        return out, (mod.max_memory_allocated(device) - before) / 2**20, "allocator"
    if kind == "cpu" and _rss_bytes() is not None:
        _release_freed_heap()
        before, maxrss_before = _rss_bytes(), _maxrss_bytes()
        with RssSampler() as sampler:
            out = fn()
        peak = sampler.peak
        maxrss_after = _maxrss_bytes()
        # the process high-water mark was set inside this call: then it is the exact peak
        if maxrss_before is not None and maxrss_after is not None and maxrss_after > maxrss_before:
            peak = max(peak, maxrss_after)
        return out, max(0, peak - before) / 2**20, "rss>="
    out = fn()
    synchronize(device)
    return out, None, "n/a"
