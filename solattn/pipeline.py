"""One op pipeline behind ``sol_attn`` and ``video_sparse_attn``: the ``torch.library`` custom op
``solattn::sol_attn``, its fake, its autograd and its backward op ``solattn::sol_attn_backward``.

A call runs layout -> problem -> dispatch -> selection (the plan) -> backend -> layout back.
The two front doors differ only in their :class:`Route`: ``sol_attn`` (:class:`Route`) runs the
caller's tokens as they are and selects with Sol-Attn's rule (:func:`solattn.routing.build_plan`);
``video_sparse_attn`` (:class:`VideoRoute`) tiles prefix segments and video cubes
(:mod:`solattn.tiling`), selects with VSA's rule (:func:`solattn.routing.build_vsa_plan`) among
the backends that consume a plan, and returns rows in raw token order; a backend that reads the
layout's row table (``Backend.row_table``) gets the caller's tensors and the table instead of
tiled copies (:meth:`VideoRoute.prepare`).

The front doors validate (metadata only, so it also runs while ``torch.compile`` traces with
fake tensors) and call the op, or its computation directly for a plain eager call
(:mod:`solattn.modes`, :mod:`solattn.eager`). The fake makes ``torch.compile(fullgraph=True)`` and
``torch.export`` see one node. Autograd follows the backend that ran the forward
(``Backend.differentiation``, :mod:`solattn.backward`): a backend with its own backward fills the
op's extra outputs and differentiates; otherwise the backward recomputes through a
differentiable backend. A traced backward (compiled training) is the one opaque op
``solattn::sol_attn_backward``, which decides at run time.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import FrozenSet, List, NamedTuple, Optional, Sequence, Tuple

import torch

from . import dispatch, tiling
from .backends.base import Backend, Declined
from .backward import (PLANS, backward_buffers, fake_fused, fake_grads, fused_grads, fused_plan_allowed,
                       grads_as_outputs, grads_from_outputs, own_backward, recompute_grads, run_for_backward)
from .modes import autograd_dispatch, forward_settings, traced
from .routing import Plan, build_plan, build_vsa_plan, plan_with_values
from .routing.fused import fused_plan_usable
from .validation import BLOCK, Problem, validate

Tensor = torch.Tensor


class Call(NamedTuple):
    """The op's arguments that are neither tensors nor the backend choice, in the op's order."""

    tau: float
    scale: Optional[float]
    sink_blocks: Optional[List[int]]
    sink_q: Optional[List[int]]
    topk_ratio: float
    tail: bool
    token_aug: int
    #: VSA's latent grid ``(t, h, w)``; None for ``sol_attn``
    grid: Optional[List[int]]
    #: VSA: video tiles kept per query tile, prefix segment lengths, prefix mode
    k_vid: int
    segments: List[int]
    prefix_mode: str


#: the op's arguments that carry a caller's plan: its selection's tensor fields, None without a plan
PLAN_OPERANDS = len(Plan.TENSOR_FIELDS)


def plan_operands(plan: Optional[Plan]) -> Tuple[Optional[Tensor], ...]:
    """A caller's plan as the op's last :data:`PLAN_OPERANDS` arguments: its selection's
    :meth:`~solattn.routing.Plan.tensors` (one optional tensor each, so that autograd, vmap and
    tracing handle them like the op's other optional inputs; no value term of the call that built
    it travels); all None for none."""
    return (None,) * PLAN_OPERANDS if plan is None else tuple(plan.tensors())


class Route:
    """``sol_attn``'s route: the caller's token layout and Sol-Attn's selection, or the caller's
    (``given``: :func:`plan_operands` of a plan checked by the front door; empty: none), which
    the route then holds (a constant: only backends that consume plans) while the call computes
    its tail, coarse and centring terms from its own tensors (gradients flow through them)."""

    def __init__(self, call: Call, given: Sequence[Optional[Tensor]] = ()):
        self.call = call
        self.given = tuple(given) if given and given[0] is not None else ()

    def rows(self) -> Optional[int]:
        """Rows of the layout the backend runs on, when they are not q's."""
        return None

    def tiled(self, x: Tensor) -> Tensor:
        """Caller's rows (dim 1) -> the backend's."""
        return x

    def untiled(self, x: Tensor) -> Tensor:
        """The backend's rows (dim 1) -> the caller's."""
        return x

    def output_rows(self) -> Optional[Tensor]:
        """The caller's token of every row of the backend's layout, when the two differ (int64)."""
        return None

    def tiled_all(self, xs: Sequence[Optional[Tensor]], backend: Backend) -> List[Optional[Tensor]]:
        """:meth:`tiled` of each of ``xs`` (None stays None); ``backend`` may make them at once."""
        return list(xs)

    def gate(self, gate: Optional[Tensor], tq: Tensor) -> Optional[Tensor]:
        """The coarse gate in the backend's layout (``tq``: q in that layout)."""
        return gate

    def prepare(self, q: Tensor, k: Tensor, v: Tensor, gate: Optional[Tensor], key_bias: Optional[Tensor],
                block_len: Optional[Tensor], requested: Optional[str], want_lse: bool) -> Tuple[Problem, Backend]:
        """``(problem, backend)``: the problem of the backend's layout and the backend that runs it
        (``want_lse``: a backward may follow)."""
        tq, tk, tv = (self.tiled(x) for x in (q, k, v))
        problem = self.problem(tq, tk, tv, self.gate(gate, tq), key_bias, block_len)
        return problem, self.choose(problem, requested)

    def output(self, out: Tensor, problem: Problem) -> Tensor:
        """The backend's output of ``problem`` in the caller's rows (a problem with a row table
        wrote them there already)."""
        return out if problem.rows is not None else self.untiled(out)

    def problem(self, q: Tensor, k: Tensor, v: Tensor, gate: Optional[Tensor], key_bias: Optional[Tensor],
                block_len: Optional[Tensor]) -> Problem:
        """The validated problem of the backend's layout."""
        c = self.call
        return validate(q, k, v, c.tau, c.scale, c.sink_blocks, c.sink_q, key_bias, c.topk_ratio, c.tail,
                        block_len, gate, c.token_aug)

    def requested(self, requested: Optional[str]) -> Optional[str]:
        """The backend asked for by name (checked that it can serve this route), or None."""
        return requested

    def choose(self, problem: Problem, requested: Optional[str]) -> Backend:
        return dispatch.choose(problem, requested, plan_only=bool(self.given))

    def plan(self, problem: Problem, fused: bool = False, extras: FrozenSet[str] = frozenset()):
        """The routing plan of ``problem``: the caller's selection with ``problem``'s own terms,
        else the selection rule's (``extras``: what a fused plan also makes for the backend,
        ``Backend.plan_extras``)."""
        if self.given:           # plan_operands back to a selection, detached: a constant of the call
            return plan_with_values(problem, Plan.from_tensors([t.detach() for t in self.given], problem.T))
        return self.build(problem, fused, extras)

    def build(self, problem: Problem, fused: bool = False, extras: FrozenSet[str] = frozenset()):
        """The selection rule: the routing plan of ``problem``."""
        return build_plan(problem, fused=fused, extras=extras)


