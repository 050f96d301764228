"""Sequence-parallel ``sol_attn`` and ``video_sparse_attn`` over ``torch.distributed``.

DeepSpeed-Ulysses layout: every rank of a process group holds a contiguous shard of the
sequence with all heads. One all-to-all trades that for the whole sequence with ``H / P``
heads (``P`` = group size), the single-device function runs on it (both operators are
head-local: every statistic and every routing decision is per (batch, head)), and the inverse
all-to-all returns each rank its own tokens with all heads.

Sharding (dim 1, the token axis): rank ``r`` of the group holds tokens
``[o_r, o_r + T_r)`` of the whole sequence, ``o_r = T_0 + ... + T_{r-1}`` (contiguous, in group
rank order). The lengths ``T_r >= 0`` are free: they need not be equal nor multiples of 64,
because routing blocks are cut from the gathered sequence. They are gathered at each call (one
small all-gather) unless the caller passes ``shard_lens``. :func:`shard_lengths` gives the usual
choice, ``ceil(T / P)`` tokens per rank with a shorter (possibly empty) last shard.

The exchange uses ``torch.distributed.all_to_all_single`` (NCCL on CUDA, XCCL on XPU, Gloo on the
CPU: Gloo implements it, uneven splits included) inside a small ``autograd.Function`` whose
backward is the inverse all-to-all, so everything is differentiable.
"""

from __future__ import annotations

import numbers
import os
import sys
from datetime import timedelta
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import dispatch
from . import video as _video
from .ops import sol_attn as _sol_attn
from .validation import SUPPORTED_DTYPES, validate

Tensor = torch.Tensor

__all__ = ["sol_attn", "video_sparse_attn", "shard_lengths", "shard", "gather", "init_from_env",
           "destroy_and_exit"]

_DTYPE_CODES = {dt: i for i, dt in enumerate(SUPPORTED_DTYPES)}
_DTYPE_NAMES = "torch.bfloat16, torch.float16 or torch.float32"


def _fail(fn: str, arg: str, received, allowed: str, exc=ValueError):
    raise exc(f"{fn}: argument '{arg}' received {received}; allowed: {allowed}")


def _desc(t: Tensor) -> str:
    return f"a tensor of shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


# ----------------------------------------------------------------------------------------------
# group and sharding helpers
# ----------------------------------------------------------------------------------------------

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


#: device type -> the torch.distributed backend that runs this module's collectives on it
PROCESS_GROUP_BACKENDS = {"cuda": "nccl", "xpu": "xccl", "cpu": "gloo"}


def init_from_env(device_type: Optional[str] = None,
                  timeout: Optional[timedelta] = None) -> Tuple[int, int, torch.device]:
    """Start the default process group of a script launched by ``torchrun``; return
    ``(rank, world_size, device)``.

    ``device_type`` is ``"cuda"`` (NCCL), ``"xpu"`` (XCCL) or ``"cpu"`` (Gloo); ``None`` takes
    CUDA if available, else XPU if available, else the CPU. On a GPU this process's device is
    ``LOCAL_RANK`` (from torchrun's environment, 0 without it), made the current device, and
    NCCL's group is bound to it. ``timeout`` goes to ``init_process_group`` (``None``: its
    default). Rank, world size and the rendezvous come from the environment torchrun sets up.
    """
    if device_type is None:
        xpu = getattr(torch, "xpu", None)
        device_type = ("cuda" if torch.cuda.is_available()
                       else "xpu" if xpu is not None and xpu.is_available() else "cpu")
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
    lens = _all_gather_ints([x.shape[dim]], x.device, group, world)
    longest = max(row[0] for row in lens)
    pad = list(x.shape)
    pad[dim] = longest - x.shape[dim]
    padded = torch.cat([x, x.new_zeros(pad)], dim=dim).contiguous()
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p.narrow(dim, 0, row[0]) for p, row in zip(parts, lens)], dim=dim)


def _all_gather_ints(values: List[int], device: torch.device, group, world: int) -> List[List[int]]:
    # NCCL only moves device tensors; every other backend here takes CPU or device tensors alike
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    return torch.stack(rows).tolist()


# ----------------------------------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------------------------------

