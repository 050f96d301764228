"""The public ``sol_attn`` operator, registered as the ``torch.library`` custom op ``solattn::sol_attn``.

The Python wrapper validates (metadata only, so it also runs while
``torch.compile`` traces with fake tensors) and calls the custom op; the op
builds the plan, dispatches and runs the backend. The fake implementation
makes ``torch.compile(fullgraph=True)`` and ``torch.export`` see one node. A
plain eager call (no gradient, tracing, tensor subclass or dispatch mode, see
:func:`plain_eager`) runs the op's computation directly, through the active
:func:`solattn.graphs.cuda_graphs` cache when there is one.

Autograd follows the backend that ran the forward (``Backend.differentiation``). A
backend with its own backward (``"own"``, e.g. ``triton``) fills the op's extra
outputs (:class:`~solattn.backends.base.BackwardBuffers`) and its ``backward``
gives the token-level gradients; the forward's plan is taken back (:data:`PLANS`)
or, when it has differentiable block terms, rebuilt (same inputs, same selection),
and the gradients of those terms (tail, coarse, key centroid) go through the
plan's block means with torch autograd. Otherwise (``"recompute"``) the backward
pass recomputes the forward with autograd enabled through a differentiable
backend (the one that ran the forward when it supports autograd, else the first
one in the device's priority that does) and differentiates that. The selection
is treated as constant either way.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import threading
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from . import dispatch, graphs
from .budget import BUDGETS, current_budget
from .backends.base import Backend, BackwardBuffers, Gradients
from .routing import build_plan
from .validation import BLOCK, Problem, validate

Tensor = torch.Tensor


def _as_list(rng) -> Optional[List[int]]:
    if rng is None:
        return None
    if isinstance(rng, torch.Tensor):
        rng = rng.tolist()
    return [int(x) for x in rng]


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
        token = int(fused[0])
        return waiting[1] if waiting is not None and token and waiting[0] == token else None


PLANS = _PlanHandoff()


def has_block_terms(problem: Problem) -> bool:
    """Whether the plan of ``problem`` has terms that carry gradients (the tail, the coarse branch):
    the fused backward then rebuilds the plan with autograd instead of reusing the forward's."""
    return problem.tail or problem.coarse_gate is not None


def fused_plan_allowed(chosen, problem: Problem, want_lse: bool) -> bool:
    """Whether ``chosen`` runs ``problem`` from the fused (GPU) routing plan: it takes one, unless
    a backward may follow (``want_lse``) that rebuilds the plan's tail or coarse terms through the
    torch path (they carry gradients there). The forward then builds its plan the same way, so
    that both passes select the same blocks (the fused plan's products round differently:
    near-ties can flip). ``sol_attn`` and ``video_sparse_attn`` both ask here."""
    return bool(getattr(chosen, "fused_plan", False)) and not (want_lse and has_block_terms(problem))


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
        token = PLANS.put(None if has_block_terms(problem) else plan)
        return out, torch.tensor([token, _OWN_BACKWARD.index(chosen.name) + 1], dtype=torch.int64)
    return chosen.forward(problem, plan), torch.zeros((2,), dtype=torch.int64)


def own_backward(lse: Tensor, fused: Tensor) -> Optional[Backend]:
    """The backend whose own backward differentiates a forward that returned ``lse`` and
    ``fused`` (:func:`run_for_backward`), or None when the backward recomputes."""
    which = int(fused[1]) if lse.numel() else 0
    return dispatch.get_backend(_OWN_BACKWARD[which - 1]) if which else None


def _fake_fused() -> Tensor:
    return torch.empty((2,), dtype=torch.int64)


