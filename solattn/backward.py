"""What a backward pass of the op needs, and the two ways it differentiates.

The forward's extra outputs (:func:`backward_buffers`, a :data:`PLANS` token and which backend's
backward applies, :func:`run_for_backward`); a backend's own backward (:func:`fused_grads`,
with the plan's tail terms carried through autograd, :func:`grads_through_plan`, and its coarse
term's gradient computed directly, :func:`coarse_token_grads`);
and recomputation through a differentiable backend (:func:`recompute_grads`). The selection is
treated as constant either way.
"""

from __future__ import annotations

import itertools
import threading
from typing import Callable, List, Optional, Tuple

import torch

from . import dispatch
from .backends.base import Backend, BackwardBuffers, Gradients
from .routing.coarse_grad import coarse_block_grads, spread_rows
from .routing.stats import block_stats
from .validation import BLOCK, Problem

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


def fused_grads(backend: Backend, problem_of: Callable, make_plan: Callable, inputs, out: Tensor, lse: Tensor,
                resid: Tensor, grad_out: Tensor, bias_grad: bool, settings=None, saved=None,
                rows: Optional[Tensor] = None):
    """Gradients through ``backend``'s own backward. ``problem_of(q, k, v)`` validates the
    forward's problem on the given tensors, ``make_plan(problem)`` rebuilds its plan (the same
    selection: same inputs); ``inputs`` = ``(q, k, v)``; ``out``, ``lse``, ``resid`` the forward's outputs.
    Returns ``(dq, dk, dv, dgate, dbias)`` in the problem's layout (``dbias`` ``(B, T)`` fp32 summed
    over heads, or None). ``settings``: the forward's context (memory budget, backend choice);
    ``saved``: the forward's plan when it was kept (:data:`PLANS`), used instead of a rebuild when
    the plan has no tail terms (:func:`rebuilds_plan`). A coarse term's gradient that the backend
    hands back (``Gradients.plan["coarse"]``) is carried to q, k, v here. ``rows``: see
    :meth:`Backend.backward` (``out`` and the returned gradients in the caller's token order; a
    problem whose gradients need plan terms carried to q, k, v here takes none)."""
    if settings is not None:
        return settings.copy().run(fused_grads, backend, problem_of, make_plan, inputs, out, lse, resid,
                                   grad_out, bias_grad, None, saved, rows)
    probe = problem_of(*inputs)
    tail = rebuilds_plan(probe)
    if tail:
        leaves = [t.detach().requires_grad_(True) for t in inputs]
        with torch.enable_grad():
            problem = problem_of(*leaves)
            plan = make_plan(problem)
    else:
        problem = probe
        if saved is not None:
            plan = saved
        else:
            with torch.no_grad():
                plan = make_plan(problem, fused_plan_allowed(backend, problem, True))
    if rows is not None and tail:
        raise RuntimeError("fused_grads: a tail's terms are carried to q, k, v in the problem's rows; "
                           "its gradients cannot come back in the caller's token order (rows)")
    extra_rows = {"rows": rows} if rows is not None else {}
    grads = backend.backward(problem, plan, out, BackwardBuffers(lse, resid), grad_out, bias_grad, **extra_rows)
    dq, dk, dv = grads.dq, grads.dk, grads.dv
    if rows is not None and "coarse" in grads.plan:
        raise RuntimeError(f"fused_grads: backend {backend.name!r} handed back the coarse term's gradient "
                           "with rows given; a backend that takes rows applies it in its kernels")
    if tail:
        extra = grads_through_plan(plan, grads, leaves)
    elif "coarse" in grads.plan:
        extra = coarse_token_grads(problem, plan, grads.plan["coarse"])
    else:
        extra = (None, None, None)
    dq, dk, dv = (d if e is None else d + e.to(d.dtype) for d, e in zip((dq, dk, dv), extra))
    return dq, dk, dv, grads.dgate, grads.dbias


