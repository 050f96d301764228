"""The sequence-parallel operators: :func:`sol_attn` and :func:`video_sparse_attn`."""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch

from .. import dispatch
from ..op import video as _video
from ..op import sol_attn as _sol_attn
from ..validation import validate
from .agree import agree, check_local, check_shard_lens
from .group import _check_timeout, _fail, _group_info
from .pipeline import DEFAULT_HEAD_GROUPS, run

Tensor = torch.Tensor


def _rename(err: Exception, fn: str, old: str, context: str) -> Exception:
    msg = str(err)
    if msg.startswith(old + ":"):
        msg = msg[len(old) + 1:].lstrip()
    return type(err)(f"{fn}: {msg} [checked on the gathered sequence: {context}]")


def _check_groups(fn: str, head_groups) -> int:
    if head_groups is None:
        return DEFAULT_HEAD_GROUPS
    if isinstance(head_groups, bool) or not isinstance(head_groups, int):
        _fail(fn, "head_groups", f"{head_groups!r} of type {type(head_groups).__name__}",
              "None or an int >= 1", TypeError)
    if head_groups < 1:
        _fail(fn, "head_groups", repr(head_groups), "None or an int >= 1 (1: one exchange each way, no overlap)")
    return head_groups


def _agreed(fn: str, q, k, v, gate, gate_name: str, group, shard_lens, timeout, backend, head_groups,
            args: Dict[str, object], values: Dict[str, Optional[Tensor]]):
    """Local checks, then (with more than one rank) the argument agreement. Returns
    ``(rank, world, lens or None, timeout, head groups)``; raises the same error on every rank."""
    rank, world = _group_info(fn, group)
    error, lens_given, limit, groups = None, None, None, None
    try:
        limit = _check_timeout(fn, timeout)
        groups = _check_groups(fn, head_groups)
        check_local(fn, q, k, v, gate, gate_name, world)
        lens_given = check_shard_lens(fn, shard_lens, world)
        if backend is not None:
            dispatch.get_backend(backend)
    except (TypeError, ValueError) as err:
        error = err
    if world == 1:
        if error is not None:
            raise error
        return rank, world, None, limit, groups
    if error is None:
        grads = [torch.is_grad_enabled()] + [bool(x is not None and x.requires_grad) for x in (q, k, v, gate)]
        args = dict(args, shard_lens=lens_given, backend=backend, head_groups=groups,
                    **{f"grad mode, requires_grad of q, k, v, {gate_name}": grads})
    lens = agree(fn, group, rank, world, error, q, gate, gate_name, args, values, lens_given, limit)
    return rank, world, lens, limit, groups


def _context(lens, world, q):
    B, _, H, D = q.shape
    return f"T={sum(lens)} tokens in shards {lens}, H/{world}={H // world} heads per rank, B={B}, D={D}"


def sol_attn(q: Tensor, k: Tensor, v: Tensor, tau: float = 1.0, scale: Optional[float] = None,
             sink_blocks: Optional[Sequence[int]] = None, sink_q: Optional[Sequence[int]] = None,
             key_bias: Optional[Tensor] = None, topk_ratio: float = 0.0, tail: bool = True,
             block_len: Optional[Tensor] = None, coarse_gate: Optional[Tensor] = None,
             token_aug: int = 0, *, backend: Optional[str] = None, group=None,
             shard_lens: Optional[Sequence[int]] = None, timeout=None,
             head_groups: Optional[int] = None) -> Tensor:
    """:func:`solattn.sol_attn` on a sequence sharded over the ranks of ``group``.

    Every rank of the group calls this with the same arguments except its own shards. Before
    any tensor data moves, one small all-gather compares every rank's arguments and its verdict
    on them: a refused argument on any rank, or arguments that differ between ranks, raise the
    same error on every rank.

    Args:
        q, k, v: this rank's shard ``(B, T_r, H, D)`` of the whole ``(B, T, H, D)`` tensors:
            contiguous in group rank order, any lengths ``T_r >= 0`` (no 64-token alignment
            needed), ``H`` divisible by the group size.
        coarse_gate: sharded like q (it travels with q, k, v), or None.
        key_bias, block_len: whole, describing all ``T`` tokens (``(T,)``/``(B, T)``/... and
            ``(ceil(T/64),)``), identical on every rank: they are per key or per block of the
            gathered sequence and every head slice needs all of them. A float ``key_bias``
            requiring grad gets the whole gradient on every rank (the ranks' shares are summed).
        tau, scale, sink_blocks, sink_q, topk_ratio, tail, token_aug, backend: as for
            :func:`solattn.sol_attn`, about the whole sequence (block indices count from token 0).
        group: the process group (None: the default group).
        shard_lens: every rank's ``T_r`` in rank order, when known; checked against the shards.
        timeout: seconds (or ``timedelta``) each collective of this call may wait before raising
            :class:`solattn.distributed.PeerFailure` (a peer raised, died or is not calling);
            None: the process group's own timeout.
        head_groups: how many groups this rank's ``H / P`` heads are exchanged and attended
            in, pipelined: the exchange of one group overlaps the attention of another (capped
            at ``H / P``; None: ``min(8, H / P)``; 1: one exchange each way, no overlap). Any
            value gives the single-device result.

    Returns:
        This rank's shard ``(B, T_r, H, D)`` of ``solattn.sol_attn`` on the gathered tensors,
        contiguous, v's dtype; differentiable in q, k, v, coarse_gate and key_bias.
    """
    fn = "solattn.distributed.sol_attn"
    args = dict(tau=tau, scale=scale, sink_blocks=sink_blocks, sink_q=sink_q, key_bias=key_bias,
                topk_ratio=topk_ratio, tail=tail, block_len=block_len, token_aug=token_aug)
    rank, world, lens, limit, groups = _agreed(fn, q, k, v, coarse_gate, "coarse_gate", group, shard_lens,
                                               timeout, backend, head_groups, args,
                                               dict(key_bias=key_bias, block_len=block_len))
    pos = (tau, scale, sink_blocks, sink_q, key_bias, topk_ratio, tail, block_len)
    if world == 1:
        return _sol_attn(q, k, v, *pos, coarse_gate, token_aug, backend=backend)
    B, _, H, D = q.shape
    T, hp = sum(lens), H // world

    # every remaining argument is checked against the gathered head slice before the exchange
    # (the same verdict on every rank: the arguments agree): stand-ins of that shape on q's
    # device, one element of storage each
    def stand_in(dtype):
        return torch.zeros((), dtype=dtype, device=q.device).expand(B, T, hp, D)

    try:
        validate(stand_in(q.dtype), stand_in(q.dtype), stand_in(q.dtype), *pos,
                 None if coarse_gate is None else stand_in(coarse_gate.dtype), token_aug)
    except (TypeError, ValueError) as err:
        raise _rename(err, fn, "sol_attn", _context(lens, world, q)) from None

    def attn(hq, hk, hv, hg, kb):
        return _sol_attn(hq, hk, hv, *pos[:4], kb, *pos[5:], hg, token_aug, backend=backend)

    kb = key_bias if isinstance(key_bias, Tensor) and key_bias.dtype.is_floating_point else None
    if kb is None:
        return run(lambda hq, hk, hv, hg, _: attn(hq, hk, hv, hg, key_bias), [q, k, v, coarse_gate], None,
                   lens, rank, world, group, groups, limit, fn)
    return run(attn, [q, k, v, coarse_gate], kb, lens, rank, world, group, groups, limit, fn)


