"""Process-group helpers of :mod:`solattn.distributed`: starting and leaving a group, the shard
layout, and waiting on collectives with a time limit."""

from __future__ import annotations

import numbers
import os
import sys
from datetime import timedelta
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from ..devices import DEVICES, count
from ..validation import fail as _fail, tensor_desc as _desc  # noqa: F401 (agree.py imports them from here)

Tensor = torch.Tensor


def _group_info(fn: str, group) -> Tuple[int, int]:
    """(rank in group, group size); raises when torch.distributed is not usable."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{fn}: torch.distributed is not initialised; call "
                           "torch.distributed.init_process_group first (torchrun sets up the "
                           "environment for it)")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        _fail(fn, "group", f"{group!r} of type {type(group).__name__}",
              "None (the default process group) or a torch.distributed.ProcessGroup", TypeError)
    rank = dist.get_rank(group)
    if rank < 0:
        _fail(fn, "group", repr(group), "a process group this process is a member of")
    return rank, dist.get_world_size(group)


def _check_timeout(fn: str, timeout) -> Optional[timedelta]:
    """None, or a positive number of seconds / ``timedelta`` -> ``timedelta``."""
    if timeout is None:
        return None
    allowed = "None (the process group's own timeout) or a positive number of seconds or datetime.timedelta"
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        _fail(fn, "timeout", f"{timeout!r} of type {type(timeout).__name__}", allowed, TypeError)
    if not seconds > 0 or seconds == float("inf"):
        _fail(fn, "timeout", repr(timeout), allowed)
    return timedelta(seconds=seconds)


class PeerFailure(RuntimeError):
    """A collective of :mod:`solattn.distributed` did not complete: a peer rank raised, died,
    or is not making the same call. The process group may be unusable afterwards."""


def wait(work, timeout: Optional[timedelta], fn: str, what: str) -> None:
    """Wait for an async collective; a failure or a timeout becomes a :class:`PeerFailure`
    naming the step. ``timeout=None`` waits as the backend does (its group timeout): on CUDA
    that is a stream wait that does not block the host."""
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout)
    except Exception as err:  # noqa: BLE001 - the backends raise RuntimeError or DistBackendError
        limit = "" if timeout is None else f" within the per-call timeout of {timeout.total_seconds():g} s"
        raise PeerFailure(
            f"{fn}: {what} did not complete{limit} on rank {dist.get_rank()}: a peer rank raised, "
            f"died or is not making the same call ({type(err).__name__}: {str(err)[:300]}). The process "
            "group may be unusable now: end the process (or destroy the group)") from None


#: device type -> the torch.distributed backend that runs this module's collectives on it (the
#: device table's ``collectives``, in its order: cuda, xpu, cpu)
PROCESS_GROUP_BACKENDS = {name: d.collectives for name, d in DEVICES.items() if d.collectives}


def init_from_env(device_type: Optional[str] = None,
                  timeout: Optional[timedelta] = None) -> Tuple[int, int, torch.device]:
    """Start the default process group of a script launched by ``torchrun``; return
    ``(rank, world_size, device)``.

    ``device_type`` is ``"cuda"`` (NCCL), ``"xpu"`` (XCCL) or ``"cpu"`` (Gloo); ``None`` takes
    the first of these present (CUDA, else XPU, else the CPU). On a GPU this process's device is
    ``LOCAL_RANK`` (from torchrun's environment, 0 without it), made the current device, and
    NCCL's group is bound to it. ``timeout`` goes to ``init_process_group`` (``None``: its
    default); it bounds every collective's wait on NCCL (its watchdog) and Gloo alike.
    Rank, world size and the rendezvous come from the environment torchrun sets up.
    """
    if device_type is None:
        device_type = next(t for t in PROCESS_GROUP_BACKENDS if count(t))
    if device_type not in PROCESS_GROUP_BACKENDS:
        _fail("init_from_env", "device_type", repr(device_type),
              "None, " + ", ".join(repr(d) for d in PROCESS_GROUP_BACKENDS),
              ValueError if isinstance(device_type, str) else TypeError)
    if timeout is not None and not isinstance(timeout, timedelta):
        _fail("init_from_env", "timeout", f"{timeout!r} of type {type(timeout).__name__}",
              "None or a datetime.timedelta", TypeError)
    if not dist.is_available():
        raise RuntimeError("init_from_env: this build of torch has no torch.distributed")
    if dist.is_initialized():
        raise RuntimeError("init_from_env: the default process group is already initialised")
    local = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cpu":
        device = torch.device("cpu")
    else:
        device = torch.device(device_type, local)
        getattr(torch, device_type).set_device(local)
    dist.init_process_group(PROCESS_GROUP_BACKENDS[device_type], timeout=timeout,
                            device_id=device if device_type == "cuda" else None)
    return dist.get_rank(), dist.get_world_size(), device


def destroy_and_exit(code: int = 0, group=None) -> None:
    """Wait for every rank, destroy the process group and end this process with exit status
    ``code``, skipping the interpreter's finalisation. Does not return.

    Gloo keeps its worker threads after ``destroy_process_group`` (they are never joined) and
    they free finished collectives lazily; a barrier also keeps the collectives still in flight
    when it was issued alive until the barrier itself is freed. When that happens while the
    interpreter is finalising and the buffers are tensors Python created, the worker thread needs
    the GIL, finalisation ends the thread inside a C++ destructor, and the process dies with
    "terminate called without an active exception" (SIGABRT) after all its work is done. No
    order of barrier/destroy calls prevents it, so this leaves with ``os._exit``: write and close
    every result first (stdout and stderr are flushed here); ``atexit`` handlers do not run.
    """
    if isinstance(code, bool) or not isinstance(code, numbers.Integral):
        _fail("destroy_and_exit", "code", f"{code!r} of type {type(code).__name__}", "an int", TypeError)
    _group_info("destroy_and_exit", group)
    dist.barrier(group=group)
    dist.destroy_process_group(group)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code))


def shard_lengths(total: int, world_size: int) -> List[int]:
    """The default sharding of ``total`` tokens over ``world_size`` ranks: ``ceil(total / P)``
    each, the last shard shorter (or empty when ``total`` is small)."""
    for name, value, low in (("total", total, 0), ("world_size", world_size, 1)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
            _fail("shard_lengths", name, repr(value), f"an int >= {low}",
                  TypeError if not isinstance(value, numbers.Integral) or isinstance(value, bool)
                  else ValueError)
    per = -(-int(total) // int(world_size))
    return [max(0, min(per, int(total) - r * per)) for r in range(int(world_size))]


def shard(x: Tensor, group=None, dim: int = 1) -> Tensor:
    """This rank's shard (a view) of a whole sequence ``x`` along ``dim``, per :func:`shard_lengths`."""
    rank, world = _group_info("shard", group)
    lens = shard_lengths(x.shape[dim], world)
    return x.narrow(dim, sum(lens[:rank]), lens[rank])


def gather(x: Tensor, group=None, dim: int = 1) -> Tensor:
    """The whole sequence from every rank's shard ``x`` (any lengths along ``dim``), on every rank.

    An inspection helper (tests, benchmarks, examples): not differentiable, and it moves the whole
    tensor to every rank. Shapes other than ``dim`` must agree across ranks."""
    _, world = _group_info("gather", group)
    mine = torch.tensor([x.shape[dim]], dtype=torch.int64, device=x.device)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    lens = [int(r.item()) for r in rows]
    pad = list(x.shape)
    pad[dim] = max(lens) - x.shape[dim]
    padded = torch.cat([x, x.new_zeros(pad)], dim=dim).contiguous()
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, lens)], dim=dim)