def fused_grads(backend: Backend, problem_of: Callable, make_plan: Callable, inputs, out: Tensor, lse: Tensor,
                resid: Tensor, grad_out: Tensor, bias_grad: bool, settings=None, saved=None):
    """Gradients through ``backend``'s own backward. ``problem_of(q, k, v)`` validates the
    forward's problem on the given tensors, ``make_plan(problem)`` rebuilds its plan (the same
    selection: same inputs); ``inputs`` = ``(q, k, v)``; ``out``, ``lse``, ``resid`` the forward's outputs.
    Returns ``(dq, dk, dv, dgate, dbias)`` in the problem's layout (``dbias`` ``(B, T)`` fp32 summed
    over heads, or None). ``settings``: the forward's context (memory budget, backend choice);
    ``saved``: the forward's plan when it was kept (:data:`PLANS`), used instead of a rebuild when
    the plan has no differentiable block terms."""
    if settings is not None:
        return settings.copy().run(fused_grads, backend, problem_of, make_plan, inputs, out, lse, resid,
                                   grad_out, bias_grad, None, saved)
    probe = problem_of(*inputs)
    block_terms = has_block_terms(probe)
    if block_terms:
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
                plan = make_plan(problem)
    grads = backend.backward(problem, plan, out, BackwardBuffers(lse, resid), grad_out, bias_grad)
    dq, dk, dv = grads.dq, grads.dk, grads.dv
    if block_terms:
        extra = grads_through_plan(plan, grads, leaves)
        dq, dk, dv = (d if e is None else d + e.to(d.dtype) for d, e in zip((dq, dk, dv), extra))
    return dq, dk, dv, grads.dgate, grads.dbias


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
    silent ``None``. ``settings`` (from :func:`forward_settings`) runs the recomputation under the
    scoped settings (``use_backend``, ``memory_budget``) that were in force at the forward call."""
    if settings is not None:
        return settings.copy().run(recompute_grads, forward, inputs, grad_out, requested, required)  # a copy: two backward passes of one graph may run at once
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


def plain_eager(*tensors: Optional[Tensor]) -> bool:
    """True when a call needs nothing the custom op gives: no tracing (torch.compile, export), no
    tensor subclass (fake, meta or distributed tensors) and no active dispatch mode (e.g. a FLOP
    counter). Then the public functions call the op's computation directly and skip the op's
    dispatch and autograd wrapping (several hundred microseconds per call), which is the whole
    cost of small problems; everything else goes through the op."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or _dispatch_mode_active() \
            or _transforms_active():
        return False
    return all(t is None or (type(t) is torch.Tensor and t.device.type != "meta") for t in tensors)


def eager_call(fn: Callable[[], Tensor], tensors: Sequence[Optional[Tensor]], extra: tuple) -> Tensor:
    """Run a plain eager call ``fn``: through the active :func:`solattn.graphs.cuda_graphs` cache
    when there is one and the inputs are on a CUDA device, else directly. ``tensors``: every tensor
    ``fn`` reads; ``extra``: every other argument (lists as tuples). The key also holds the
    settings a call's work depends on (the backend choice's, the memory budgets); module-level
    tunables (e.g. the triton launcher's defaults) are not in it: change them outside the block."""
    cache = graphs.active_cache()
    if cache is None or tensors[0].device.type != "cuda":
        return fn()
    extra = tuple(tuple(x) if isinstance(x, list) else x for x in extra)
    settings = (*dispatch.choice_key(), *(current_budget(name) for name in sorted(BUDGETS)))
    return cache.run(fn, tensors, extra + settings)


def _transforms_active() -> bool:
    """functorch transforms (vmap, grad, jvp) or forward-mode AD: the op's batching / forward-AD
    rules apply to the op, not to its computation."""
    functorch = getattr(torch._C, "_are_functorch_transforms_active", None)
    if functorch is None or functorch():
        return True
    forward_ad = getattr(torch.autograd, "forward_ad", None)
    level = getattr(forward_ad, "_current_level", None)
    return level is None or level >= 0


