"""Device types: what solattn knows of each, in one entry.

A device type is one :class:`DeviceType` in :data:`DEVICES` plus the backends that declare it
(``Backend.devices``). The rest of solattn asks this module for everything that differs between
device types: the built-in backends' automatic order (:mod:`solattn.dispatch`), which devices are
present and which is best, synchronisation, timing events and allocator statistics (the
benchmarks), how routing finds the k-th largest score, the dtype of the ``sdpa`` backend's
additive masks, whether solattn's Triton kernels are compiled for it, which ``torch.distributed``
backend runs collectives there, and what is known broken there. Runtime calls go through ``torch.accelerator`` where it serves the device type (the one
accelerator this torch build was made for), else through the type's own module (``torch.cuda``,
``torch.xpu``, ``torch.mps``); an entry may give its own ``count`` and ``synchronize``.

A device type missing from the table is served by :func:`entry`'s default: no automatic choice
beyond ``sdpa > reference``, masks in the input dtype, ``torch.topk``, no Triton.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

#: ways of finding the k-th largest routing score (:func:`solattn.routing.default_topk_method`)
TOPK_METHODS = ("topk", "sort")


@dataclass(frozen=True)
class DeviceType:
    """The facts of one device type (a ``torch.device``'s ``type``)."""

    #: the torch device type
    name: str
    #: the built-in backends' order in the automatic choice (the first that can run a call wins;
    #: names not registered are skipped, and so is a backend whose ``automatic(name)`` says False)
    priority: Tuple[str, ...] = ("sdpa", "reference")
    #: a device with its own queue and memory (False: the host); accelerators count as GPUs for
    #: the tests' ``gpu`` mark, and ``best_device`` takes the first present one in table order
    accelerator: bool = True
    #: its SDPA computes correctly with an fp32 additive mask on bf16 / fp16 inputs (else the mask
    #: takes q's dtype)
    fp32_masks: bool = False
    #: how routing finds the k-th largest score when rows are short enough for ``torch.topk``
    #: (one of :data:`TOPK_METHODS`)
    topk: str = "topk"
    #: solattn's Triton kernels are compiled for it (the fused plan; launches on its current device)
    triton: bool = False
    #: benchmarks flush its L2 cache before each timed call
    l2_flush: bool = False
    #: benchmarks time calls with its module's ``Event`` (else ``perf_counter`` between syncs)
    timing_events: bool = False
    #: its allocator keeps peak statistics (benchmarks read the extra memory of a call from them)
    allocator_stats: bool = False
    #: the ``torch.distributed`` backend that runs collectives on it (None: none known)
    collectives: Optional[str] = None
    #: device names carry an index (``cuda:0``); False: one device, named by its type (``mps``)
    indexed: bool = True
    #: what is known broken there, and what solattn does about it (``python -m solattn info``)
    known_broken: Tuple[str, ...] = ()
    #: how many devices of the type are present (default: ``torch.accelerator`` or the type's module)
    count: Optional[Callable[[], int]] = None
    #: wait for a device's queued work (default: ``torch.accelerator`` or the type's module)
    synchronize: Optional[Callable[[torch.device], None]] = None

    def __post_init__(self) -> None:
        if self.topk not in TOPK_METHODS:
            raise ValueError(f"DeviceType {self.name!r}: argument 'topk' received {self.topk!r}; "
                             f"allowed: one of {TOPK_METHODS}")


def _mps_count() -> int:
    mps = getattr(torch.backends, "mps", None)
    return 1 if mps is not None and mps.is_available() else 0


#: every device type solattn knows, the preferred first (``best_device``: cuda > xpu > mps > cpu).
#: fp32 masks only on the CPU: CUDA broke with them (``known_broken``), XPU and MPS were never run
DEVICES: Dict[str, DeviceType] = {d.name: d for d in (
    DeviceType("cuda", priority=("triton", "sdpa", "reference"), triton=True, l2_flush=True,
               timing_events=True, allocator_stats=True, collectives="nccl", known_broken=(
                   "SDPA with an fp32 additive mask on bf16/fp16 inputs returned NaN and wrong rows once the "
                   "mask held -inf (torch 2.11, H200): sdpa masks take q's dtype",)),
    DeviceType("xpu", priority=("flex", "sdpa", "triton", "reference"), topk="sort", l2_flush=True,
               allocator_stats=True, collectives="xccl",
               known_broken=(
                   "torch.topk is reported to crash above 2048 bf16/fp32 elements (torch 2.13): routing "
                   "finds the k-th largest score by a full sort",
                   "the triton and flex backends were not yet run on real Intel hardware: opt-ins "
                   "SOLATTN_TRITON_XPU=1 and SOLATTN_FLEX_XPU=1")),
    DeviceType("mps", priority=("sdpa", "reference"), indexed=False, count=_mps_count),
    DeviceType("cpu", priority=("flex", "sdpa", "reference"), accelerator=False, fp32_masks=True,
               collectives="gloo"),
)}


def entry(device_type: str) -> DeviceType:
    """The entry of ``device_type``, or the default one for a type not in :data:`DEVICES`."""
    found = DEVICES.get(device_type)
    return found if found is not None else DeviceType(device_type)


def accelerator_types() -> List[str]:
    """The device types in :data:`DEVICES` that are accelerators, in table order."""
    return [name for name, d in DEVICES.items() if d.accelerator]


def _accelerator(device_type: str):
    """``torch.accelerator`` when this torch has it and it serves ``device_type``, else None."""
    acc = getattr(torch, "accelerator", None)
    current = getattr(acc, "current_accelerator", None)
    if current is None:
        return None
    try:
        dev = current()
    except RuntimeError:
        return None
    return acc if dev is not None and dev.type == device_type else None


def runtime(device_type: str):
    """The module that runs ``device_type``'s queries: ``torch.accelerator`` where it serves the
    type, else ``torch.<type>``; None for a type torch has no module for."""
    return _accelerator(device_type) or getattr(torch, device_type, None)


def count(device_type: str) -> int:
    """How many devices of ``device_type`` are present (1 for the host)."""
    d = entry(device_type)
    if not d.accelerator:
        return 1
    if d.count is not None:
        return d.count()
    acc = _accelerator(device_type)
    if acc is not None:
        return acc.device_count()
    mod = getattr(torch, device_type, None)
    if mod is None or not hasattr(mod, "is_available") or not mod.is_available():
        return 0
    return mod.device_count()


def present_devices() -> List[str]:
    """Device names this torch can use here: ``cpu``, then the accelerators in table order
    (``cuda:i``, ``xpu:i``, ``mps``)."""
    devs = ["cpu"]
    for name in accelerator_types():
        n = count(name)
        if n:
            devs += [f"{name}:{i}" for i in range(n)] if DEVICES[name].indexed else [name]
    return devs


def best_device() -> torch.device:
    """The first present accelerator in table order (cuda > xpu > mps), else the CPU."""
    types = {d.split(":")[0] for d in present_devices()}
    return torch.device(next((t for t in accelerator_types() if t in types), "cpu"))


def synchronize(device) -> None:
    """Wait for ``device``'s queued work (a no-op on the host)."""
    device = torch.device(device)
    d = entry(device.type)
    if not d.accelerator:
        return
    if d.synchronize is not None:
        d.synchronize(device)
        return
    runtime(device.type).synchronize(device)


def current_device(device: torch.device) -> torch.device:
    """``device`` with its index: the current one of its type where it has none."""
    device = torch.device(device)
    d = entry(device.type)
    if device.index is not None or not d.indexed or not d.accelerator:
        return device
    current = getattr(_accelerator(device.type), "current_device_index", None)
    return torch.device(device.type, current() if current is not None else getattr(torch, device.type).current_device())


def timing_events(device: torch.device):
    """A ``(start, end)`` pair of timing events on ``device`` where its entry times by events, else None."""
    if not entry(torch.device(device).type).timing_events:
        return None
    make = getattr(torch, torch.device(device).type).Event
    return make(enable_timing=True), make(enable_timing=True)


def allocator(device: torch.device):
    """The module with ``device``'s allocator statistics (``reset_peak_memory_stats``,
    ``memory_allocated``, ``max_memory_allocated``), or None where they are not kept (the host,
    MPS, a torch without them)."""
    kind = torch.device(device).type
    if not entry(kind).allocator_stats:
        return None
    for mod in (_accelerator(kind), getattr(torch, kind, None)):
        if mod is not None and all(hasattr(mod, f) for f in
                                   ("reset_peak_memory_stats", "memory_allocated", "max_memory_allocated")):
            return mod
    return None


def device_name(device) -> Optional[str]:
    """The product name of an accelerator (``cuda:0``; ``cuda``: the current one), where its type's
    module tells it (CUDA, XPU), else None."""
    device = torch.device(device)
    get = getattr(getattr(torch, device.type, None), "get_device_name", None)
    if get is None or not entry(device.type).accelerator:
        return None
    return get(device)


__all__ = ["DEVICES", "DeviceType", "TOPK_METHODS", "accelerator_types", "allocator", "best_device", "count",
           "current_device", "device_name", "entry", "present_devices", "runtime", "synchronize", "timing_events"]
