"""The op's backward: the gradients of a call (:func:`grads`), by the own backward of the
backend that ran the forward (:func:`fused_grads`, with the plan's tail terms carried through
autograd, :func:`grads_through_plan`, and its coarse term's gradient computed directly,
:func:`coarse_token_grads`) or by recomputation through a differentiable backend
(:func:`recompute_grads`). The selection is treated as constant either way. What the forward
kept for it comes from :mod:`.saved`.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

from .. import dispatch
from ..backends.base import Backend, BackwardBuffers, Gradients
from ..routing.coarse_grad import coarse_block_grads, spread_rows
from ..routing.stats import block_stats
from ..validation import Problem
from .call import Call
from .route import route_of, run
from .saved import fused_plan_allowed, own_backward, rebuilds_plan

Tensor = torch.Tensor


def grads(call: Call, out: Tensor, lse: Tensor, resid: Tensor, fused: Tensor, grad_out: Tensor, bias_grad: bool,
          gate_grad: bool, settings=None, plan=None):
    """``(dq, dk, dv, dgate, dbias)`` of ``call`` (None where not asked for: ``bias_grad``,
    ``gate_grad``) from the forward's outputs: the own backward of the backend that ran the
    forward, else a recomputation through a differentiable backend. ``settings``, ``plan``: the
    forward's context and kept plan, when the backward runs eagerly."""
    route = route_of(call)
    gate, key_bias = call.gate, call.key_bias
    own = own_backward(lse, fused)
    if own is None:
        def recompute(leaves, name):
            qd, kd, vd, gd, bd = leaves
            return run(route, call._replace(q=qd, k=kd, v=vd, gate=gate if gd is None else gd,
                                            key_bias=key_bias if bd is None else bd, backend=name or ""))[0]

        leaves = (call.q, call.k, call.v, gate if gate_grad else None, key_bias if bias_grad else None)
        gq, gk, gv, gg, gb = recompute_grads(recompute, leaves, grad_out, call.backend or None,
                                             required={4: "key_bias"}, settings=settings)
        return gq, gk, gv, gg, gb

    # The own backward's inner loops read tiled copies for VSA even where the forward read the row
    # table: on an H200 (B=1 H=56 D=128 bf16, gated, 16x48x48) forward + backward took 48.9 ms so
    # against 60.6 ms through the table with 58 of 576 tiles, 87.9 against 108.1 ms with 116 (each
    # block load waits on its row index). q, k, v, dO and a gate that varies over tokens are tiled at
    # once (one launch where the backend makes them); a backend that reads a row table reads the
    # output and writes the gradients in the caller's order itself (no gather: ~0.3 ms a tensor at
    # 16x48x48).
    copy_gate = route.gate_needs_copy(gate)
    tq, tk, tv, tdo, tg = route.tiled_all((call.q, call.k, call.v, grad_out, gate if copy_gate else None), own)
    tg = tg if copy_gate else route.gate(gate)
    rows = route.output_rows() if own.row_table else None
    # the output to the backend's rows and its gradients back: done by the backend itself with rows
    to_rows, from_rows = (route.tiled, route.untiled) if rows is None else (_as_is, _as_is)

    def problem_of(qd, kd, vd):
        return route.problem(call._replace(q=qd, k=kd, v=vd, gate=tg))

    gq, gk, gv, gg, gb = fused_grads(own, problem_of, route.plan, (tq, tk, tv), to_rows(out), lse, resid,
                                     tdo, bias_grad=bias_grad, settings=settings, saved=plan, rows=rows)
    gq, gk, gv = (from_rows(g) for g in (gq, gk, gv))
    gg = from_rows(gg).to(gate.dtype) if gg is not None and gate_grad else None
    if gb is not None:                       # (B or 1, T) summed over heads -> key_bias's shape
        if key_bias.numel() != gb.numel():
            gb = gb.sum(dim=0, keepdim=True)
        gb = gb.reshape(key_bias.shape).to(key_bias.dtype)
    return gq, gk, gv, gg, gb


def _as_is(x: Tensor) -> Tensor:
    return x


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
    silent ``None``. ``settings`` (from :func:`solattn.op.fast.forward_settings`) runs the
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