def _differentiated_by_functorch(t) -> bool:
    """Whether ``t`` is wrapped at a torch.func grad / vjp / jvp level (a ``GradTrackingTensor``
    somewhere under its vmap wrappers): an input those transforms differentiate. Tensors the
    transformed function merely closes over are not wrapped."""
    f = torch._C._functorch
    while isinstance(t, Tensor) and f.is_functorch_wrapped_tensor(t):
        if f.is_gradtrackingtensor(t):
            return True
        t = f.get_unwrapped(t)
    return False


def check_transforms(fn: str, tensors: Sequence[Optional[Tensor]]) -> None:
    """Refuse, before any work, an input that a transform differentiates through the op, which
    has no rule for it: torch.func's grad / vjp / jacrev / jvp (a jvp would silently return a zero
    tangent) and forward-mode AD through dual tensors. ``torch.vmap`` runs (one call per batch entry),
    and so does a transformed function whose derivative does not pass through the op. Skipped while
    torch.compile traces (Dynamo cannot follow these checks; the compiled call runs as before)."""
    if torch.compiler.is_compiling() or not _transforms_active():
        return
    what = None
    try:
        if any(_differentiated_by_functorch(t) for t in tensors):
            what = "a torch.func transform that differentiates (grad, vjp, jacrev, jvp, ...)"
    except AttributeError:                      # a torch without these functorch queries
        pass
    if what is None:
        from torch.autograd import forward_ad
        if getattr(forward_ad, "_current_level", -1) >= 0 and any(
                isinstance(t, Tensor) and forward_ad.unpack_dual(t).tangent is not None for t in tensors):
            what = "forward-mode AD (a dual tensor with a tangent)"
    if what is not None:
        raise NotImplementedError(
            f"{fn}: {what} is not supported: its derivative would be dropped or rejected. Differentiate "
            f"with torch.autograd instead (loss.backward() or torch.autograd.grad); torch.vmap is supported")


def _dispatch_mode_active() -> bool:
    try:
        from torch.utils._python_dispatch import _get_current_dispatch_mode
    except ImportError:          # a future torch without it: be conservative, use the op
        return True
    return _get_current_dispatch_mode() is not None


def forward_settings():
    """The caller's scoped settings, for the backward pass. They are context variables, and
    autograd may run a backward on a worker thread of its own (CUDA) or long after the ``with``
    block has ended: the recomputation must use the settings the forward ran under."""
    if torch.compiler.is_compiling():  # Dynamo cannot trace context variables; compiled code
        return None                    # reads them when the op runs
    return contextvars.copy_context()


