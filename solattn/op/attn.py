"""The ``sol_attn`` front door: :func:`sol_attn` and :func:`plan`.

``sol_attn`` validates (metadata only, so it also runs while ``torch.compile`` traces with fake
tensors), makes its :class:`~.call.Call` and runs it (:func:`.custom.call_op`) on the caller's
token layout with Sol-Attn's selection.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

import torch

from .. import dispatch
from ..routing import Plan, build_plan, check_plan
from ..validation import validate
from .call import Call
from .custom import call_op

Tensor = torch.Tensor


def _as_list(rng) -> Optional[List[int]]:
    if rng is None:
        return None
    if isinstance(rng, torch.Tensor):
        rng = rng.tolist()
    return [int(x) for x in rng]


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
    validate(q, k, v, tau, scale, sink_blocks, sink_q, key_bias, topk_ratio, tail, block_len, coarse_gate, token_aug)
    if backend is not None:
        dispatch.get_backend(backend)
    if plan is not None:                  # q's shape, not the problem's cached properties (Dynamo traces this)
        B, T, H, _ = q.shape
        plan = check_plan("sol_attn", plan, B, H, T, q.device)
    return call_op("sol_attn", Call(q, k, v, key_bias=key_bias, block_len=block_len, gate=coarse_gate,
                                    tau=float(tau), scale=None if scale is None else float(scale),
                                    sink_blocks=_as_list(sink_blocks), sink_q=_as_list(sink_q),
                                    topk_ratio=float(topk_ratio), tail=bool(tail), token_aug=int(token_aug),
                                    backend=backend or "", plan=plan))


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
