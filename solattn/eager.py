"""Plain eager calls of the op pipeline (:func:`solattn.modes.plain_eager`: no tracing, transform,
tensor subclass or dispatch mode): its computation without the ``torch.library`` custom op, whose
dispatch and autograd wrapping are the larger part of a call's host time at small and medium sizes.
Everything else goes through the op (:mod:`solattn.pipeline`)."""

from __future__ import annotations

from typing import List, Optional

import torch

from . import pipeline

Tensor = torch.Tensor


def forward_output(q: Tensor, k: Tensor, v: Tensor, tau: float, scale: Optional[float],
                   sink_blocks: Optional[List[int]], sink_q: Optional[List[int]], key_bias: Optional[Tensor],
                   topk_ratio: float, tail: bool, block_len: Optional[Tensor], coarse_gate: Optional[Tensor],
                   token_aug: int, backend: str, want_lse: bool, grid: Optional[List[int]], k_vid: int,
                   segments: List[int], prefix_mode: str, *given: Optional[Tensor]) -> Tensor:
    """:func:`solattn.pipeline.forward`'s output alone, for a plain eager call that no backward
    follows (the same arguments, ``want_lse`` False): the op's other outputs, which such a call
    drops, are not made (two empty buffers and the CPU ``fused`` flag: three allocations per call)."""
    route = pipeline.routed(q, tau, scale, sink_blocks, sink_q, topk_ratio, tail, token_aug, grid, k_vid,
                            segments, prefix_mode, given)
    with torch.no_grad():
        return pipeline.run(route, q, k, v, coarse_gate, key_bias, block_len, backend or None)[0]


class _EagerAutograd(torch.autograd.Function):
    """The op's autograd (``setup_context`` and ``backward``) around its computation,
    without the op: what a plain eager call that records autograd runs. The custom op's dispatch
    and autograd wrapping cost about a millisecond of host time per such call on a CPU (more than
    the forward's own Python); tracing, transforms and dispatch modes keep the op."""

    @staticmethod
    def forward(ctx, *args):
        outputs = pipeline.forward(*args)
        pipeline.setup_context(ctx, args, outputs)
        return outputs

    @staticmethod
    def backward(ctx, grad_out, grad_lse, grad_resid, grad_fused):
        return pipeline.op_backward(ctx, grad_out, grad_lse, grad_resid, grad_fused)


def eager_autograd(*args) -> Tensor:
    """:func:`solattn.pipeline.sol_attn_op`'s output (the op's arguments) for a plain eager call
    (:func:`solattn.modes.plain_eager`) that records autograd."""
    return _EagerAutograd.apply(*args)[0]