def _sol_attn_forward(q: Tensor, k: Tensor, v: Tensor, tau: float, scale: Optional[float],
                      sink_blocks: Optional[List[int]], sink_q: Optional[List[int]],
                      key_bias: Optional[Tensor], topk_ratio: float, tail: bool,
                      block_len: Optional[Tensor], coarse_gate: Optional[Tensor], token_aug: int,
                      backend: str, want_lse: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The computation of ``solattn::sol_attn``: ``(out, lse, resid, fused)``, where ``lse``,
    ``resid`` and the CPU flag ``fused`` are for the backward (see :func:`run_for_backward`);
    ``want_lse``: a backward may follow."""
    problem = validate(q, k, v, tau, scale, sink_blocks, sink_q, key_bias, topk_ratio, tail,
                       block_len, coarse_gate, token_aug)
    with torch.no_grad():  # the forward never records autograd
        chosen = dispatch.choose(problem, backend or None)
        plan = plan_for(chosen, problem, fused=fused_plan_allowed(chosen, problem, want_lse))
        lse, resid = backward_buffers(q, v, want_lse)
        out, fused = run_for_backward(chosen, problem, plan, lse, resid)
        return out, lse, resid, fused


@torch.library.custom_op("solattn::sol_attn", mutates_args=())
def _sol_attn_op(q: Tensor, k: Tensor, v: Tensor, tau: float, scale: Optional[float],
                 sink_blocks: Optional[List[int]], sink_q: Optional[List[int]],
                 key_bias: Optional[Tensor], topk_ratio: float, tail: bool,
                 block_len: Optional[Tensor], coarse_gate: Optional[Tensor], token_aug: int,
                 backend: str, want_lse: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """See :func:`_sol_attn_forward`."""
    return _sol_attn_forward(q, k, v, tau, scale, sink_blocks, sink_q, key_bias, topk_ratio, tail,
                             block_len, coarse_gate, token_aug, backend, want_lse)


@_sol_attn_op.register_fake
def _(q, k, v, tau, scale, sink_blocks, sink_q, key_bias, topk_ratio, tail, block_len,
      coarse_gate, token_aug, backend, want_lse):
    return (torch.empty(q.shape, dtype=v.dtype, device=v.device), *backward_buffers(q, v, want_lse),
            _fake_fused())


def _setup_context(ctx, inputs, output):
    q, k, v, tau, scale, sink_blocks, sink_q, key_bias, topk_ratio, tail, block_len, coarse_gate, \
        token_aug, backend, want_lse = inputs
    out, lse, resid, fused = output
    ctx.mark_non_differentiable(lse, resid, fused)
    ctx.save_for_backward(q, k, v, key_bias, block_len, coarse_gate, out, lse, resid, fused)
    ctx.args = (tau, scale, sink_blocks, sink_q, topk_ratio, tail, token_aug, backend)
    ctx.settings = forward_settings()
    ctx.plan = PLANS.take(fused)


def traced(t: Tensor) -> bool:
    """Whether autograd is running a backward under tracing (torch.compile's AOTAutograd traces
    the backward with fake tensors): the backward must then be one opaque op, as its branch on the
    forward's ``fused`` flag reads data."""
    return type(t) is not torch.Tensor or torch.compiler.is_compiling()


@contextlib.contextmanager
def autograd_dispatch():
    """Autograd recording inside a custom op's implementation. The dispatcher runs an op's kernel
    with the autograd keys excluded, so a backward op that differentiates a recomputation (or the
    plan's block terms) must put them back for its own local graph, with ADInplaceOrView (excluded
    too when the op runs under a dispatch mode, e.g. AOTAutograd's runtime under compiled autograd:
    without it, in-place writes into views drop out of the graph); the autocast exclusions stay."""
    try:
        exclude = torch._C._dispatch_tls_local_exclude_set()
        keys = exclude - exclude                        # an empty set (the constructor wants a key)
        for name in dir(torch._C.DispatchKey):
            if name == "ADInplaceOrView" or (name.startswith("Autograd")
                                             and name not in ("Autograd", "AutogradFunctionality")):
                keys = keys | torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, name))
        guard = torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude - keys)
    except (AttributeError, TypeError) as err:          # private dispatcher API of this torch
        raise RuntimeError(
            f"solattn: a traced (compiled) backward needs torch's dispatch-key guards, which torch "
            f"{torch.__version__} does not offer as expected ({err}); run the backward eagerly "
            f"(compile without the backward, or call the op outside torch.compile)") from err
    with guard:
        yield


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


def backward_grads(ctx, op, grads: Callable, saved: tuple, grad_out: Tensor):
    """An operator's gradients: ``grads(*saved)`` with the forward's settings and kept plan when
    the backward runs eagerly; the opaque backward ``op(*saved)`` when it is traced."""
    if traced(grad_out):
        return grads_from_outputs(op(*saved))
    return grads(*saved, settings=ctx.settings, plan=ctx.plan)