def _check_local(fn: str, q, k, v, gate, gate_name: str, world: int) -> None:
    """Checks of this rank's shards that need no communication (run identically on every rank
    of an SPMD program, so every rank raises the same error before any collective)."""
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


def _shard_table(fn: str, q: Tensor, gate: Optional[Tensor], gate_name: str, shard_lens, rank: int,
                 world: int, group) -> List[int]:
    """Every rank's shard length. Gathered (with each rank's B, H, D and dtypes, compared so that
    a mismatch raises the same error on every rank) unless the caller passes ``shard_lens``."""
    B, Tr, H, D = q.shape
    if shard_lens is not None:
        allowed = (f"None or a sequence of {world} ints >= 0 (one per rank of the group, in rank "
                   f"order) whose entry {rank} equals this rank's shard length T_r = {Tr}, total >= 1")
        if isinstance(shard_lens, Tensor):
            shard_lens = shard_lens.tolist()
        if not isinstance(shard_lens, (list, tuple)) or not all(
                isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in shard_lens):
            _fail(fn, "shard_lens", repr(shard_lens), allowed, TypeError)
        lens = [int(x) for x in shard_lens]
        if len(lens) != world or min(lens) < 0 or lens[rank] != Tr or sum(lens) < 1:
            _fail(fn, "shard_lens", repr(shard_lens), allowed)
        return lens
    code = _DTYPE_CODES[q.dtype]
    gate_code = -1 if gate is None else _DTYPE_CODES[gate.dtype]
    device = q.device if q.device.type != "cpu" else torch.device("cpu")
    rows = _all_gather_ints([Tr, B, H, D, code, gate_code], device, group, world)
    names = ("T_r", "B", "H", "D", "dtype", f"{gate_name} dtype")
    for col in range(1, len(names)):
        if len({row[col] for row in rows}) > 1:
            def show(c):
                return ("none" if c < 0 else str(SUPPORTED_DTYPES[c]).replace("torch.", "")) \
                    if col >= 4 else c
            table = ", ".join(f"rank {r}: {show(row[col])}" for r, row in enumerate(rows))
            _fail(fn, "q" if col < 5 else gate_name, f"shards whose {names[col]} differ across ranks ({table})",
                  f"the same {names[col]} on every rank of the group (only the shard length T_r may differ)")
    lens = [row[0] for row in rows]
    if sum(lens) < 1:
        _fail(fn, "q", f"shards of length {lens}", "a whole sequence of at least 1 token")
    return lens


def _rename(err: Exception, fn: str, old: str, context: str) -> Exception:
    msg = str(err)
    if msg.startswith(old + ":"):
        msg = msg[len(old) + 1:].lstrip()
    return type(err)(f"{fn}: {msg} [checked on the gathered sequence: {context}]")


# ----------------------------------------------------------------------------------------------
# the exchange
# ----------------------------------------------------------------------------------------------

def _all_to_all(x: Tensor, in_splits: List[int], out_splits: List[int], group) -> Tensor:
    """Rows ``[sum(in_splits[:j]), ...)`` of ``x`` go to rank j; the rows received from rank j
    land at ``sum(out_splits[:j])``. Every backend in use here (NCCL, XCCL, Gloo, MPI) implements
    ``all_to_all_single`` with uneven splits."""
    x = x.contiguous()
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=out_splits, input_split_sizes=in_splits,
                           group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Differentiable all-to-all: the gradient of an exchange is the exchange with the splits
    swapped (every row goes back to the rank it came from)."""

    @staticmethod
    def forward(ctx, x, in_splits, out_splits, group):
        ctx.splits = (in_splits, out_splits)
        ctx.group = group
        return _all_to_all(x, in_splits, out_splits, group)

    @staticmethod
    def backward(ctx, grad):
        in_splits, out_splits = ctx.splits
        return _all_to_all(grad, out_splits, in_splits, ctx.group), None, None, None


def _seq_to_heads(xs: List[Tensor], lens: List[int], rank: int, world: int, group) -> List[Tensor]:
    """Shards ``(B, T_r, H, D)`` of one dtype -> ``(B, T, H/P, D)`` views of the whole sequence,
    head slice ``rank``; one all-to-all for all of them."""
    B, Tr, H, D = xs[0].shape
    hp = H // world
    # send buffer (destination rank, token, tensor, b, head within the slice, d): one copy per tensor
    send = torch.stack([x.reshape(B, Tr, world, hp, D).permute(2, 1, 0, 3, 4) for x in xs], dim=2)
    recv = _AllToAll.apply(send.reshape(world * Tr, len(xs), B, hp, D), [Tr] * world, lens, group)
    # received rows are the senders' shards in rank order, i.e. the whole sequence
    return [recv[:, i].permute(1, 0, 2, 3) for i in range(len(xs))]


def _heads_to_seq(y: Tensor, lens: List[int], rank: int, world: int, group) -> Tensor:
    """``(B, T, H/P, D)`` -> this rank's shard ``(B, T_r, H, D)``, contiguous."""
    B, _, hp, D = y.shape
    Tr = lens[rank]
    recv = _AllToAll.apply(y.permute(1, 0, 2, 3), lens, [Tr] * world, group)   # (P*T_r, B, hp, D)
    return recv.reshape(world, Tr, B, hp, D).permute(2, 1, 0, 3, 4).reshape(B, Tr, world * hp, D).contiguous()


