"""The launch cache (solattn.backends.triton.launcher): its key is at least as fine as Triton's own
specialisation, arguments bind like Triton binds them, and on a GPU a cached launch computes what
Triton's own launch computes."""

from __future__ import annotations

import itertools

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from solattn.backends.triton import launcher as launch  # noqa: E402


def _values():
    base = torch.empty(64, dtype=torch.float32)
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2 ** 31 - 1, 2 ** 31, -2 ** 31, -2 ** 31 - 1, 2 ** 40,
            2 ** 40 + 1, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 16]
    tensors = [base, base[1:], base[4:], base.to(torch.bfloat16), base.to(torch.bfloat16)[8:],
               base.to(torch.bfloat16)[1:], base.to(torch.int32), base.to(torch.int8)[1:]]
    return ints + [0.5, 1.0, -3.0, True, False, None] + tensors


def _triton_spec(a):
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.nvidia.compiler import CUDABackend
    except ImportError:
        pytest.skip("this Triton has no native_specialize_impl to compare with")
    return native_specialize_impl(CUDABackend, a, False, True, True)


def test_key_is_at_least_as_fine_as_tritons_specialisation():
    values = _values()
    for a, b in itertools.combinations(values, 2):
        if launch.arg_key(a) == launch.arg_key(b):
            assert _triton_spec(a) == _triton_spec(b), (a, b)
    # and it tells apart what Triton tells apart among the ints and tensors above
    assert len({launch.arg_key(v) for v in values}) >= len({_triton_spec(v) for v in values})


def test_descriptors_are_keyed_by_dtype_and_block():
    from triton.tools.tensor_descriptor import TensorDescriptor
    x = torch.empty(2, 64, 4, 16, dtype=torch.bfloat16)
    y = torch.empty(2, 128, 4, 16, dtype=torch.bfloat16)

    def desc(t, block):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block)
    same = (desc(x, [1, 64, 1, 16]), desc(y, [1, 64, 1, 16]))
    assert launch.arg_key(same[0]) == launch.arg_key(same[1])
    assert _triton_spec(same[0]) == _triton_spec(same[1])
    other = desc(x, [1, 32, 1, 16])
    assert launch.arg_key(other) != launch.arg_key(same[0])
    assert _triton_spec(other) != _triton_spec(same[0])


def _toy(X, Y, n, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr = False):
    i = tl.arange(0, BLOCK)
    x = tl.load(X + i, mask=i < n, other=0.0)
    if FLAG:
        x = -x
    tl.store(Y + i, x * scale, mask=i < n)


def test_arguments_bind_in_signature_order_with_defaults():
    lau = launch.Launcher(JITFunction(_toy))
    x, y = torch.zeros(4), torch.zeros(4)
    assert lau._bound((x, y, 3, 2.0), {"BLOCK": 16}) == [x, y, 3, 2.0, 16, False]
    assert lau._bound((x, y), {"n": 3, "scale": 2.0, "BLOCK": 16, "FLAG": True}) == [x, y, 3, 2.0, 16, True]
    if not torch.cuda.is_available():
        return
    key = lau._key((x, y, 3, 2.0), {"BLOCK": 16, "num_warps": 4})
    # constexprs and options by value, the others by kind
    assert key[1][4] == 16 and ("num_warps", 4) in key[2] and key[1][2] == launch.arg_key(3)
    assert lau._key((x, y, object(), 2.0), {"BLOCK": 16}) is None      # unknown kind: Triton's path


@pytest.mark.skipif(not torch.cuda.is_available(), reason="launches need a GPU")
def test_cached_launches_compute_what_tritons_launch_computes(monkeypatch):
    monkeypatch.setattr(launch, "CHECK", True)
    toy = JITFunction(_toy)
    lau = launch.Launcher(toy)
    x = torch.randn(100, device="cuda")
    for n, flag, offset in ((50, False, 0), (50, False, 0), (37, True, 0), (37, True, 1), (64, False, 4)):
        src = x[offset:]
        got, want = torch.zeros(64, device="cuda"), torch.zeros(64, device="cuda")
        lau[(1,)](src, got, n, 1.5, BLOCK=64, FLAG=flag)
        toy[(1,)](src, want, n, 1.5, BLOCK=64, FLAG=flag)
        assert torch.equal(got, want)
        assert torch.equal(got[:n], (-1.5 if flag else 1.5) * src[:n])
    # (50, False, aligned) launched twice: one entry; offset 1 is misaligned (its own entry),
    # offset 4 is 16-byte aligned again but n = 64 is divisible by 16 (its own entry)
    assert len(lau.cache) == 4
