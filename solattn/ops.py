"""The ``sol_attn`` front door of the op pipeline (:mod:`solattn.pipeline`).

``sol_attn`` validates (metadata only, so it also runs while ``torch.compile`` traces with fake
tensors) and runs the custom op ``solattn::sol_attn`` on the caller's token layout with
Sol-Attn's selection; a plain eager call runs the op's computation directly (:mod:`solattn.eager`),
without gradients through the active :func:`solattn.graphs.cuda_graphs` cache when there is one
(:mod:`solattn.modes`).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

import torch

from . import dispatch, eager, pipeline
from .modes import check_transforms, eager_call, plain_eager
from .routing import Plan, build_plan, check_plan
from .validation import Problem, validate

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


def sol_attn(q: Tensor, k: Tensor, v: Tensor, tau: float = 1.0, scale: Optional[float] = None,
             sink_blocks: Optional[Sequence[int]] = None, sink_q: Optional[Sequence[int]] = None,
             key_bias: Optional[Tensor] = None, topk_ratio: float = 0.0, tail: bool = True,
             block_len: Optional[Tensor] = None, coarse_gate: Optional[Tensor] = None,
             token_aug: int = 0, *, backend: Optional[str] = None, plan: Optional[Plan] = None) -> Tensor:
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
        plan: a selection to hold, from :func:`solattn.plan` on tensors of this batch, length,
            head count and device (checked; another is refused), instead of the one the call
            would route to; keyword only. Only its exact key blocks are taken: the tail, coarse
            and centring terms come from this call's q, k, v and gate, so the result is the
            definition with that selection held, whatever values built the plan. It is a
            constant of the call (the selection has no gradient; the call's own terms do) and
            runs on a backend that consumes plans.

    Returns:
        ``(B, T, H, D)`` contiguous tensor in v's dtype.
    """
    problem = validate(q, k, v, tau, scale, sink_blocks, sink_q, key_bias, topk_ratio, tail, block_len,
                       coarse_gate, token_aug)
    if backend is not None:
        dispatch.get_backend(backend)
    given = pipeline.plan_operands(None if plan is None else check_plan(
        "sol_attn", plan, problem.B, problem.H, problem.T, problem.device))
    want_lse = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, coarse_gate, key_bias))
    args = (q, k, v, float(tau), None if scale is None else float(scale), _as_list(sink_blocks),
            _as_list(sink_q), key_bias, float(topk_ratio), bool(tail), block_len, coarse_gate,
            int(token_aug), backend or "", want_lse, None, 0, [], "exempt", *given)   # no VSA route
    direct = plain_eager(q, k, v, key_bias, block_len, coarse_gate)
    if want_lse and direct:
        return eager.eager_autograd(*args)
    if direct:
        # fn validates again (about 6 us on the CPU): under cuda_graphs() it is what a graph
        # captures, and validation makes new tensors (a bool key_bias becomes a float one) that
        # must be made inside the capture, from the caller's tensors, not once outside it
        return eager_call(lambda: eager.forward_output(*args), (q, k, v, key_bias, block_len, coarse_gate,
                                                                *(given if plan is not None else ())),
                          ("sol_attn", *args[3:7], *args[8:10], *args[12:-pipeline.PLAN_OPERANDS]))
    check_transforms("sol_attn", (q, k, v, key_bias, coarse_gate))
    return pipeline.sol_attn_op(*args)[0]


def plan(q: Tensor, k: Tensor, v: Tensor, tau: float = 1.0, scale: Optional[float] = None,
         sink_blocks: Optional[Sequence[int]] = None, sink_q: Optional[Sequence[int]] = None,
         key_bias: Optional[Tensor] = None, topk_ratio: float = 0.0, tail: bool = True,
         block_len: Optional[Tensor] = None, coarse_gate: Optional[Tensor] = None,
         token_aug: int = 0, *, backend: Optional[str] = None) -> Plan:
    """The selection :func:`sol_attn` routes to for these arguments (FlashInfer's plan/run split):
    per (batch, head, query block), the key blocks attended exactly (a
    :class:`solattn.routing.Plan`: lists, counts, block lengths; no value of q, k or v). Route
    once, run many: ``sol_attn(q2, k2, v2, ..., plan=p)`` holds this selection and computes
    everything else (tail, coarse, centring) from its own tensors, e.g. across layers that share
    a layout or across denoising steps that reuse a mask. Convert it with ``p.to_block_mask()``
    for FlexAttention. The selection of a call without gradients on the backend that would run it
    (``backend``: as for :func:`sol_attn`); built without autograd. ``tail`` and ``coarse_gate``
    do not change the selection: a plan serves calls with or without them.

        p = solattn.plan(q, k, v, topk_ratio=0.1)
        out = solattn.sol_attn(q, k, v, topk_ratio=0.1, plan=p)   # == sol_attn(q, k, v, topk_ratio=0.1)
    """
    problem = validate(q, k, v, tau, scale, sink_blocks, sink_q, key_bias, topk_ratio, tail, block_len,
                       coarse_gate, token_aug)
    with torch.no_grad():
        chosen = dispatch.choose(problem, backend, plan_only=True)
        # the selection alone: no tail or coarse terms to compute on the way
        problem = dataclasses.replace(problem, tail=False, coarse_gate=None)
        return build_plan(problem, fused=getattr(chosen, "fused_plan", False)).selection()
