"""A backend owns its backward: a third-party backend that declares ``differentiation = "own"``
trains through ``sol_attn`` and ``video_sparse_attn`` with gradients equal to the reference's,
and the op layer names no concrete backend."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch

import solattn
from solattn import dispatch
from solattn.backends.base import ALL_FEATURES, Backend, BackwardBuffers, Gradients
from solattn.backends.sdpa import sdpa_forward
from solattn.testing import make_qkv, rel_l2

PLAN_TERMS = ("tail_lse", "tail_value", "coarse", "key_mean")


class OwnBackward(Backend):
    """A backend with a backward of its own: the portable backend's arithmetic forward, and a
    backward that differentiates that arithmetic on detached copies of the problem and the plan
    (so the token gradients and the plan terms' are its own, as a fused kernel's would be)."""

    name = "ownbackward"
    devices = frozenset({"cpu"})
    features = ALL_FEATURES - {"autograd"}
    differentiation = "own"

    def __init__(self):
        self.backward_calls = 0
        self.saved_rows = None

    def forward(self, problem, plan=None):
        with torch.no_grad():
            return sdpa_forward(problem, plan)

    def forward_for_backward(self, problem, plan, buffers: BackwardBuffers):
        buffers.lse.fill_(7.0)                      # what this backend's backward will check
        buffers.resid.zero_()
        return self.forward(problem, plan)

    def backward(self, problem, plan, out, buffers, grad_out, bias_grad) -> Gradients:
        self.backward_calls += 1
        self.saved_rows = buffers.lse
        def leaf(t):
            return None if t is None else t.detach().requires_grad_(True)

        q, k, v, gate = (leaf(t) for t in (problem.q, problem.k, problem.v, problem.coarse_gate))
        bias = leaf(problem.key_bias) if bias_grad else problem.key_bias
        terms = {name: leaf(getattr(plan, name)) for name in PLAN_TERMS}
        with torch.enable_grad():
            mine = dataclasses.replace(problem, q=q, k=k, v=v, coarse_gate=gate, key_bias=bias)
            result = sdpa_forward(mine, dataclasses.replace(plan, **terms))
            wanted = [q, k, v, gate, bias if bias_grad else None] + [terms[n] for n in PLAN_TERMS]
            present = [t for t in wanted if t is not None]
            found = iter(torch.autograd.grad(result, present, grad_out, allow_unused=True))
            grads = [next(found) if t is not None else None for t in wanted]
        dq, dk, dv, dgate, dbias = grads[:5]
        return Gradients(dq=dq, dk=dk, dv=dv, dgate=dgate, dbias=dbias,
                         plan={n: g for n, g in zip(PLAN_TERMS, grads[5:]) if g is not None})


@pytest.fixture
def own():
    backend = dispatch.register(OwnBackward())
    try:
        yield backend
    finally:
        dispatch.unregister(backend.name)


def _grads(fn, tensors, w):
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    (fn(*leaves) * w).sum().backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("tail", [True, False], ids=["tail", "notail"])
def test_third_party_backend_trains_sol_attn_through_its_own_backward(own, tail):
    B, T, H, D = 2, 3 * 64 - 11, 2, 16
    q, k, v = make_qkv(B, T, H, D, seed=3)
    g = torch.Generator().manual_seed(4)
    gate = torch.randn(q.shape, generator=g) * 0.3
    bias = torch.randn(B, T, generator=g)
    w = torch.randn(q.shape, generator=g)

    def call(name):
        return lambda q, k, v, gate, bias: solattn.sol_attn(q, k, v, topk_ratio=0.4, tail=tail,
                                                            coarse_gate=gate, key_bias=bias, backend=name)

    got = _grads(call("ownbackward"), (q, k, v, gate, bias), w)
    assert own.backward_calls == 1 and (own.saved_rows == 7.0).all()   # its backward, its buffers
    want = _grads(call("reference"), (q, k, v, gate, bias), w)
    for name, a, b in zip(("q", "k", "v", "gate", "bias"), got, want):
        assert a is not None and a.shape == b.shape, name
        assert rel_l2(a, b) < 1e-5, (name, rel_l2(a, b))


def test_third_party_backend_trains_video_sparse_attn_through_its_own_backward(own):
    grid = (2, 8, 8)
    q, k, v = make_qkv(1, 20 + 2 * 8 * 8, 2, 16, seed=5)
    g = torch.Generator().manual_seed(6)
    gate = torch.randn(q.shape, generator=g) * 0.3
    w = torch.randn(q.shape, generator=g)

    def call(name):
        return lambda q, k, v, gate: solattn.video_sparse_attn(q, k, v, grid, topk=1, gate=gate, prefix_len=20,
                                                               backend=name)

    got = _grads(call("ownbackward"), (q, k, v, gate), w)
    assert own.backward_calls == 1
    want = _grads(call("sdpa"), (q, k, v, gate), w)
    for name, a, b in zip(("q", "k", "v", "gate"), got, want):
        assert a is not None and rel_l2(a, b) < 1e-5, (name, rel_l2(a, b))


def test_a_backend_declaring_its_own_backward_must_define_it():
    with pytest.raises(TypeError, match="does not define forward_for_backward and backward"):
        type("Half", (Backend,), {"name": "half", "differentiation": "own"})
    with pytest.raises(TypeError, match="'differentiation' received 'fused'"):
        type("Odd", (Backend,), {"name": "odd", "differentiation": "fused"})


def test_op_layer_names_no_concrete_backend():
    root = pathlib.Path(solattn.__file__).parent
    for module in sorted((root / "op").glob("*.py")):
        text = module.read_text()
        assert "TritonBackend" not in text and "backends.triton" not in text, module