class VideoRoute(Route):
    """``video_sparse_attn``'s route: prefix segments and video cubes tiled into 64-row blocks,
    VSA's selection, only backends that consume a routing plan."""

    def __init__(self, call: Call, device: torch.device, given: Sequence[Optional[Tensor]] = ()):
        super().__init__(call, given)
        self.device = device
        #: the tiled layout's tables (cached per grid, segments and device by :func:`solattn.tiling.layout`)
        self.layout = tiling.layout(tuple(call.grid), tiling.DEFAULT_CUBE, tuple(call.segments), device)

    def rows(self) -> int:
        return self.layout.block_len.shape[0] * BLOCK

    def tiled(self, x: Tensor) -> Tensor:
        return tiling.to_tiled(x, self.layout)

    def untiled(self, x: Tensor) -> Tensor:
        return x.index_select(1, self.layout.slots)

    def output_rows(self) -> Tensor:
        return self.layout.gather

    def tiled_all(self, xs, backend):
        """By the backend (``Backend.tiled_copies``: several tensors in one launch) where it makes
        them, else one gather each."""
        present = [x for x in xs if x is not None]
        made = backend.tiled_copies(present, self.layout.gather, self.layout.block_len, self.rows()) \
            if present and backend.row_table else None
        made = iter(made if made is not None else [self.tiled(x) for x in present])
        return [None if x is None else next(made) for x in xs]

    def gate(self, gate, tq):
        return tiling.tiled_gate(gate, tq, self.layout)

    def problem(self, q, k, v, gate, key_bias, block_len) -> Problem:
        """Marked ``dead_rows_zero``: :func:`solattn.tiling.to_tiled` wrote zeros into the dead
        rows, so block sums and TMA loads may read them. The forward and the backward's rebuild
        take the problem from here, so both sum the same way."""
        return self._problem(q, k, v, gate, None)

    def _problem(self, q: Tensor, k: Tensor, v: Tensor, gate: Optional[Tensor], rows: Optional[Tensor]) -> Problem:
        """The problem of the tiled layout, with the row table ``rows`` or on tiled copies. Built
        directly rather than through :func:`solattn.validation.validate`: the front door checked
        q, k, v, the scale and the gate (these are those tensors, or copies of their shape), and
        the rest is the layout's. ``sink_q``: the query tiles that attend every tile (the
        prefix's); the selection is the plan's, a backend may schedule those long rows first."""
        P = self.layout.num_prefix_blocks
        scale = self.call.scale
        return Problem(q=q, k=k, v=v, scale=q.shape[3] ** -0.5 if scale is None else scale, tau=1.0,
                       topk_ratio=0.0, tail=False, sink_blocks=None, sink_q=(0, P) if P else None, key_bias=None,
                       block_len=self.layout.block_len, coarse_gate=gate, dead_rows_zero=rows is None, rows=rows)

    def prepare(self, q, k, v, gate, key_bias, block_len, requested, want_lse):
        """No tiled copies where the chosen backend reads the layout's row table
        (``Backend.row_table``): a problem with ``rows``, the caller's tensors and ``block_len``,
        when the plan needs no tiled copy either: the fused plan, which reads the table too
        (:func:`solattn.backward.fused_plan_allowed`). A caller's selection takes tiled copies:
        the call's block means are summed from them (:func:`solattn.routing.plan_with_values`).
        The forward's ``lse`` and ``resid`` are in the tiled rows."""
        problem = self.row_problem(q, k, v, gate)
        chosen = self.choose(problem, requested)
        if chosen.row_table and not self.given and fused_plan_allowed(chosen, problem, want_lse) \
                and fused_plan_usable(problem):
            return problem, chosen
        return super().prepare(q, k, v, gate, key_bias, block_len, requested, want_lse)

    def row_problem(self, q: Tensor, k: Tensor, v: Tensor, gate: Optional[Tensor]) -> Problem:
        """The tiled layout's problem on the caller's tensors through the row table (``Problem.rows``)."""
        if gate is not None and gate.dim() == 0:         # a constant gate: a stride-0 view of q's shape
            gate = gate.expand(q.shape)
        return self._problem(q, k, v, gate, self.layout.gather)

    def requested(self, requested: Optional[str]) -> Optional[str]:
        backend = plan_backend(requested)
        return backend.name if backend is not None else None

    def choose(self, problem, requested):
        return dispatch.choose(problem, requested, plan_only=True)

    def build(self, problem, fused=False, extras=frozenset()):
        c = self.call
        return build_vsa_plan(problem, c.k_vid, self.layout.num_prefix_blocks, c.prefix_mode, fused=fused,
                              extras=extras)