def _sol_attn_grads(q, k, v, key_bias, block_len, coarse_gate, out, lse, resid, fused, grad_out,
                    tau, scale, sink_blocks, sink_q, topk_ratio, tail, token_aug, backend,
                    bias_grad: bool, gate_grad: bool, settings=None, plan=None):
    """``(dq, dk, dv, dgate, dbias)`` of ``sol_attn`` (None where not asked for): the own backward
    of the backend that ran the forward, else a recomputation through a differentiable backend.
    ``settings``, ``plan``: the forward's context and kept plan, when the backward runs eagerly."""
    bias_leaf = key_bias if bias_grad else None
    own = own_backward(lse, fused)
    if own is not None:
        def problem_of(qd, kd, vd):
            return validate(qd, kd, vd, tau, scale, sink_blocks, sink_q, key_bias, topk_ratio, tail,
                            block_len, coarse_gate, token_aug)

        gq, gk, gv, gg, gb = fused_grads(own, problem_of, build_plan, (q, k, v), out, lse, resid, grad_out,
                                         bias_grad=bias_grad, settings=settings, saved=plan)
        if gb is not None:                   # (B or 1, T) summed over heads -> key_bias's shape
            if key_bias.numel() != gb.numel():
                gb = gb.sum(dim=0, keepdim=True)
            gb = gb.reshape(key_bias.shape).to(key_bias.dtype)
        return gq, gk, gv, gg if gate_grad else None, gb

    def forward(leaves, name):
        qd, kd, vd, gd, bd = leaves
        return run_problem(validate(qd, kd, vd, tau, scale, sink_blocks, sink_q,
                                    key_bias if bd is None else bd, topk_ratio, tail, block_len, gd,
                                    token_aug), name)

    gq, gk, gv, gg, gb = recompute_grads(forward, (q, k, v, coarse_gate, bias_leaf), grad_out,
                                         backend or None, required={4: "key_bias"}, settings=settings)
    return gq, gk, gv, gg if gate_grad else None, gb


