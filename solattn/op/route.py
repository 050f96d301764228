"""A call's way to its backend: layout -> problem -> dispatch -> selection (the plan) -> backend
-> layout back, for both front doors.

The two front doors differ only in their :class:`Route`: ``sol_attn`` (:class:`Route`) runs the
caller's tokens as they are and selects with Sol-Attn's rule (:func:`solattn.routing.build_plan`);
``video_sparse_attn`` (:class:`VideoRoute`) tiles prefix segments and video cubes
(:mod:`solattn.tiling`), selects with VSA's rule (:func:`solattn.routing.build_vsa_plan`) among
the backends that consume a plan, and returns rows in raw token order; a backend that reads the
layout's row table (``Backend.row_table``) gets the caller's tensors and the table instead of
tiled copies (:meth:`VideoRoute.prepare`). :func:`forward` is the op's computation.
"""

from __future__ import annotations

import logging
from typing import FrozenSet, List, Optional, Sequence, Tuple

import torch

from .. import dispatch, tiling
from ..backends.base import Backend, Declined
from ..routing import build_plan, build_vsa_plan, plan_with_values
from ..routing.fused import fused_plan_usable
from ..validation import BLOCK, Problem
from .call import Call
from .saved import backward_buffers, fused_plan_allowed, run_for_backward

Tensor = torch.Tensor


class Route:
    """``sol_attn``'s route: the caller's token layout and Sol-Attn's selection, or the caller's
    (``call.plan``, checked by the front door), which the route then holds (a constant: only
    backends that consume plans) while the call computes its tail, coarse and centring terms from
    its own tensors (gradients flow through them). The route is made from a call and keeps its
    layout, selection and plan; :meth:`prepare`, :meth:`problem` and :func:`run` take the call's
    tensors and backend from the call they are given, the route's own or the same with other
    tensors (the backward's leaves) or backend."""

    def __init__(self, call: Call):
        self.call = call

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

    def tables(self) -> Tuple[Tensor, ...]:
        """The layout's tensors a call reads besides its own (a graph capture keys on them)."""
        return ()

    def tiled_all(self, xs: Sequence[Optional[Tensor]], backend: Backend) -> List[Optional[Tensor]]:
        """:meth:`tiled` of each of ``xs`` (None stays None); ``backend`` may make them at once."""
        return list(xs)

    def gate(self, gate: Optional[Tensor]) -> Optional[Tensor]:
        """The coarse gate in the backend's layout."""
        return gate

    def gate_needs_copy(self, gate: Optional[Tensor]) -> bool:
        """Whether the gate's layout for the backend is a copy (which :meth:`tiled_all` may make
        with others), not :meth:`gate`'s view."""
        return False

    def prepare(self, call: Call, requested: Optional[str], want_lse: bool) -> Tuple[Problem, Backend]:
        """``(problem, backend)``: the problem of ``call`` (this route's call, or the same with
        other tensors) in the backend's layout, and the backend that runs it (``want_lse``: a
        backward may follow)."""
        q, k, v = (self.tiled(x) for x in (call.q, call.k, call.v))
        problem = self.problem(call._replace(q=q, k=k, v=v, gate=self.gate(call.gate)))
        return problem, self.choose(problem, requested)

    def output(self, out: Tensor, problem: Problem) -> Tensor:
        """The backend's output of ``problem`` in the caller's rows (a problem with a row table
        wrote them there already)."""
        return out if problem.rows is not None else self.untiled(out)

    def problem(self, call: Call) -> Problem:
        """The validated problem of ``call``, whose tensors are in the backend's layout."""
        return call.problem()

    def requested(self, requested: Optional[str]) -> Optional[str]:
        """The backend asked for by name (checked that it can serve this route), or None."""
        return requested

    def choose(self, problem: Problem, requested: Optional[str]) -> Backend:
        return dispatch.choose(problem, requested, plan_only=self.call.plan is not None)

    def plan(self, problem: Problem, fused: bool = False, extras: FrozenSet[str] = frozenset()):
        """The routing plan of ``problem``: the caller's selection with ``problem``'s own terms,
        else the selection rule's (``extras``: what a fused plan also makes for the backend,
        ``Backend.plan_extras``)."""
        if self.call.plan is not None:
            return plan_with_values(problem, self.call.plan)
        return self.build(problem, fused, extras)

    def build(self, problem: Problem, fused: bool = False, extras: FrozenSet[str] = frozenset()):
        """The selection rule: the routing plan of ``problem``."""
        return build_plan(problem, fused=fused, extras=extras)


