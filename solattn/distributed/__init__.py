"""Sequence-parallel ``sol_attn`` and ``video_sparse_attn`` over ``torch.distributed``.

DeepSpeed-Ulysses layout: every rank of a process group holds a contiguous shard of the
sequence with all heads. One all-to-all trades that for the whole sequence with ``H / P``
heads (``P`` = group size), the single-device function runs on it (both operators are
head-local: every statistic and every routing decision is per (batch, head)), and the inverse
all-to-all returns each rank its own tokens with all heads.

Sharding (dim 1, the token axis): rank ``r`` of the group holds tokens
``[o_r, o_r + T_r)`` of the whole sequence, ``o_r = T_0 + ... + T_{r-1}`` (contiguous, in group
rank order). The lengths ``T_r >= 0`` are free: they need not be equal nor multiples of 64,
because routing blocks are cut from the gathered sequence. :func:`shard_lengths` gives the usual
choice, ``ceil(T / P)`` tokens per rank with a shorter (possibly empty) last shard.

Every call starts with one small all-gather in which the ranks agree on their arguments and
learn the shard lengths (:mod:`.agree`), so that every rank raises the same error or none.
The exchange uses ``torch.distributed.all_to_all_single`` (NCCL on CUDA, XCCL on XPU, Gloo on the
CPU: Gloo implements it, uneven splits included), one head group at a time and asynchronously,
so that it overlaps the attention of another group (:mod:`.pipeline`); everything is
differentiable.

Modules: :mod:`.group` (process groups, sharding, waiting with a time limit), :mod:`.agree`
(argument agreement), :mod:`.exchange` (the all-to-alls of one head group), :mod:`.pipeline`
(the overlapped schedule, forward and backward), :mod:`.ops` (the operators).
"""

from .group import (PROCESS_GROUP_BACKENDS, PeerFailure, destroy_and_exit, gather, init_from_env, shard,
                    shard_lengths)
from .ops import sol_attn, video_sparse_attn

__all__ = ["sol_attn", "video_sparse_attn", "shard_lengths", "shard", "gather", "init_from_env",
           "destroy_and_exit", "PeerFailure", "PROCESS_GROUP_BACKENDS"]