@torch.library.custom_op("solattn::sol_attn_backward", mutates_args=())
def _sol_attn_backward_op(q: Tensor, k: Tensor, v: Tensor, key_bias: Optional[Tensor],
                          block_len: Optional[Tensor], coarse_gate: Optional[Tensor], out: Tensor,
                          lse: Tensor, resid: Tensor, fused: Tensor, grad_out: Tensor, tau: float,
                          scale: Optional[float], sink_blocks: Optional[List[int]],
                          sink_q: Optional[List[int]], topk_ratio: float, tail: bool, token_aug: int,
                          backend: str, bias_grad: bool, gate_grad: bool
                          ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward of ``solattn::sol_attn`` as one op, for a traced backward (compiled training,
    ``fullgraph=True`` included): :func:`_sol_attn_grads`, absent gradients as ``(0,)`` tensors."""
    with autograd_dispatch():
        grads = _sol_attn_grads(q, k, v, key_bias, block_len, coarse_gate, out, lse, resid, fused, grad_out,
                                tau, scale, sink_blocks, sink_q, topk_ratio, tail, token_aug, backend,
                                bias_grad, gate_grad)
    return grads_as_outputs(grads, _sol_attn_grad_like(q, k, v, key_bias, coarse_gate, bias_grad, gate_grad),
                            (q, k, v, key_bias, block_len, coarse_gate, out, grad_out))


def _sol_attn_grad_like(q, k, v, key_bias, coarse_gate, bias_grad: bool, gate_grad: bool):
    """The inputs the backward op returns gradients for (None: an empty result), for it and its fake."""
    return q, k, v, coarse_gate if gate_grad else None, key_bias if bias_grad else None


@_sol_attn_backward_op.register_fake
def _(q, k, v, key_bias, block_len, coarse_gate, out, lse, resid, fused, grad_out, tau, scale, sink_blocks,
      sink_q, topk_ratio, tail, token_aug, backend, bias_grad, gate_grad):
    return fake_grads(_sol_attn_grad_like(q, k, v, key_bias, coarse_gate, bias_grad, gate_grad), q)


def _backward(ctx, grad_out, _grad_lse, _grad_resid, _grad_fused):
    q, k, v, key_bias, block_len, coarse_gate, out, lse, resid, fused = ctx.saved_tensors
    tau, scale, sink_blocks, sink_q, topk_ratio, tail, token_aug, backend = ctx.args
    # a float key_bias is differentiated when autograd asks for it (a bool one has no gradient)
    bias_grad = bool(ctx.needs_input_grad[7] and key_bias is not None and key_bias.is_floating_point())
    gate_grad = bool(ctx.needs_input_grad[11] and coarse_gate is not None)
    saved = (q, k, v, key_bias, block_len, coarse_gate, out, lse, resid, fused, grad_out,
             tau, scale, sink_blocks, sink_q, topk_ratio, tail, token_aug, backend, bias_grad, gate_grad)
    gq, gk, gv, gg, gb = backward_grads(ctx, _sol_attn_backward_op, _sol_attn_grads, saved, grad_out)
    return gq, gk, gv, None, None, None, None, gb, None, None, None, gg, None, None, None


_sol_attn_op.register_autograd(_backward, setup_context=_setup_context)


def sol_attn(q: Tensor, k: Tensor, v: Tensor, tau: float = 1.0, scale: Optional[float] = None,
             sink_blocks: Optional[Sequence[int]] = None, sink_q: Optional[Sequence[int]] = None,
             key_bias: Optional[Tensor] = None, topk_ratio: float = 0.0, tail: bool = True,
             block_len: Optional[Tensor] = None, coarse_gate: Optional[Tensor] = None,
             token_aug: int = 0, *, backend: Optional[str] = None) -> Tensor:
    """Block-sparse Sol-Attn (docs/SPEC.md): exact attention on routed 64-token key
    blocks, a pooled term for the rest, and an optional gated coarse branch.

    Args:
        q, k, v: ``(B, T, H, D)`` bf16 / fp16 / fp32 tensors of one shape, dtype and device; any strides.
        tau: routing threshold in sigmas (tau mode, ``topk_ratio == 0``).
        scale: logit scale, default ``D ** -0.5``.
        sink_blocks: ``[start, end)`` key blocks every query attends exactly.
        sink_q: ``[start, end)`` query blocks that attend every key exactly.
        key_bias: additive per-key bias ``(T,)``, ``(B, T)``, ``(1, T)`` or ``(B|1, 1, 1, T)``, float or
            bool (True = keep); exact branch only. A float ``key_bias`` that requires grad gets its
            gradient (a bool one has none); a backend that cannot differentiate it raises.
        topk_ratio: 0 for tau mode, else the fraction ``0 < r < 1`` of key blocks kept by score.
        tail: add the pooled term of the non-routed blocks.
        block_len: ``(ceil(T/64),)`` int32 live rows at the front of each block.
        coarse_gate: tensor of q's shape; adds ``gate * softmax(qm km^T) vm`` per block.
        token_aug: accepted for comfy-kitchen compatibility (0, 64, 128, 192 or 256); no effect.
        backend: force a backend by name (see :func:`solattn.list_backends`); keyword only.

    Returns:
        ``(B, T, H, D)`` contiguous tensor in v's dtype.
    """
    validate(q, k, v, tau, scale, sink_blocks, sink_q, key_bias, topk_ratio, tail, block_len,
             coarse_gate, token_aug)
    if backend is not None:
        dispatch.get_backend(backend)
    want_lse = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, coarse_gate, key_bias))
    args = (q, k, v, float(tau), None if scale is None else float(scale), _as_list(sink_blocks),
            _as_list(sink_q), key_bias, float(topk_ratio), bool(tail), block_len, coarse_gate,
            int(token_aug), backend or "", want_lse)
    if not want_lse and plain_eager(q, k, v, key_bias, block_len, coarse_gate):
        # fn validates again (about 6 us on the CPU): under cuda_graphs() it is what a graph
        # captures, and validation makes new tensors (a bool key_bias becomes a float one) that
        # must be made inside the capture, from the caller's tensors, not once outside it
        return eager_call(lambda: _sol_attn_forward(*args)[0], (q, k, v, key_bias, block_len, coarse_gate),
                          ("sol_attn", *args[3:7], *args[8:10], *args[12:]))
    check_transforms("sol_attn", (q, k, v, key_bias, coarse_gate))
    return _sol_attn_op(*args)[0]
