"""Undefined output gradients pass through the backward on every backend that trains.

Autograd hands a backward ``None`` for an output whose gradient nobody defined: a downstream
``autograd.Function`` whose backward returns ``None`` for it, or gradcheck's undefined-gradient
probe (``check_undefined_grad=True``). The op's backward must then give no (or zero) gradients,
not fail. The dtype is fp32 (the op takes no fp64): gradcheck's numeric comparison runs with
tolerances to match, on problems small enough that every key block is exact (n = 2), so the
output is smooth in its inputs.
"""

from __future__ import annotations

import pytest
import torch

import solattn
from solattn import testing
from tests.support.cpu_backends import cpu_context

#: every backend that trains on the CPU, and whether its case compiles or interprets (slow)
TRAINING = [pytest.param("sdpa", id="sdpa"), pytest.param("reference", id="reference"),
            pytest.param("flex", id="flex", marks=pytest.mark.slow),
            pytest.param("triton", id="triton-interpreted", marks=pytest.mark.slow)]


class _DropsGradient(torch.autograd.Function):
    """Identity forward; its backward defines no gradient for its input."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return None


def _inputs(dtype, gate: bool):
    q, k, v = testing.make_qkv(1, 100, 1, 16, dtype=dtype, seed=5)
    g = torch.Generator().manual_seed(6)
    extra = [torch.randn(q.shape, generator=g).to(dtype)] if gate else []
    return [t.requires_grad_(True) for t in (q, k, v, *extra)]


def _sol(backend):
    def fn(q, k, v, gate=None):
        return solattn.sol_attn(q, k, v, topk_ratio=0.5, coarse_gate=gate, backend=backend)
    return fn


def _vsa(backend):
    def fn(q, k, v, gate=None):
        return solattn.video_sparse_attn(q, k, v, (1, 8, 10), topk=6, gate=gate, prefix_len=20, backend=backend)
    return fn


@pytest.mark.parametrize("backend", TRAINING)
@pytest.mark.parametrize("front", ["sol_attn", "video_sparse_attn"])
def test_a_downstream_function_that_drops_our_gradient_gives_none(front, backend):
    """A loss that reaches the output only through a Function returning None: backward() runs and
    every input's gradient stays undefined (it raised 'grad can be implicitly created only for
    scalar outputs' before)."""
    if front == "video_sparse_attn" and backend == "reference":
        pytest.skip("the reference backend does not serve VSA")
    scope, dtype = cpu_context(backend)
    fn = (_sol if front == "sol_attn" else _vsa)(backend)
    with scope:
        q, k, v, gate = _inputs(dtype, gate=True)
        side = (q.float() ** 2).sum()
        loss = _DropsGradient.apply(fn(q, k, v, gate)).sum() + side
        loss.backward()
    assert k.grad is None and v.grad is None and gate.grad is None
    torch.testing.assert_close(q.grad, 2 * q.detach().float().to(q.dtype))


@pytest.mark.parametrize("backend", TRAINING)
@pytest.mark.parametrize("front", ["sol_attn", "video_sparse_attn"])
def test_gradcheck_undefined_gradient_probe(front, backend):
    """torch.autograd.gradcheck with ``check_undefined_grad=True`` (its default) passes, gate and
    key/value gradients included; on the Triton interpreter (fp16 only, where a numeric check
    means nothing) the undefined-gradient probe alone runs."""
    if front == "video_sparse_attn" and backend == "reference":
        pytest.skip("the reference backend does not serve VSA")
    scope, dtype = cpu_context(backend)
    fn = (_sol if front == "sol_attn" else _vsa)(backend)
    with scope:
        inputs = _inputs(dtype, gate=True)
        if dtype != torch.float32:
            from torch.autograd.gradcheck import _test_undefined_backward_mode
            outputs = (fn(*inputs),)
            assert _test_undefined_backward_mode(fn, outputs, tuple(inputs))
            return
        import warnings
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Input #", UserWarning)     # fp32, not fp64
            assert torch.autograd.gradcheck(fn, tuple(inputs), eps=1e-2, atol=5e-3, rtol=5e-2, fast_mode=True,
                                            check_undefined_grad=True)
