"""The Triton runtime shared by the fused routing plan (``solattn.routing.fused``) and the
``triton`` backend: the layer below both, so that neither imports from the other.

Importing this package never imports Triton; :mod:`.jit` does (``gpu_jit``, ``compiled``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

import torch

from ..devices import entry


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET=1`` is set now (read per call: tests set it after import)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpret_on(device: torch.device) -> bool:
    """Whether kernels for tensors on ``device`` run in Triton's CPU interpreter rather than
    compiled for the GPU: under ``TRITON_INTERPRET=1``, and always for CPU tensors."""
    return interpreting() or device.type == "cpu"


def interpretable(interpret: bool, *tensors):
    """``tensors`` as a kernel run by Triton's CPU interpreter (``interpret``) can read them: the
    interpreter keeps bf16 as raw bit patterns (its ``tl.dot`` multiplies them as integers), so
    bf16 tensors become exact fp32 copies there, which give the same sums; everything else, and
    every tensor of a GPU launch, is returned as it is."""
    if not interpret:
        return tensors
    return tuple(t.float() if t is not None and t.dtype == torch.bfloat16 else t for t in tensors)


def cuda_capability(device: torch.device):
    """``torch.cuda.get_device_capability(device)`` as a tuple, asked once per device index: a GPU's
    capability does not change, and the query costs several microseconds of Python on every launch
    that reads it. A device without an index (the current one) is asked each time. The cache is
    keyed by the query function too, so that a replaced query (a test's) is asked afresh."""
    query = torch.cuda.get_device_capability
    if device.index is None:
        return tuple(query(device))
    return _capability(query, device.type, device.index)


@functools.lru_cache(maxsize=64)
def _capability(query, device_type: str, index: int):
    return tuple(query(torch.device(device_type, index)))


def device_constant(make):
    """Decorate ``make(*args)`` (its last argument the device) into a maker of a shared, read-only
    constant: made once per arguments (a fill or ``arange`` per call cost a launch each), and on
    a GPU written before any stream reads it (a later call may run on another stream than the one
    that made it: the one synchronisation is at its making). Inside a CUDA graph capture it is
    made fresh and the graph owns it: its kernel runs at each replay, and no cache eviction can
    free what the graph reads, nor does a tensor of the graph's pool enter the cache."""
    @functools.lru_cache(maxsize=16)
    def shared(*args):
        value = make(*args)
        if value.device.type == "cuda":
            torch.cuda.current_stream(value.device).synchronize()
        return value

    @functools.wraps(make)
    def get(*args):
        return make(*args) if _capturing(args[-1]) else shared(*args)
    return get


def _capturing(device: torch.device) -> bool:
    """Whether work on ``device`` is being captured into a CUDA graph now."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


@functools.lru_cache(maxsize=1)
def triton_installed() -> bool:
    """Whether Triton can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def on_device(device: torch.device):
    """A context in which Triton launches on ``device``: on a device type solattn's kernels are
    compiled for (:mod:`solattn.devices`) they take its current device (and its stream), which
    need not be the tensors'; nothing to switch elsewhere."""
    return getattr(torch, device.type).device(device) if entry(device.type).triton else contextlib.nullcontext()


def pow2(x: int) -> int:
    """The least power of two >= ``x`` (1 for ``x <= 1``): a register tile's extent."""
    return 1 << max(0, x - 1).bit_length()


def triton_runs_on(device: torch.device) -> bool:
    """Whether solattn's Triton kernels run for tensors on ``device``: a device type they are
    compiled for (:mod:`solattn.devices`: CUDA), or the CPU under ``TRITON_INTERPRET=1`` (tests),
    with Triton importable."""
    return (entry(device.type).triton or (device.type == "cpu" and interpreting())) and triton_installed()


__all__ = ["cuda_capability", "device_constant", "interpret_on", "interpretable", "interpreting", "on_device",
           "pow2", "triton_installed", "triton_runs_on"]