def _exchange_in(xs: List[Optional[Tensor]], lens, rank, world, group) -> List[Optional[Tensor]]:
    """:func:`_seq_to_heads` for tensors of possibly different dtypes (one all-to-all per dtype)."""
    out: List[Optional[Tensor]] = [None] * len(xs)
    for dtype in dict.fromkeys(x.dtype for x in xs if x is not None):
        idx = [i for i, x in enumerate(xs) if x is not None and x.dtype == dtype]
        for i, t in zip(idx, _seq_to_heads([xs[i] for i in idx], lens, rank, world, group)):
            out[i] = t
    return out


# ----------------------------------------------------------------------------------------------
# public operators
# ----------------------------------------------------------------------------------------------

def sol_attn(q: Tensor, k: Tensor, v: Tensor, tau: float = 1.0, scale: Optional[float] = None,
             sink_blocks: Optional[Sequence[int]] = None, sink_q: Optional[Sequence[int]] = None,
             key_bias: Optional[Tensor] = None, topk_ratio: float = 0.0, tail: bool = True,
             block_len: Optional[Tensor] = None, coarse_gate: Optional[Tensor] = None,
             token_aug: int = 0, *, backend: Optional[str] = None, group=None,
             shard_lens: Optional[Sequence[int]] = None) -> Tensor:
    """:func:`solattn.sol_attn` on a sequence sharded over the ranks of ``group``.

    Every rank of the group calls this with the same arguments except its own shards.

    Args:
        q, k, v: this rank's shard ``(B, T_r, H, D)`` of the whole ``(B, T, H, D)`` tensors:
            contiguous in group rank order, any lengths ``T_r >= 0`` (no 64-token alignment
            needed), ``H`` divisible by the group size.
        coarse_gate: sharded like q (it travels with q, k, v), or None.
        key_bias, block_len: whole, describing all ``T`` tokens (``(T,)``/``(B, T)``/... and
            ``(ceil(T/64),)``), identical on every rank: they are per key or per block of the
            gathered sequence and every head slice needs all of them.
        tau, scale, sink_blocks, sink_q, topk_ratio, tail, token_aug, backend: as for
            :func:`solattn.sol_attn`, about the whole sequence (block indices count from token 0).
        group: the process group (None: the default group).
        shard_lens: every rank's ``T_r`` in rank order, when known; skips the small all-gather
            (and the cross-rank shape check) that otherwise runs first.

    Returns:
        This rank's shard ``(B, T_r, H, D)`` of ``solattn.sol_attn`` on the gathered tensors,
        contiguous, v's dtype; differentiable in q, k, v and coarse_gate.
    """
    fn = "solattn.distributed.sol_attn"
    rank, world = _group_info(fn, group)
    _check_local(fn, q, k, v, coarse_gate, "coarse_gate", world)
    if backend is not None:
        dispatch.get_backend(backend)
    args = (tau, scale, sink_blocks, sink_q, key_bias, topk_ratio, tail, block_len)
    if world == 1:
        return _sol_attn(q, k, v, *args, coarse_gate, token_aug, backend=backend)
    lens = _shard_table(fn, q, coarse_gate, "coarse_gate", shard_lens, rank, world, group)
    B, _, H, D = q.shape
    T, hp = sum(lens), H // world

    # every remaining argument is checked against the gathered head slice before the exchange:
    # stand-ins of that shape on q's device, one element of storage each
    def stand_in(dtype):
        return torch.zeros((), dtype=dtype, device=q.device).expand(B, T, hp, D)

    try:
        validate(stand_in(q.dtype), stand_in(q.dtype), stand_in(q.dtype), *args,
                 None if coarse_gate is None else stand_in(coarse_gate.dtype), token_aug)
    except (TypeError, ValueError) as err:
        raise _rename(err, fn, "sol_attn", f"T={T} tokens in shards {lens}, H/{world}={hp} heads "
                                           f"per rank, B={B}, D={D}") from None

    hq, hk, hv, hg = _exchange_in([q, k, v, coarse_gate], lens, rank, world, group)
    out = _sol_attn(hq, hk, hv, *args, hg, token_aug, backend=backend)
    return _heads_to_seq(out, lens, rank, world, group)