class VideoRoute(Route):
    """``video_sparse_attn``'s route: prefix segments and video cubes tiled into 64-row blocks,
    VSA's selection, only backends that consume a routing plan."""

    def __init__(self, call: Call):
        super().__init__(call)
        #: the tiled layout's tables (cached per grid, segments and device by :func:`solattn.tiling.layout`)
        self.layout = tiling.layout(tuple(call.grid), tiling.DEFAULT_CUBE, tuple(call.segments), call.q.device)

    def rows(self) -> int:
        return self.layout.block_len.shape[0] * BLOCK

    def tiled(self, x: Tensor) -> Tensor:
        return tiling.to_tiled(x, self.layout)

    def untiled(self, x: Tensor) -> Tensor:
        return x.index_select(1, self.layout.slots)

    def output_rows(self) -> Tensor:
        return self.layout.gather

    def tables(self) -> Tuple[Tensor, ...]:
        return (*self.layout[:3], self.layout.block_len)

    def tiled_all(self, xs, backend):
        """By the backend (``Backend.tiled_copies``: several tensors in one launch) where it makes
        them, else one gather each."""
        present = [x for x in xs if x is not None]
        made = backend.tiled_copies(present, self.layout.gather, self.layout.block_len, self.rows()) \
            if present and backend.row_table else None
        made = iter(made if made is not None else [self.tiled(x) for x in present])
        return [None if x is None else next(made) for x in xs]

    def gate(self, gate):
        """A gate that is one value for every token (stride 0 on the token dim: a constant gate)
        stays a view in the tiled rows; another is tiled."""
        return self.tiled(gate) if self.gate_needs_copy(gate) else tiling.tiled_view(gate, self.rows())

    def gate_needs_copy(self, gate):
        """A copy, unless the gate is one value for every token and no gradient is asked of it
        per token (a view of its first row would carry every token's share to that row)."""
        return gate is not None and (gate.stride(1) != 0 or gate.requires_grad)

    def problem(self, call: Call) -> Problem:
        """Marked ``dead_rows_zero``: :func:`solattn.tiling.to_tiled` wrote zeros into the dead
        rows, so block sums and TMA loads may read them. The forward and the backward's rebuild
        take the problem from here, so both sum the same way."""
        return self._problem(call, None)

    def _problem(self, call: Call, rows: Optional[Tensor]) -> Problem:
        """The problem of the tiled layout, with the row table ``rows`` or on tiled copies. Built
        directly rather than through :func:`solattn.validation.validate`: the front door checked
        q, k, v, the scale and the gate (these are those tensors, or copies of their shape), and
        the rest is the layout's. ``sink_q``: the query tiles that attend every tile (the
        prefix's); the selection is the plan's, a backend may schedule those long rows first."""
        P = self.layout.num_prefix_blocks
        q, scale = call.q, call.scale
        return Problem(q=q, k=call.k, v=call.v, scale=q.shape[3] ** -0.5 if scale is None else scale, tau=1.0,
                       topk_ratio=0.0, tail=False, sink_blocks=None, sink_q=(0, P) if P else None, key_bias=None,
                       block_len=self.layout.block_len, coarse_gate=call.gate, dead_rows_zero=rows is None,
                       rows=rows)

    def prepare(self, call, requested, want_lse):
        """No tiled copies where the chosen backend reads the layout's row table
        (``Backend.row_table``): a problem with ``rows``, the caller's tensors and ``block_len``,
        when the plan needs no tiled copy either: the fused plan, which reads the table too
        (:func:`solattn.op.saved.fused_plan_allowed`). A caller's selection takes tiled copies:
        the call's block means are summed from them (:func:`solattn.routing.plan_with_values`).
        The forward's ``lse`` and ``resid`` are in the tiled rows."""
        problem = self.row_problem(call)
        chosen = self.choose(problem, requested)
        if chosen.row_table and call.plan is None and fused_plan_allowed(chosen, problem, want_lse) \
                and fused_plan_usable(problem):
            return problem, chosen
        return super().prepare(call, requested, want_lse)

    def row_problem(self, call: Call) -> Problem:
        """The tiled layout's problem on the caller's tensors through the row table (``Problem.rows``)."""
        return self._problem(call, self.layout.gather)

    def requested(self, requested: Optional[str]) -> Optional[str]:
        backend = plan_backend(requested)
        return backend.name if backend is not None else None

    def choose(self, problem, requested):
        return dispatch.choose(problem, requested, plan_only=True)

    def build(self, problem, fused=False, extras=frozenset()):
        c = self.call
        return build_vsa_plan(problem, c.k_vid, self.layout.num_prefix_blocks, c.prefix_mode, fused=fused,
                              extras=extras)


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


def plan_for(chosen, problem: Problem, fused: bool = True):
    """The routing plan ``chosen`` runs ``problem`` from (None for backends without one); the
    fused plan where the backend accepts it, it applies and ``fused`` allows it."""
    if not chosen.uses_plan:
        return None
    return build_plan(problem, fused=fused and getattr(chosen, "fused_plan", False))


def run_problem(problem: Problem, backend: Optional[str] = None) -> Tensor:
    """Dispatch and run a validated problem (no custom op, autograd as the backend allows)."""
    chosen = dispatch.choose(problem, backend)
    return chosen.forward(problem, plan_for(chosen, problem))


def route_of(call: Call) -> Route:
    """The route of ``call``: VSA's when it has a grid."""
    return Route(call) if call.grid is None else VideoRoute(call)


def run(route: Route, call: Optional[Call] = None,
        buffers: Optional[Tuple[Tensor, Tensor]] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """Layout, problem, dispatch, plan, backend, layout back: ``(out, fused)`` in the caller's
    layout for ``call`` (the route's own, or the same with other tensors or backend), ``fused``
    as :func:`solattn.op.saved.run_for_backward` returns it when ``buffers`` (``(lse, resid)``
    from :func:`backward_buffers`) are given, else None. Autograd records as the chosen backend
    allows (the backward's recomputation runs here)."""
    call = route.call if call is None else call
    requested = route.requested(call.backend or None)
    want = buffers is not None and buffers[0].numel() > 0
    problem, chosen = route.prepare(call, requested, want)
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


def forward(call: Call) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The op's computation: ``(out, lse, resid, fused)``, where ``lse``, ``resid`` (in the
    backend's layout) and the CPU tensor ``fused`` are for the backward (empty unless
    ``call.want_lse``: a backward may follow)."""
    route = route_of(call)
    with torch.no_grad():  # the forward never records autograd
        lse, resid = backward_buffers(call.q, call.v, call.want_lse, route.rows())
        out, fused = run(route, call, (lse, resid))
        return out, lse, resid, fused


def forward_output(call: Call) -> Tensor:
    """:func:`forward`'s output alone, for a plain eager call that no backward follows: the op's
    other outputs, which such a call drops, are not made (two empty buffers and the CPU
    ``fused`` flag: three allocations per call)."""
    with torch.no_grad():
        return run(route_of(call))[0]