def video_sparse_attn(q: Tensor, k: Tensor, v: Tensor, grid, *, gate: Optional[Tensor] = None,
                      group=None, shard_lens: Optional[Sequence[int]] = None, timeout=None,
                      head_groups: Optional[int] = None, **kwargs) -> Tensor:
    """:func:`solattn.video_sparse_attn` on a sequence sharded over the ranks of ``group``.

    Args:
        q, k, v: this rank's shard ``(B, T_r, H, D)`` of the model's raw token sequence (prefix
            tokens first, then the video latent in raster order, exactly what the single-device
            function takes): contiguous in group rank order, any lengths ``T_r >= 0`` (shards may
            cut through the prefix and through cubes; the cube tiling happens after the gather),
            ``H`` divisible by the group size.
        grid: ``(t, h, w)`` of the whole video latent.
        gate: sharded like q (shape of q's shard), or None. Every row is used, prefix rows too:
            as on one device, the coarse branch is added to every row times its gate.
        group, shard_lens, timeout, head_groups: as for :func:`sol_attn`; the arguments are
            agreed the same way.
        **kwargs: every other keyword of :func:`solattn.video_sparse_attn` (``sparsity``,
            ``topk``, ``scale``, ``backend``, ``prefix_len``, ...), passed on unchanged; they
            describe the whole sequence.

    Returns:
        This rank's shard ``(B, T_r, H, D)`` of the single-device result on the gathered
        tensors, contiguous; differentiable in q, k, v and gate.
    """
    fn = "solattn.distributed.video_sparse_attn"
    args = dict(grid=grid, **{name: kwargs[name] for name in sorted(kwargs) if name != "backend"})
    rank, world, lens, limit, groups = _agreed(fn, q, k, v, gate, "gate", group, shard_lens, timeout,
                                               kwargs.get("backend"), head_groups, args, {})
    if world == 1:
        return _video.video_sparse_attn(q, k, v, grid, gate=gate, **kwargs)
    B, _, H, D = q.shape
    shape = (B, sum(lens), H // world, D)

    # dry run on meta tensors of the gathered head-slice shape: argument errors surface before
    # the exchange (the same on every rank: the arguments agree). Only argument errors count; a
    # check that needs data (not available on meta) is left to the real call.
    def meta(x):
        return x.detach().to("meta") if isinstance(x, Tensor) else x

    try:
        with torch.no_grad():
            _video.video_sparse_attn(*(torch.empty(shape, dtype=q.dtype, device="meta") for _ in range(3)),
                                     grid, gate=None if gate is None else
                                     torch.empty(shape, dtype=gate.dtype, device="meta"),
                                     **{name: meta(x) for name, x in kwargs.items()})
    except (TypeError, ValueError) as err:
        raise _rename(err, fn, "video_sparse_attn", _context(lens, world, q)) from None
    except Exception:  # noqa: BLE001 - a data-dependent check: the real call below makes it
        pass

    def attn(hq, hk, hv, hg, _):
        return _video.video_sparse_attn(hq, hk, hv, grid, gate=hg, **kwargs)

    return run(attn, [q, k, v, gate], None, lens, rank, world, group, groups, limit, fn)
