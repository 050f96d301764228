"""Argument agreement of :mod:`solattn.distributed`: before any tensor data moves, every rank
of the group learns every other rank's shard shape, its verdict on its own arguments and a
description of every argument, in one small all-gather. Every rank then raises the same error,
or none: a rank that refuses its arguments cannot leave its peers waiting in an exchange, and
ranks that pass different arguments cannot silently compute different things."""

from __future__ import annotations

import hashlib
import numbers
import struct
import weakref
from datetime import timedelta
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from ..validation import DTYPE_NAMES as _DTYPE_NAMES, SUPPORTED_DTYPES
from .group import _desc, _fail, wait

Tensor = torch.Tensor

_DTYPE_CODES = {dt: i for i, dt in enumerate(SUPPORTED_DTYPES)}
_ERRORS = {1: ValueError, 2: TypeError}
_HEADER = ("status", "T_r", "B", "H", "D", "dtype", "gate dtype", "text bytes")
_TEXT = 4096          # bytes per rank for the argument description or the error message
_SEP, _EQ = "\x1e", "\x1f"


def check_local(fn: str, q, k, v, gate, gate_name: str, world: int) -> None:
    """Checks of this rank's shards that need no communication."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            _fail(fn, name, type(t).__name__, "a torch.Tensor of shape (B, T_r, H, D) (this rank's shard)",
                  TypeError)
        if t.dim() != 4:
            _fail(fn, name, _desc(t), "a 4-D tensor of shape (B, T_r, H, D) (this rank's shard)")
        if t.dtype not in SUPPORTED_DTYPES:
            _fail(fn, name, _desc(t), f"dtype {_DTYPE_NAMES}", TypeError)
    for name, t in (("k", k), ("v", v)):
        if t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
            _fail(fn, name, _desc(t), f"the shape, dtype and device of q ({_desc(q)})")
    B, _, H, D = q.shape
    if min(B, H, D) < 1:
        _fail(fn, "q", _desc(q), "B, H, D >= 1 (the shard length T_r may be 0)")
    if H % world:
        divisors = [p for p in range(1, H + 1) if H % p == 0]
        _fail(fn, "q", f"a tensor with H={H} heads ({_desc(q)})",
              f"a head count divisible by the group size {world}: each rank attends H/{world} heads "
              f"of the whole sequence (group sizes that divide H={H}: {divisors})")
    if gate is not None:
        allowed = (f"None or a tensor of dtype {_DTYPE_NAMES} and q's shape {tuple(q.shape)} (sharded like q) "
                   f"on {q.device}")
        if not isinstance(gate, Tensor):
            _fail(fn, gate_name, type(gate).__name__, allowed, TypeError)
        if gate.dtype not in SUPPORTED_DTYPES:
            _fail(fn, gate_name, _desc(gate), allowed, TypeError)
        if gate.shape != q.shape or gate.device != q.device:
            _fail(fn, gate_name, _desc(gate), allowed)


def check_shard_lens(fn: str, shard_lens, world: int) -> Optional[List[int]]:
    """The form of ``shard_lens`` (its agreement with the shards is checked after the gather)."""
    if shard_lens is None:
        return None
    allowed = (f"None or a sequence of {world} ints >= 0 (one per rank of the group, in rank order, "
               "each equal to that rank's shard length), total >= 1")
    if isinstance(shard_lens, Tensor):
        shard_lens = shard_lens.tolist()
    if not isinstance(shard_lens, (list, tuple)) or not all(
            isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in shard_lens):
        _fail(fn, "shard_lens", repr(shard_lens), allowed, TypeError)
    lens = [int(x) for x in shard_lens]
    if len(lens) != world or min(lens) < 0 or sum(lens) < 1:
        _fail(fn, "shard_lens", repr(shard_lens), allowed)
    return lens


def describe(value, q) -> str:
    """A short text standing for an argument's value: equal texts on two ranks mean the same
    argument (tensors are described by shape, dtype, device kind and autograd flag; their
    values are compared by checksum)."""
    if isinstance(value, Tensor):
        where = "q's device" if isinstance(q, Tensor) and value.device == q.device else str(value.device)
        text = (f"tensor{tuple(value.shape)} {str(value.dtype).replace('torch.', '')} on {where}"
                f"{' requiring grad' if value.requires_grad else ''}")
    elif isinstance(value, float):
        text = repr(value)
    elif isinstance(value, (list, tuple)):
        text = type(value).__name__[0] + "[" + ", ".join(describe(x, q) for x in value) + "]"
    else:
        text = repr(value)
    if len(text) > 96:
        text = text[:64] + "... #" + hashlib.blake2b(text.encode(), digest_size=6).hexdigest()
    return text


_SUMS: Dict[int, tuple] = {}     # id(tensor) -> (weakref, version, checksum)


def checksum(t: Optional[Tensor]) -> int:
    """A position-weighted int64 checksum of a tensor's bytes, computed on its device. Cached
    per tensor and version (in-place writes bump it), so a ``key_bias`` reused call after call
    costs one device synchronisation, not one per call."""
    if t is None:
        return 0
    key = id(t)
    version = None if t.is_inference() else t._version      # inference tensors keep no version
    hit = _SUMS.get(key)
    if version is not None and hit is not None and hit[0]() is t and hit[1] == version:
        return hit[2]
    b = t.detach().contiguous().reshape(-1).view(torch.uint8).to(torch.int64)
    w = torch.arange(b.numel(), device=b.device, dtype=torch.int64) % 65521 + 1
    value = int((b * w).sum().item())
    if version is not None:
        _SUMS[key] = (weakref.ref(t, lambda _, key=key: _SUMS.pop(key, None)), version, value)
    return value


_HOST_GROUPS: list = []          # [(the default group, a Gloo group of the same ranks)]


def host_group(group):
    """A group that gathers CPU tensors with ``group``'s ranks, or None. ``group`` itself when
    its backend includes Gloo; for the default group on NCCL or XCCL, a Gloo group of the same
    ranks, created on first use (every rank makes the call that creates it). The agreement then
    never waits for the device: the host can queue work ahead of it across calls."""
    if "gloo" in str(dist.get_backend(group)):
        return group
    world = dist.group.WORLD
    if group is not None and group is not world:
        return None
    if not _HOST_GROUPS or _HOST_GROUPS[0][0] is not world:
        try:
            side = dist.new_group(backend="gloo")
        except Exception:  # noqa: BLE001 - no Gloo on this host (e.g. no usable interface): device gather
            side = None
        _HOST_GROUPS[:] = [(world, side)]
    return _HOST_GROUPS[0][1]


def comm_device(group, q) -> torch.device:
    """Where a group without Gloo puts its small collectives' tensors (NCCL moves device tensors only)."""
    if isinstance(q, Tensor) and q.device.type != "cpu":
        return q.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(fn: str, group, rank: int, world: int, error: Optional[Exception], q, gate, gate_name: str,
          args: Dict[str, object], values: Dict[str, Optional[Tensor]], shard_lens: Optional[List[int]],
          timeout: Optional[timedelta]) -> List[int]:
    """One all-gather of every rank's verdict and arguments; returns every rank's shard length
    or raises the same error on every rank.

    ``error``: this rank's own refusal (raised by a local check), or None. ``args``: name ->
    value of every argument that must be the same on every rank (described by :func:`describe`).
    ``values``: name -> tensor whose bytes must be the same on every rank (compared by checksum).
    """
    if error is None:
        B, Tr, H, D = q.shape
        gcode = -1 if gate is None else _DTYPE_CODES[gate.dtype]
        text = _SEP.join(f"{name}{_EQ}{describe(value, q)}" for name, value in args.items())
        head = [0, Tr, B, H, D, _DTYPE_CODES[q.dtype], gcode]
    else:
        text = str(error)
        head = [next((c for c, e in _ERRORS.items() if type(error) is e), 3)] + [-1] * 6
    data = text.encode()[:_TEXT]
    head.append(len(data))
    sums = [checksum(values[n]) if error is None else 0 for n in values]
    raw = struct.pack(f"<{len(head)}q", *head) + data + bytes(_TEXT - len(data)) + struct.pack(f"<{len(sums)}q", *sums)
    mine = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(torch.int64)
    on = host_group(group)
    if on is None:                # a device-only group: gather on the device (one synchronisation)
        on, mine = group, mine.to(comm_device(group, q))
    rows = [torch.empty_like(mine) for _ in range(world)]
    wait(dist.all_gather(rows, mine, group=on, async_op=True), timeout, fn, "the argument agreement")
    table = torch.stack(rows).cpu()
    heads = table[:, :len(_HEADER)].tolist()
    sums = table[:, -len(values):].tolist() if values else [[] for _ in range(world)]
    texts = [table[r, len(_HEADER):len(_HEADER) + _TEXT // 8].numpy().tobytes()[:heads[r][-1]]
             .decode(errors="replace") for r in range(world)]

    refused = [r for r in range(world) if heads[r][0] != 0]
    if refused:
        first = refused[0]
        others = "" if len(refused) == 1 else f" (ranks {refused} refused their arguments; rank {first}'s error)"
        raise _ERRORS.get(heads[first][0], RuntimeError)(
            f"{texts[first]} [refused on rank {first} of the group's {world}{others}; every rank raises this]")

    for col in range(2, 7):           # B, H, D, dtype, gate dtype
        cells = [h[col] for h in heads]
        if len(set(cells)) > 1:
            def show(c, col=col):
                return ("none" if c < 0 else str(SUPPORTED_DTYPES[c]).replace("torch.", "")) if col >= 5 else c
            table_ = ", ".join(f"rank {r}: {show(c)}" for r, c in enumerate(cells))
            arg = "q" if col < 6 else gate_name
            _fail(fn, arg, f"shards whose {_HEADER[col]} differ across ranks ({table_})",
                  f"the same {_HEADER[col]} on every rank of the group (only the shard length T_r may differ)")
    parsed = [dict(item.split(_EQ, 1) for item in t.split(_SEP)) if t else {} for t in texts]
    for name in args:
        cells = [p.get(name, "?") for p in parsed]
        if len(set(cells)) > 1:
            table_ = ", ".join(f"rank {r}: {c}" for r, c in enumerate(cells))
            raise ValueError(f"{fn}: argument '{name}' differs across ranks ({table_}); allowed: the same "
                             f"value on every rank of the group (only the shards q, k, v and the gate differ)")
    for i, name in enumerate(values):
        if len({s[i] for s in sums}) > 1:
            raise ValueError(f"{fn}: argument '{name}' holds different values across ranks (checksums "
                             f"{[s[i] for s in sums]}); allowed: the same whole tensor on every rank of the "
                             f"group (it describes the whole gathered sequence)")
    lens = [h[1] for h in heads]
    if shard_lens is not None and shard_lens != lens:
        raise ValueError(f"{fn}: argument 'shard_lens' received {shard_lens}; allowed: every rank's shard "
                         f"length in rank order, which is {lens} (the ranks' q shards)")
    if sum(lens) < 1:
        _fail(fn, "q", f"shards of length {lens}", "a whole sequence of at least 1 token")
    return lens
