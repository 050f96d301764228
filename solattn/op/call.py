"""The one carrier of an operator call, from a front door to the backend: :class:`Call`.

A front door (:mod:`.attn`, :mod:`.video`) checks its arguments and makes a :class:`Call`; the
call travels by name through the fast path (:mod:`.fast`), the custom op and its autograd
(:mod:`.custom`), the route (:mod:`.route`) and the backward (:mod:`.backward`). The custom op
takes flat operands: :meth:`Call.operands` and :meth:`Call.from_operands` convert, once each
way, through the field table :data:`SCHEMA`, from which the ops' schemas are written too. A new
argument is a field here (its name, its schema type), its check in a front door and its use in
the backends that read it.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..routing import Plan
from ..tiling import tiled_rows
from ..validation import Problem, validate

Tensor = torch.Tensor


class Call(NamedTuple):
    """One call of the operator. Tensors are the caller's (any strides; validated again where a
    backend's problem is made, so that a graph capture or a traced op makes its own derived
    tensors); every other field is a checked Python value."""

    q: Tensor
    k: Tensor
    v: Tensor
    #: ``sol_attn``'s per-key bias, as given (float or bool), or None
    key_bias: Optional[Tensor] = None
    #: ``sol_attn``'s live rows per 64-token block (int32), or None
    block_len: Optional[Tensor] = None
    #: the coarse branch's gate, a tensor of q's shape (a constant gate: a stride-0 view), or None
    gate: Optional[Tensor] = None
    tau: float = 1.0
    scale: Optional[float] = None
    sink_blocks: Optional[List[int]] = None
    sink_q: Optional[List[int]] = None
    topk_ratio: float = 0.0
    tail: bool = False
    token_aug: int = 0
    #: VSA's latent grid ``(t, h, w)``; None for ``sol_attn``
    grid: Optional[List[int]] = None
    #: VSA: video tiles kept per query tile
    k_vid: int = 0
    #: VSA: prefix segment lengths in packed order (non-empty ones)
    segments: Sequence[int] = ()
    #: VSA: ``"exempt"`` or ``"compete"``
    prefix_mode: str = "exempt"
    #: the backend asked for by name, or ""
    backend: str = ""
    #: a backward may follow: the forward keeps what an own backward needs
    want_lse: bool = False
    #: the caller's selection to hold (:func:`solattn.routing.check_plan`'d), or None
    plan: Optional[Plan] = None

    @property
    def layout_rows(self) -> int:
        """Rows of the layout the backend runs on: q's tokens, or VSA's tiled rows."""
        return self.q.shape[1] if self.grid is None else tiled_rows(self.grid, self.segments)

    def inputs(self) -> Tuple[Optional[Tensor], ...]:
        """The caller's tensors: q, k, v, key_bias, block_len, gate."""
        return self[:_TENSORS]

    def differentiable(self) -> Tuple[Optional[Tensor], ...]:
        """The tensors that may carry gradients."""
        return (self.q, self.k, self.v, self.gate, self.key_bias)

    def wants_grad(self) -> bool:
        """Whether autograd records this call: grad mode on and an input that requires grad."""
        return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in self.differentiable())

    def problem(self) -> Problem:
        """The validated problem of this call (:func:`solattn.validation.validate`: what a backend
        reads), on its tensors as they are."""
        return validate(self.q, self.k, self.v, self.tau, self.scale, self.sink_blocks, self.sink_q, self.key_bias,
                        self.topk_ratio, self.tail, self.block_len, self.gate, self.token_aug)

    def operands(self) -> tuple:
        """The custom op's flat operands, in :data:`SCHEMA` order (the plan as its tensors)."""
        plan = self.plan
        return (*self[:-1], *(_NO_PLAN if plan is None else plan.tensors()))

    @classmethod
    def from_operands(cls, operands: Sequence) -> "Call":
        """Inverse of :meth:`operands` (its first ``len(SCHEMA)`` items: a backward op's operands
        go on); a plan comes back on detached tensors (a constant of the call)."""
        call = cls._make((*operands[:_PLAN_AT], None))
        given = operands[_PLAN_AT:len(SCHEMA)]
        if given[0] is None:
            return call
        return call._replace(plan=Plan.from_tensors([t.detach() for t in given], call.layout_rows))

    def static(self) -> tuple:
        """Every field but the tensors, hashable (lists as tuples): with the tensors, what a
        call's work depends on."""
        return tuple(tuple(x) if isinstance(x, list) else x for x in self[_TENSORS:-1])

    def graph_tensors(self) -> Tuple[Optional[Tensor], ...]:
        """Every tensor of the call: the inputs and the plan's."""
        return (*self.inputs(), *(() if self.plan is None else self.plan.tensors()))

    def apart(self) -> Tuple[Tuple[Optional[Tensor], ...], "Call"]:
        """``(tensors, rest)``: :meth:`graph_tensors` and the call without them, to be kept apart
        (autograd saves tensors on its own); :meth:`joined` puts them back."""
        return self.graph_tensors(), self._make((None,) * _TENSORS + self[_TENSORS:-1] + (None,))

    def joined(self, tensors: Sequence[Optional[Tensor]]) -> "Call":
        """Inverse of :meth:`apart` (``self``: its ``rest``); the plan on detached tensors."""
        return self.from_operands((*tensors[:_TENSORS], *self[_TENSORS:-1], *(tensors[_TENSORS:] or _NO_PLAN)))


#: the custom op's operands: each field's name and schema type, the plan as its tensors
SCHEMA: Tuple[Tuple[str, str], ...] = (
    ("q", "Tensor"), ("k", "Tensor"), ("v", "Tensor"), ("key_bias", "Tensor?"), ("block_len", "Tensor?"),
    ("gate", "Tensor?"), ("tau", "float"), ("scale", "float?"), ("sink_blocks", "int[]?"), ("sink_q", "int[]?"),
    ("topk_ratio", "float"), ("tail", "bool"), ("token_aug", "int"), ("grid", "int[]?"), ("k_vid", "int"),
    ("segments", "int[]"), ("prefix_mode", "str"), ("backend", "str"), ("want_lse", "bool"),
    *((f"plan_{name}", "Tensor?") for name in Plan.TENSOR_FIELDS))

_TENSORS = Call._fields.index("tau")              # the tensors come first: this many
_PLAN_AT = len(Call._fields) - 1                 # the plan is last: its operands start here
_NO_PLAN = (None,) * len(Plan.TENSOR_FIELDS)
assert tuple(name for name, _ in SCHEMA[:_PLAN_AT]) == Call._fields[:-1], "SCHEMA and Call disagree"
assert all(kind.startswith("Tensor") for _, kind in SCHEMA[:_TENSORS]), "Call's tensors come first"

#: position of each operand by name
POSITION: Dict[str, int] = {name: i for i, (name, _) in enumerate(SCHEMA)}


def schema(extra: Sequence[Tuple[str, str]] = (), returns: str = "(Tensor, Tensor, Tensor, Tensor)") -> str:
    """A custom op's schema: the call's operands, then ``extra`` ``(name, type)`` pairs."""
    return "(" + ", ".join(f"{kind} {name}" for name, kind in (*SCHEMA, *extra)) + ") -> " + returns


def operand_grads(**grads: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
    """One gradient per operand, in :data:`SCHEMA` order: those named, None for the rest (the
    selection and every non-tensor operand have none)."""
    result: List[Optional[Tensor]] = [None] * len(SCHEMA)
    for name, g in grads.items():
        result[POSITION[name]] = g
    return tuple(result)