def _as_is(x: Tensor) -> Tensor:
    return x


def plan_backend(requested: Optional[str]) -> Optional[Backend]:
    """The backend asked for by ``backend=`` or ``use_backend``, checked to consume plans; or None.

    The ``reference`` backend recomputes ``sol_attn``'s own selection and ignores plans, so it
    cannot serve VSA: asking for it (or for any backend with ``uses_plan=False``) is an error.
    """
    explicit = requested or dispatch.forced_backend()
    if not explicit:
        return None
    backend = dispatch.get_backend(explicit)
    if not backend.uses_plan:
        usable = [n for n in dispatch.registered() if dispatch.get_backend(n).uses_plan]
        raise dispatch.BackendError(
            f"video_sparse_attn: backend '{backend.name}' cannot serve VSA: it does not consume a "
            f"routing plan, so it would apply sol_attn's own selection instead of VSA's. "
            f"Backends that consume plans: {', '.join(usable) or 'none registered'}")
    return backend


def route_of(call: Call, device: torch.device, given: Sequence[Optional[Tensor]] = ()) -> Route:
    return Route(call, given) if call.grid is None else VideoRoute(call, device, given)


def run(route: Route, q: Tensor, k: Tensor, v: Tensor, gate: Optional[Tensor], key_bias: Optional[Tensor],
        block_len: Optional[Tensor], requested: Optional[str],
        buffers: Optional[Tuple[Tensor, Tensor]] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """Layout, problem, dispatch, plan, backend, layout back: ``(out, fused)`` in the caller's
    layout, ``fused`` as :func:`solattn.backward.run_for_backward` returns it when ``buffers``
    (``(lse, resid)`` from :func:`backward_buffers`) are given, else None. Autograd records
    as the chosen backend allows (the backward's recomputation runs here)."""
    requested = route.requested(requested)
    want = buffers is not None and buffers[0].numel() > 0
    problem, chosen = route.prepare(q, k, v, gate, key_bias, block_len, requested, want)
    from_kernels = fused_plan_allowed(chosen, problem, want)
    extras = chosen.plan_extras(problem) if from_kernels else frozenset()
    plan = route.plan(problem, from_kernels, extras) if chosen.uses_plan else None
    while True:
        try:
            if buffers is None:
                return route.output(chosen.forward(problem, plan), problem), None
            out, fused = run_for_backward(chosen, problem, plan, *buffers)
            return route.output(out, problem), fused
        except Declined as declined:         # the backend could not run it after all
            if requested or dispatch.forced_backend():     # asked for by name: run or raise
                raise dispatch.BackendError(f"backend '{chosen.name}' was asked for by name and could not run "
                                            f"this call: {declined}") from declined.__cause__
            declined_by = chosen.name
            with dispatch.without_forced_backend():        # the next one does (the route's choice: VSA's
                chosen = route.choose(problem, None)       # and a given plan's need a backend that runs plans)
            _log_fallback(declined_by, str(declined), chosen.name)
            if not chosen.uses_plan:
                plan = None
            elif plan is None:
                plan = route.plan(problem)


_fallbacks_logged: set = set()


def _log_fallback(declined_by: str, why: str, ran_on: str) -> None:
    """One log line (logger ``solattn``, WARNING) per backend and reason: an automatic choice
    that could not run a call, and where it ran instead."""
    if (declined_by, why) not in _fallbacks_logged:
        _fallbacks_logged.add((declined_by, why))
        logging.getLogger("solattn").warning("solattn: %s; the call ran on '%s' instead (the automatic choice "
                                             "passes '%s' over for this shape from now on)", why, ran_on,
                                             declined_by)


def forward(q: Tensor, k: Tensor, v: Tensor, tau: float, scale: Optional[float],
            sink_blocks: Optional[List[int]], sink_q: Optional[List[int]], key_bias: Optional[Tensor],
            topk_ratio: float, tail: bool, block_len: Optional[Tensor], coarse_gate: Optional[Tensor],
            token_aug: int, backend: str, want_lse: bool, grid: Optional[List[int]], k_vid: int,
            segments: List[int], prefix_mode: str, *given: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The op's computation: ``(out, lse, resid, fused)``, where ``lse``, ``resid`` (in the
    backend's layout) and the CPU tensor ``fused`` are for the backward; ``want_lse``: a
    backward may follow; ``given``: the caller's plan (:func:`plan_operands`), or nothing."""
    route = routed(q, tau, scale, sink_blocks, sink_q, topk_ratio, tail, token_aug, grid, k_vid, segments,
                   prefix_mode, given)
    with torch.no_grad():  # the forward never records autograd
        lse, resid = backward_buffers(q, v, want_lse, route.rows())
        out, fused = run(route, q, k, v, coarse_gate, key_bias, block_len, backend or None, (lse, resid))
        return out, lse, resid, fused


def routed(q: Tensor, tau, scale, sink_blocks, sink_q, topk_ratio, tail, token_aug, grid, k_vid, segments,
           prefix_mode, given) -> Route:
    """The route of the op's arguments."""
    call = Call(tau, scale, sink_blocks, sink_q, topk_ratio, tail, token_aug, grid, k_vid, segments, prefix_mode)
    return route_of(call, q.device, given)


@torch.library.custom_op("solattn::sol_attn", mutates_args=())
def sol_attn_op(q: Tensor, k: Tensor, v: Tensor, tau: float, scale: Optional[float],
                sink_blocks: Optional[List[int]], sink_q: Optional[List[int]], key_bias: Optional[Tensor],
                topk_ratio: float, tail: bool, block_len: Optional[Tensor], coarse_gate: Optional[Tensor],
                token_aug: int, backend: str, want_lse: bool, grid: Optional[List[int]], k_vid: int,
                segments: List[int], prefix_mode: str, plan_kv_num_blocks: Optional[Tensor],
                plan_kv_indices: Optional[Tensor], plan_block_len: Optional[Tensor],
                plan_touches_dead: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """See :func:`forward`; ``plan_*``: :func:`plan_operands`."""
    return forward(q, k, v, tau, scale, sink_blocks, sink_q, key_bias, topk_ratio, tail, block_len, coarse_gate,
                   token_aug, backend, want_lse, grid, k_vid, segments, prefix_mode, plan_kv_num_blocks,
                   plan_kv_indices, plan_block_len, plan_touches_dead)


@sol_attn_op.register_fake
def _(q, k, v, tau, scale, sink_blocks, sink_q, key_bias, topk_ratio, tail, block_len, coarse_gate, token_aug,
      backend, want_lse, grid, k_vid, segments, prefix_mode, *given):
    rows = None if grid is None else tiling.tiled_rows(grid, segments)
    return (torch.empty(q.shape, dtype=v.dtype, device=v.device), *backward_buffers(q, v, want_lse, rows),
            fake_fused())


def setup_context(ctx, inputs, output):
    q, k, v, tau, scale, sink_blocks, sink_q, key_bias, topk_ratio, tail, block_len, coarse_gate, \
        token_aug, backend, want_lse, grid, k_vid, segments, prefix_mode, *given = inputs
    out, lse, resid, fused = output
    ctx.mark_non_differentiable(lse, resid, fused)
    ctx.set_materialize_grads(False)     # no zero gradients for them: resid is as large as q
    ctx.save_for_backward(q, k, v, key_bias, block_len, coarse_gate, out, lse, resid, fused, *given)
    ctx.args = (tau, scale, sink_blocks, sink_q, topk_ratio, tail, token_aug, grid, k_vid, segments, prefix_mode,
                backend)
    ctx.settings = forward_settings()
    ctx.plan = PLANS.take(fused)


def _grads(q, k, v, key_bias, block_len, coarse_gate, out, lse, resid, fused, grad_out,
           tau, scale, sink_blocks, sink_q, topk_ratio, tail, token_aug, grid, k_vid, segments, prefix_mode,
           backend, bias_grad: bool, gate_grad: bool, given=(), settings=None, plan=None):
    """``(dq, dk, dv, dgate, dbias)`` of the op (None where not asked for): the own backward of
    the backend that ran the forward, else a recomputation through a differentiable backend.
    ``given``: the caller's plan as tensors, or empty; ``settings``, ``plan``: the forward's
    context and kept plan, when the backward runs eagerly."""
    route = routed(q, tau, scale, sink_blocks, sink_q, topk_ratio, tail, token_aug, grid, k_vid, segments,
                   prefix_mode, given)
    gate = coarse_gate
    own = own_backward(lse, fused)
    if own is None:
        def recompute(leaves, name):
            qd, kd, vd, gd, bd = leaves
            return run(route, qd, kd, vd, gd, key_bias if bd is None else bd, block_len, name)[0]

        gq, gk, gv, gg, gb = recompute_grads(recompute, (q, k, v, gate, key_bias if bias_grad else None), grad_out,
                                             backend or None, required={4: "key_bias"}, settings=settings)
        return gq, gk, gv, gg if gate_grad else None, gb

    # The own backward's inner loops read tiled copies for VSA even where the forward read the row
    # table: on an H200 (B=1 H=56 D=128 bf16, gated, 16x48x48) forward + backward took 48.9 ms so
    # against 60.6 ms through the table with 58 of 576 tiles, 87.9 against 108.1 ms with 116 (each
    # block load waits on its row index). q, k, v, dO and a gate of q's shape are tiled at once (one
    # launch where the backend makes them); a backend that reads a row table reads the output and
    # writes the gradients in the caller's order itself (no gather: ~0.3 ms a tensor at 16x48x48).
    gate_rows = gate if gate is not None and gate.dim() > 0 else None
    tq, tk, tv, tdo, tg = route.tiled_all((q, k, v, grad_out, gate_rows), own)
    tg = tg if gate_rows is not None else route.gate(gate, tq)
    rows = route.output_rows() if own.row_table else None
    # the output to the backend's rows and its gradients back: done by the backend itself with rows
    to_rows, from_rows = (route.tiled, route.untiled) if rows is None else (_as_is, _as_is)

    def problem_of(qd, kd, vd):
        return route.problem(qd, kd, vd, tg, key_bias, block_len)

    gq, gk, gv, gg, gb = fused_grads(own, problem_of, route.plan, (tq, tk, tv), to_rows(out), lse, resid,
                                     tdo, bias_grad=bias_grad, settings=settings, saved=plan, rows=rows)
    gq, gk, gv = (from_rows(g) for g in (gq, gk, gv))
    if gg is not None and gate_grad:                 # a constant (0-dim) gate sums its rows' gradients
        gg = (gg.sum() if gate.dim() == 0 else from_rows(gg)).to(gate.dtype)
    else:
        gg = None
    if gb is not None:                       # (B or 1, T) summed over heads -> key_bias's shape
        if key_bias.numel() != gb.numel():
            gb = gb.sum(dim=0, keepdim=True)
        gb = gb.reshape(key_bias.shape).to(key_bias.dtype)
    return gq, gk, gv, gg, gb


def _grad_like(q, k, v, key_bias, coarse_gate, bias_grad: bool, gate_grad: bool):
    """The inputs the backward op returns gradients for (None: an empty result), for it and its fake."""
    return q, k, v, coarse_gate if gate_grad else None, key_bias if bias_grad else None


@torch.library.custom_op("solattn::sol_attn_backward", mutates_args=())
def sol_attn_backward_op(q: Tensor, k: Tensor, v: Tensor, key_bias: Optional[Tensor], block_len: Optional[Tensor],
                         coarse_gate: Optional[Tensor], out: Tensor, lse: Tensor, resid: Tensor, fused: Tensor,
                         grad_out: Tensor, tau: float, scale: Optional[float], sink_blocks: Optional[List[int]],
                         sink_q: Optional[List[int]], topk_ratio: float, tail: bool, token_aug: int,
                         grid: Optional[List[int]], k_vid: int, segments: List[int], prefix_mode: str,
                         backend: str, bias_grad: bool, gate_grad: bool, plan_kv_num_blocks: Optional[Tensor],
                         plan_kv_indices: Optional[Tensor], plan_block_len: Optional[Tensor],
                         plan_touches_dead: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward of ``solattn::sol_attn`` as one op, for a traced backward (compiled training,
    ``fullgraph=True`` included): :func:`_grads`, absent gradients as ``(0,)`` tensors."""
    with autograd_dispatch():
        grads = _grads(q, k, v, key_bias, block_len, coarse_gate, out, lse, resid, fused, grad_out, tau, scale,
                       sink_blocks, sink_q, topk_ratio, tail, token_aug, grid, k_vid, segments, prefix_mode,
                       backend, bias_grad, gate_grad, (plan_kv_num_blocks, plan_kv_indices, plan_block_len,
                                                       plan_touches_dead))
    return grads_as_outputs(grads, _grad_like(q, k, v, key_bias, coarse_gate, bias_grad, gate_grad),
                            (q, k, v, key_bias, block_len, coarse_gate, out, grad_out))


@sol_attn_backward_op.register_fake
def _(q, k, v, key_bias, block_len, coarse_gate, out, lse, resid, fused, grad_out, tau, scale, sink_blocks,
      sink_q, topk_ratio, tail, token_aug, grid, k_vid, segments, prefix_mode, backend, bias_grad, gate_grad,
      *given):
    return fake_grads(_grad_like(q, k, v, key_bias, coarse_gate, bias_grad, gate_grad), q)


def op_backward(ctx, grad_out, _grad_lse, _grad_resid, _grad_fused):
    if grad_out is None:     # no gradient defined for the output (materialize_grads is off): none for the inputs
        return (None,) * (19 + PLAN_OPERANDS)
    q, k, v, key_bias, block_len, coarse_gate, out, lse, resid, fused, *given = ctx.saved_tensors
    # a float key_bias is differentiated when autograd asks for it (a bool one has no gradient)
    bias_grad = bool(ctx.needs_input_grad[7] and key_bias is not None and key_bias.is_floating_point())
    gate_grad = bool(ctx.needs_input_grad[11] and coarse_gate is not None)
    saved = (q, k, v, key_bias, block_len, coarse_gate, out, lse, resid, fused, grad_out, *ctx.args,
             bias_grad, gate_grad)
    if traced(grad_out):     # the branch on the forward's ``fused`` flag reads data: one opaque op
        gq, gk, gv, gg, gb = grads_from_outputs(sol_attn_backward_op(*saved, *given))
    else:
        gq, gk, gv, gg, gb = _grads(*saved, given, settings=ctx.settings, plan=ctx.plan)
    # the caller's selection is a constant of the call: no gradient
    return (gq, gk, gv, None, None, None, None, gb, None, None, None, gg, None, None, None, None, None, None,
            None, *([None] * PLAN_OPERANDS))


sol_attn_op.register_autograd(op_backward, setup_context=setup_context)
