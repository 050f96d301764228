"""The ``torch.library`` custom ops ``solattn::sol_attn`` and ``solattn::sol_attn_backward``, their
fakes and autograd, and :func:`call_op`: how both front doors run a :class:`~.call.Call`.

A plain eager call (:func:`solattn.op.fast.plain_eager`) runs the op's computation directly
(:func:`solattn.op.route.forward_output`: without gradients, through the active
:func:`solattn.graphs.cuda_graphs` cache when there is one; or the op's autograd without the op,
:class:`_EagerAutograd`); everything else (tracing, transforms, dispatch modes) goes through the
op. The fake makes ``torch.compile(fullgraph=True)`` and ``torch.export`` see one node. Autograd
follows the backend that ran the forward (``Backend.differentiation``, :mod:`.backward`): a
backend with its own backward fills the op's extra outputs and differentiates; otherwise the
backward recomputes through a differentiable backend. A traced backward (compiled training) is
the one opaque op ``solattn::sol_attn_backward``, which decides at run time.
"""

from __future__ import annotations

import torch

from . import backward
from .call import POSITION, Call, operand_grads, schema
from .fast import autograd_dispatch, check_transforms, eager_call, forward_settings, plain_eager, traced
from .route import forward, forward_output, route_of
from .saved import PLANS, backward_buffers, fake_fused

Tensor = torch.Tensor


def call_op(fn: str, call: Call) -> Tensor:
    """Run ``call`` for the front door ``fn``: the plain eager fast path (with the op's autograd
    when autograd records the call) or the custom op."""
    if call.wants_grad():
        call = call._replace(want_lse=True)
    if plain_eager(*call.inputs()):
        if call.want_lse:
            return _EagerAutograd.apply(call, *call.operands())[0]
        # through the cuda_graphs() cache when one is active: the fused plan (CUDA, triton) has no
        # host syncs, other plans stay eager. The computation validates again (about 6 us on the
        # CPU): under cuda_graphs() it is what a graph captures, and validation makes new tensors
        # (a bool key_bias becomes a float one) that must be made inside the capture
        return eager_call(lambda: forward_output(call), call.q.device,
                          lambda: ((*call.graph_tensors(), *route_of(call).tables()), (fn, *call.static())))
    check_transforms(fn, call.differentiable())
    return sol_attn_op(*call.operands())[0]


@torch.library.custom_op("solattn::sol_attn", mutates_args=(), schema=schema())
def sol_attn_op(*operands) -> tuple:
    """The op: :func:`solattn.op.route.forward` of the call its operands make
    (:meth:`Call.from_operands`): ``(out, lse, resid, fused)``."""
    return forward(Call.from_operands(operands))


@sol_attn_op.register_fake
def _(*operands):
    call = Call.from_operands(operands)
    q, v = call.q, call.v
    return (torch.empty(q.shape, dtype=v.dtype, device=v.device),
            *backward_buffers(q, v, call.want_lse, None if call.grid is None else call.layout_rows), fake_fused())


def setup_context(ctx, inputs, output):
    _keep(ctx, Call.from_operands(inputs), output)


def _keep(ctx, call: Call, output, first: int = 0):
    """What the backward of ``call`` needs, on ``ctx``; ``first``: the position of the call's first
    operand among the inputs autograd saw."""
    ctx.first = first
    out, lse, resid, fused = output
    ctx.mark_non_differentiable(lse, resid, fused)
    ctx.set_materialize_grads(False)     # no zero gradients for them: resid is as large as q
    tensors, ctx.call = call.apart()
    ctx.save_for_backward(out, lse, resid, fused, *tensors)
    ctx.settings = forward_settings()
    ctx.plan = PLANS.take(fused)


#: the backward op's operands after the call's
_BACKWARD_EXTRA = (("out", "Tensor"), ("lse", "Tensor"), ("resid", "Tensor"), ("fused", "Tensor"),
                   ("grad_out", "Tensor"), ("bias_grad", "bool"), ("gate_grad", "bool"))


def _grad_like(call: Call, bias_grad: bool, gate_grad: bool):
    """The inputs the backward op returns gradients for (None: an empty result), for it and its fake."""
    return call.q, call.k, call.v, call.gate if gate_grad else None, call.key_bias if bias_grad else None


@torch.library.custom_op("solattn::sol_attn_backward", mutates_args=(),
                         schema=schema(_BACKWARD_EXTRA, "(Tensor, Tensor, Tensor, Tensor, Tensor)"))
def sol_attn_backward_op(*operands) -> tuple:
    """The backward of ``solattn::sol_attn`` as one op, for a traced backward (compiled training,
    ``fullgraph=True`` included): :func:`solattn.op.backward.grads`, absent gradients as ``(0,)``
    tensors."""
    call = Call.from_operands(operands)
    out, lse, resid, fused, grad_out, bias_grad, gate_grad = operands[-len(_BACKWARD_EXTRA):]
    with autograd_dispatch():
        gs = backward.grads(call, out, lse, resid, fused, grad_out, bias_grad, gate_grad)
    return backward.grads_as_outputs(gs, _grad_like(call, bias_grad, gate_grad),
                                     (*call.inputs(), out, grad_out))


@sol_attn_backward_op.register_fake
def _(*operands):
    call = Call.from_operands(operands)
    bias_grad, gate_grad = operands[-2:]
    return backward.fake_grads(_grad_like(call, bias_grad, gate_grad), call.q)


def op_backward(ctx, grad_out, _grad_lse, _grad_resid, _grad_fused):
    if grad_out is None:     # no gradient defined for the output (materialize_grads is off): none for the inputs
        return operand_grads()
    out, lse, resid, fused, *tensors = ctx.saved_tensors
    call = ctx.call.joined(tensors)
    key_bias, gate = call.key_bias, call.gate
    # a float key_bias is differentiated when autograd asks for it (a bool one has no gradient)
    asked = ctx.needs_input_grad[ctx.first:]
    bias_grad = bool(asked[POSITION["key_bias"]] and key_bias is not None and key_bias.is_floating_point())
    gate_grad = bool(asked[POSITION["gate"]] and gate is not None)
    if traced(grad_out):     # the branch on the forward's ``fused`` flag reads data: one opaque op
        gq, gk, gv, gg, gb = backward.grads_from_outputs(sol_attn_backward_op(
            *call.operands(), out, lse, resid, fused, grad_out, bias_grad, gate_grad))
    else:
        gq, gk, gv, gg, gb = backward.grads(call, out, lse, resid, fused, grad_out, bias_grad, gate_grad,
                                            settings=ctx.settings, plan=ctx.plan)
    # the caller's selection is a constant of the call: no gradient
    return operand_grads(q=gq, k=gk, v=gv, gate=gg, key_bias=gb)


sol_attn_op.register_autograd(op_backward, setup_context=setup_context)


class _EagerAutograd(torch.autograd.Function):
    """The op's autograd (:func:`setup_context` and :func:`op_backward`) around its computation,
    without the op: what a plain eager call that records autograd runs. The custom op's dispatch
    and autograd wrapping cost about a millisecond of host time per such call on a CPU (more than
    the forward's own Python); tracing, transforms and dispatch modes keep the op."""

    @staticmethod
    def forward(ctx, call, *operands):
        """``call`` and its :meth:`~Call.operands` (autograd sees the tensors among these)."""
        outputs = forward(call)
        _keep(ctx, call, outputs, first=1)
        return outputs

    @staticmethod
    def backward(ctx, grad_out, grad_lse, grad_resid, grad_fused):
        return (None, *op_backward(ctx, grad_out, grad_lse, grad_resid, grad_fused))
