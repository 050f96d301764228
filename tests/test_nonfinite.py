"""Extreme and non-finite inputs give the same answer on every backend, the one SPEC.md defines.

- a finite ``key_bias`` entry beyond ±1e30 acts as ±1e30 (an fp64 1e300 included);
- a NaN query token gives NaN exactly in the rows SPEC.md's "Non-finite inputs" names.

Each property runs on every backend that runs on the CPU: ``sdpa``, ``reference``, ``flex``
(which compiles, tens of seconds per shape on a small CPU: in the default run only where the
fix is flex's own) and ``triton`` in Triton's interpreter (slow, out of the default run).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import solattn
from solattn import testing

BACKENDS = [pytest.param("sdpa", id="sdpa"), pytest.param("reference", id="reference"),
            pytest.param("flex", id="flex", marks=pytest.mark.slow),
            pytest.param("triton", id="triton-interpreted", marks=pytest.mark.slow)]
#: the same, with flex in the default run (for the properties whose fix is flex's own)
BACKENDS_FLEX_DEFAULT = BACKENDS[:2] + [pytest.param("flex", id="flex")] + BACKENDS[3:]

#: the one shape of this module (flex compiles once per shape, dtype and features)
B, T, H, D = 1, 200, 2, 16


def _backend(name: str):
    """``(context, dtype)`` to run backend ``name`` on the CPU, or skip."""
    if name == "triton":
        if not testing.triton_interpretable():
            pytest.skip("Triton's interpreter cannot run the kernel here")
        return testing.interpreter(), torch.float16
    reasons = solattn.dispatch.get_backend(name).availability_reasons("cpu")
    if reasons:
        pytest.skip(f"{name}: {reasons}")
    return contextlib.nullcontext(), torch.float32


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_huge_finite_key_bias_acts_as_1e30(backend):
    """fp64 entries of ±1e300 give the output of ±1e30 entries (finite), on every backend."""
    scope, dtype = _backend(backend)
    q, k, v = testing.make_qkv(B, T, H, D, dtype=dtype, seed=11)
    g = torch.Generator().manual_seed(12)
    base = torch.randn(T, generator=g, dtype=torch.float64)
    big, clamped = base.clone(), base.clone()
    big[[3, 90]], clamped[[3, 90]] = 1e300, 1e30
    big[[7, 150]], clamped[[7, 150]] = -1e300, -1e30
    kw = dict(topk_ratio=0.5)
    with scope:
        got = solattn.sol_attn(q, k, v, key_bias=big, backend=backend, **kw)
        want = solattn.sol_attn(q, k, v, key_bias=clamped.float(), backend=backend, **kw)
    assert torch.isfinite(got).all(), f"{int((~torch.isfinite(got)).sum())} non-finite entries"
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    ref = solattn.sol_attn(q.float(), k.float(), v.float(), key_bias=clamped.float(), backend="reference", **kw)
    assert testing.rel_l2(got, ref) < testing.tolerance(dtype)