def video_sparse_attn(q: Tensor, k: Tensor, v: Tensor, grid, *, gate: Optional[Tensor] = None,
                      group=None, shard_lens: Optional[Sequence[int]] = None, **kwargs) -> Tensor:
    """:func:`solattn.video_sparse_attn` on a sequence sharded over the ranks of ``group``.

    Args:
        q, k, v: this rank's shard ``(B, T_r, H, D)`` of the model's raw token sequence (prefix
            tokens first, then the video latent in raster order, exactly what the single-device
            function takes): contiguous in group rank order, any lengths ``T_r >= 0`` (shards may
            cut through the prefix and through cubes; the cube tiling happens after the gather),
            ``H`` divisible by the group size.
        grid: ``(t, h, w)`` of the whole video latent.
        gate: sharded like q (shape of q's shard; its prefix rows are ignored), or None.
        group, shard_lens: as for :func:`sol_attn`.
        **kwargs: every other keyword of :func:`solattn.video_sparse_attn` (``sparsity``,
            ``topk``, ``scale``, ``backend``, ``prefix_len``, ...), passed on unchanged; they
            describe the whole sequence.

    Returns:
        This rank's shard ``(B, T_r, H, D)`` of the single-device result on the gathered
        tensors, contiguous; differentiable in q, k, v and gate.
    """
    fn = "solattn.distributed.video_sparse_attn"
    rank, world = _group_info(fn, group)
    _check_local(fn, q, k, v, gate, "gate", world)
    if world == 1:
        return _video.video_sparse_attn(q, k, v, grid, gate=gate, **kwargs)
    lens = _shard_table(fn, q, gate, "gate", shard_lens, rank, world, group)
    B, _, H, D = q.shape
    T, hp = sum(lens), H // world

    # dry run on meta tensors of the gathered head-slice shape: argument errors surface before
    # the exchange. Only argument errors count; a check that needs data (not available on meta)
    # is left to the real call, which every rank then reaches with the same arguments.
    def meta(x):
        return x.detach().to("meta") if isinstance(x, Tensor) else x

    shape = (B, T, hp, D)
    try:
        with torch.no_grad():
            _video.video_sparse_attn(*(torch.empty(shape, dtype=q.dtype, device="meta") for _ in range(3)),
                                     grid, gate=None if gate is None else
                                     torch.empty(shape, dtype=gate.dtype, device="meta"),
                                     **{name: meta(x) for name, x in kwargs.items()})
    except (TypeError, ValueError) as err:
        raise _rename(err, fn, "video_sparse_attn", f"T={T} tokens in shards {lens}, "
                                                    f"H/{world}={hp} heads per rank, B={B}, D={D}") from None
    except Exception:  # noqa: BLE001 - a data-dependent check: the real call below makes it
        pass

    hq, hk, hv, hg = _exchange_in([q, k, v, gate], lens, rank, world, group)
    out = _video.video_sparse_attn(hq, hk, hv, grid, gate=hg, **kwargs)
    return _heads_to_seq(out, lens, rank, world, group)
