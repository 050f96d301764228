"""Compiling and launching Triton kernels, on the GPU or in Triton's CPU interpreter; importing
this module imports Triton.

Every kernel of solattn is a compiled ``JITFunction`` (:func:`gpu_jit`) whatever
``TRITON_INTERPRET`` said when its module was imported; :func:`compiled` hands out either the
GPU kernel or an interpreted one, chosen per call, so the same source runs in CI without a GPU.
"""

from __future__ import annotations

from contextlib import contextmanager

import triton.language as tl
from triton.runtime.jit import JITFunction


def gpu_jit(fn=None, *, do_not_specialize=()):
    """``fn`` as a compiled ``JITFunction``. Not ``triton.jit``: that returns an interpreted
    function when ``TRITON_INTERPRET=1`` happens to be set at import time, and the process would
    then never compile for the GPU. ``@gpu_jit(do_not_specialize=[...])``: those arguments'
    values are not specialised on (Triton's option of that name)."""
    if fn is None:
        return lambda f: JITFunction(f, do_not_specialize=list(do_not_specialize))
    return JITFunction(fn)


@contextmanager
def _jit_calls_interpreted(kernel: JITFunction):
    """While the interpreter runs ``kernel``, let it call ``@jit`` functions.

    The interpreter can call a ``@jit`` function (``tl.sum``, ``tl.max``, a kernel's pieces)
    only if it was created while ``TRITON_INTERPRET=1`` was set; kernel modules and Triton are
    usually imported before that (tests set it per test). So for the duration of the run,
    every ``JITFunction`` the kernel can reach through ``triton.language`` or through the
    globals of non-Triton modules is swapped for an interpreted twin, the way the
    interpreter itself patches ``tl`` for a run; everything is put back afterwards.
    """
    from triton.runtime.interpreter import InterpretedFunction

    changes = []

    def swap(namespace):
        for name, value in list(namespace.items()):
            if isinstance(value, JITFunction):
                changes.append((namespace, name, value))
                namespace[name] = InterpretedFunction(value.fn)
                if not value.fn.__module__.startswith("triton"):
                    reach(value.fn.__globals__)

    seen = set()

    def reach(namespace):
        if id(namespace) not in seen:
            seen.add(id(namespace))
            swap(namespace)

    try:
        reach(vars(tl))
        reach(kernel.fn.__globals__)
        yield
    finally:
        for namespace, name, value in reversed(changes):
            namespace[name] = value


class Interpreted:
    """``kernel[grid](...)`` run by Triton's CPU interpreter (see :func:`_jit_calls_interpreted`)."""

    def __init__(self, kernel: JITFunction):
        from triton.runtime.interpreter import InterpretedFunction
        self.kernel = kernel
        self.interpreted = InterpretedFunction(kernel.fn)

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            with _jit_calls_interpreted(self.kernel):
                return self.interpreted[grid](*args, **kwargs)
        return run


class OnGpu:
    """``kernel[grid](...)`` compiled for the GPU with floating-point contraction on, whatever
    Triton's default: every kernel here was built and measured with ``a * b + c`` as one fused
    multiply-add (the attention softmax's scale and shift are one FMA per logit), which Triton up
    to 3.9 did by default and 3.10 no longer does (3.9 warns on every first launch that leaves it
    unset)."""

    def __init__(self, kernel: JITFunction):
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            return launch(*args, enable_fp_fusion=True, **kwargs)
        return run


def compiled(interpret: bool, kernel: JITFunction):
    """``kernel`` as a launchable Triton function: compiled for the GPU (with fused multiply-adds,
    see :class:`OnGpu`), or run by Triton's CPU interpreter.

    Chosen per call rather than at import so that ``TRITON_INTERPRET`` can be set after solattn
    is imported (tests do).
    """
    return Interpreted(kernel) if interpret else OnGpu(kernel)


__all__ = ["Interpreted", "OnGpu", "compiled", "gpu_jit"]
