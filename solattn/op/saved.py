"""What a forward of the op keeps for a backward: its extra outputs (:func:`backward_buffers`),
the plan handed to an own backward (:data:`PLANS`) and which backend's backward applies
(:func:`run_for_backward`, :func:`own_backward`). The forward reads only this module; the
backward (:mod:`.backward`) reads it too.
"""

from __future__ import annotations

import itertools
import threading
from typing import List, Optional, Tuple

import torch

from .. import dispatch
from ..backends.base import Backend, BackwardBuffers
from ..validation import BLOCK, Problem

Tensor = torch.Tensor


def backward_buffers(q: Tensor, v: Tensor, want: bool, rows: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """The custom ops' outputs for a backend's own backward, ``(lse, resid)`` (``BackwardBuffers``):
    when a backward may need them (written only by such a backend), an fp32 ``(B, H, n * 64)`` and a
    ``(B, rows, H, D)`` tensor of v's dtype for the output's rounding residual; else two empty
    ``(0,)`` tensors. ``rows``: the sequence length the kernel runs on, when not q's (VSA's tiled
    layout)."""
    if not want:
        return (torch.empty((0,), dtype=torch.float32, device=q.device),
                torch.empty((0,), dtype=v.dtype, device=q.device))
    B, T, H, D = q.shape
    T = T if rows is None else rows
    return (torch.empty((B, H, -(-T // BLOCK) * BLOCK), dtype=torch.float32, device=q.device),
            torch.empty((B, T, H, D), dtype=v.dtype, device=q.device))


class _PlanHandoff:
    """The plan of the last forward an own backward may follow, per thread, from the op's
    computation to its ``setup_context`` (which runs right after it in the same thread and keeps
    the plan on the autograd node: it lives and dies with the graph, and a second backward of a
    retained graph reuses it). The op returns the token in its CPU ``fused`` output; a slot whose
    token does not match is ignored, and each forward overwrites the slot, so at most one plan per
    thread waits here (e.g. when compiled code runs the op without ``setup_context``)."""

    def __init__(self):
        self._tokens = itertools.count(1)
        self._lock = threading.Lock()
        self._slot = threading.local()

    def put(self, plan=None) -> int:
        """A new token (> 0); ``plan`` waits under it (None: nothing to hand over)."""
        with self._lock:
            token = next(self._tokens)
        self._slot.value = (token, plan) if plan is not None else None
        return token

    def take(self, fused: Tensor):
        """The plan waiting under the token in ``fused`` (the op's output), or None."""
        if type(fused) is not torch.Tensor or not fused.numel():     # traced (fake) outputs: nothing
            return None
        waiting = getattr(self._slot, "value", None)
        self._slot.value = None
        token = fused.tolist()[0]          # read in place: no select or item op
        return waiting[1] if waiting is not None and token and waiting[0] == token else None


PLANS = _PlanHandoff()


def rebuilds_plan(problem: Problem) -> bool:
    """Whether the own backward of ``problem`` rebuilds its plan with autograd: it has tail terms,
    whose gradients reach q, k, v through the selection mask and the centred means, so they are
    carried by autograd through a rebuilt plan. The coarse branch needs no rebuild: its gradient
    is computed directly from the kept plan (:mod:`solattn.routing.coarse_grad`)."""
    return problem.tail


def fused_plan_allowed(chosen, problem: Problem, want_lse: bool) -> bool:
    """Whether ``chosen`` runs ``problem`` from the fused (GPU) routing plan: it takes one, unless
    a backward may follow (``want_lse``) that rebuilds the plan's tail terms through the torch
    path (they carry gradients there). The forward then builds its plan the same way, so that
    both passes select the same blocks (the fused plan's products round differently: near-ties
    can flip). ``sol_attn`` and ``video_sparse_attn`` both ask here, and so does a backward that
    rebuilds a plan without autograd (the forward's was not kept)."""
    return bool(getattr(chosen, "fused_plan", False)) and not (want_lse and rebuilds_plan(problem))


#: names of the backends with their own backward that ran a forward of this process, so that
#: the op's ``fused`` output can say which one a backward calls (its position + 1)
_OWN_BACKWARD: List[str] = []


def run_for_backward(chosen: Backend, problem: Problem, plan, lse: Tensor, resid: Tensor) -> Tuple[Tensor, Tensor]:
    """Run the chosen backend; one with its own backward also fills :func:`backward_buffers` when
    they are not empty. Returns the output and ``fused``, a CPU int64 ``(2,)`` tensor: a
    :data:`PLANS` token (the plan waits under it when it has no differentiable block terms) and
    which backend's backward applies (:func:`own_backward`), both 0 when the backward recomputes."""
    if chosen.differentiation == "own" and lse.numel():
        out = chosen.forward_for_backward(problem, plan, BackwardBuffers(lse, resid))
        if chosen.name not in _OWN_BACKWARD:
            _OWN_BACKWARD.append(chosen.name)
        token = PLANS.put(None if rebuilds_plan(problem) else plan)
        return out, torch.tensor([token, _OWN_BACKWARD.index(chosen.name) + 1], dtype=torch.int64)
    return chosen.forward(problem, plan), torch.zeros((2,), dtype=torch.int64)


def own_backward(lse: Tensor, fused: Tensor) -> Optional[Backend]:
    """The backend whose own backward differentiates a forward that returned ``lse`` and
    ``fused`` (:func:`run_for_backward`), or None when the backward recomputes."""
    which = fused.tolist()[1] if lse.numel() else 0
    return dispatch.get_backend(_OWN_BACKWARD[which - 1]) if which else None


def fake_fused() -> Tensor:
    """The fake of :func:`run_for_backward`'s ``fused`` output."""
    return torch.empty((2,), dtype=torch.int64)