def coarse_token_grads(problem: Problem, plan, dcoarse: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """The coarse branch's share of ``(dq, dk, dv)``, fp32 of q's shape, from the gradient of the
    plan's coarse term ``dcoarse`` ``(B, H, n, D)``, for a backend whose backward hands it back
    instead of applying it (a fused backend applies it in its kernels). The problem's q, k, v
    hold its rows (a backward never reads through a row table)."""
    with torch.no_grad():
        stats = block_stats(problem)
        grads = coarse_block_grads(stats.qm, stats.km, stats.vm, dcoarse, problem.scale)
        return tuple(spread_rows(g, plan.block_len, problem.T) for g in grads)


def grads_through_plan(plan, grads: Gradients, leaves) -> Tuple[Optional[Tensor], ...]:
    """Back-propagate the plan terms' gradients (``grads.plan``) through the plan's differentiable
    terms (built with autograd from the block means of ``leaves`` = ``(q, k, v)``) to ``leaves``;
    ``(None, None, None)`` when the plan records none of them."""
    outs, gouts = [], []
    for name, g in grads.plan.items():
        t = getattr(plan, name)
        if t is not None and t.requires_grad:
            outs.append(t)
            gouts.append(g.to(t.dtype))
    if not outs:
        return (None, None, None)
    return torch.autograd.grad(outs, list(leaves), gouts, allow_unused=True)


def recompute_grads(forward, inputs, grad_out, requested: Optional[str], required=(), settings=None):
    """Gradients of a custom op by recomputation: ``forward(leaves, backend_name)`` runs again with
    autograd on detached copies of ``inputs`` (``None`` entries stay ``None``) through
    :func:`dispatch.differentiable_request`'s backend, or the device's first differentiable one.
    Returns one gradient (or ``None``) per input. ``required`` maps input positions to names
    whose gradient must exist: a backend whose graph does not reach one is an error, not a
    silent ``None``. ``settings`` (from :func:`solattn.modes.forward_settings`) runs the
    recomputation under the scoped settings (``use_backend``, ``memory_budget``) that were in
    force at the forward call."""
    if settings is not None:   # a copy: two backward passes of one graph may run at once
        return settings.copy().run(recompute_grads, forward, inputs, grad_out, requested, required)
    name = dispatch.differentiable_request(requested)
    leaves = [t.detach().requires_grad_(True) if t is not None else None for t in inputs]
    with torch.enable_grad(), dispatch.without_forced_backend():
        out = forward(leaves, name)
        wanted = [t for t in leaves if t is not None]
        grads = iter(torch.autograd.grad(out, wanted, grad_out, allow_unused=True))
    result = [next(grads) if t is not None else None for t in leaves]
    for pos, arg in dict(required).items():
        if leaves[pos] is not None and result[pos] is None:
            used = f"backend '{name}'" if name else "the device's first differentiable backend"
            raise dispatch.BackendError(
                f"{used} cannot differentiate argument '{arg}' (its forward records no autograd "
                f"through it); pass backend='sdpa' or backend='reference' for the backward pass")
    return result


def grads_as_outputs(grads, like, inputs) -> Tuple[Tensor, ...]:
    """A backward op's results: for each input in ``like`` that gets a gradient, that gradient
    (contiguous, the input's dtype, zeros where autograd had none, never sharing memory with
    ``inputs``, as a custom op's output must not); a ``(0,)`` tensor where ``like`` holds None."""
    storages = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, Tensor)}
    result = []
    for g, t in zip(grads, like):
        if t is None:
            result.append(inputs[0].new_empty((0,)))
            continue
        g = (torch.zeros_like(t) if g is None else g).to(t.dtype).contiguous()
        result.append(g.clone() if g.untyped_storage().data_ptr() in storages else g)
    return tuple(result)


def fake_grads(like, first: Tensor) -> Tuple[Tensor, ...]:
    """The fake implementation of a backward op: :func:`grads_as_outputs`'s shapes and dtypes."""
    return tuple(first.new_empty((0,)) if t is None else torch.empty(t.shape, dtype=t.dtype, device=t.device)
                 for t in like)


def grads_from_outputs(outputs) -> List[Optional[Tensor]]:
    """Inverse of :func:`grads_as_outputs`: an empty result is no gradient."""
    return [g if g.numel() else None for g in outputs]
