"""Launching compiled Triton kernels with less host time per call.

``kernel[grid](*args)`` goes through ``JITFunction.run``: it binds the arguments to the
signature, asks Triton's specialiser about every one of them, hashes the result into a cache
key, reads knobs, and only then calls the compiled kernel's launcher. On the H200 machines'
hosts a ``sol_attn`` call at H3 spent 0.7-1.9 ms of host time on its six or seven launches and
their Python, about as long as the routing plan's GPU work, so a synchronised call waited on
the host (``benchmarks/diag/e2e_h3.py``).

:class:`Launcher` keeps, per kernel, the compiled kernels it has launched under a key of its own
that is at least as fine as Triton's specialisation (:func:`arg_key`, checked against Triton's
specialiser in ``tests/test_launch.py``), and launches a cache hit through the compiled kernel's
own launcher, the call ``JITFunction.run`` ends with. A miss, or an argument of a kind it does
not know, goes through ``kernel[grid]`` as before (which compiles where needed).

``CHECK`` (environment ``SOLATTN_CHECK_LAUNCH=1``; the GPU test suite sets it) makes every hit
also ask Triton which compiled kernel it would have run, and raise if that is another one.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Dict, Optional, Tuple

import torch

#: on every cache hit, compare with the kernel Triton itself picks (``JITFunction.warmup``)
CHECK = os.environ.get("SOLATTN_CHECK_LAUNCH", "0") == "1"

#: set to False to send every launch through ``kernel[grid]`` (benchmarks compare the two)
ENABLED = True

_INT32 = (-2 ** 31, 2 ** 31 - 1)
_INT64 = (-2 ** 63, 2 ** 63 - 1)


class _Unknown(Exception):
    """An argument :func:`arg_key` has no key for: the launch takes Triton's own path."""


def arg_key(a: Any) -> Tuple:
    """A hashable key of one argument that tells apart every two values Triton 3.6-3.9 compiles
    differently: a tensor's dtype and 16-byte alignment; an int's width class (i32, i64, u64),
    divisibility by 16 and whether it is 1 (a constant); a descriptor's dtype, block shape and
    padding; bools, floats and None by kind. Constexpr arguments (and kernel options) are keyed
    by value by the caller. Raises :class:`_Unknown` for anything else."""
    t = type(a)
    if t is bool:
        return ("b",)
    if t is int:
        width = 0 if _INT32[0] <= a <= _INT32[1] else 1 if _INT64[0] <= a <= _INT64[1] else 2
        return ("i", width, a % 16 == 0, a == 1)
    if t is float:
        return ("f",)
    if a is None:
        return ("n",)
    if isinstance(a, torch.Tensor):
        return ("t", a.dtype, a.data_ptr() % 16 == 0)
    if t.__name__ == "TensorDescriptor" and t.__module__.startswith("triton."):
        return ("d", a.base.dtype, tuple(a.block_shape), getattr(a, "padding", None))
    raise _Unknown(t.__name__)


class Launcher:
    """``Launcher(kernel)[grid](*args, **kwargs)`` launches ``kernel`` (a ``JITFunction``) like
    ``kernel[grid](*args, **kwargs)``; see the module docstring. ``kwargs`` are constexprs and
    launch options (``num_warps``, ``enable_fp_fusion``, ...), keyed by value."""

    def __init__(self, kernel):
        self.kernel = kernel
        params = list(inspect.signature(kernel.fn).parameters.values())
        self.names = [p.name for p in params]
        self.name_set = frozenset(self.names)
        self.defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        self.constexpr = {p.name for p in kernel.params if p.is_constexpr}
        self.cache: Dict[Tuple, Any] = {}

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            return self.launch(grid, args, kwargs)
        return run

    def _key(self, args, kwargs) -> Optional[Tuple]:
        try:
            pos = tuple(a if name in self.constexpr else arg_key(a) for name, a in zip(self.names, args))
            kw = tuple((name, val if name in self.constexpr or name not in self.name_set else arg_key(val))
                       for name, val in kwargs.items())
            hash(kw)
        except (_Unknown, TypeError):
            return None
        return (torch.cuda.current_device(), pos, kw)

    def _bound(self, args, kwargs) -> list:
        """Every parameter's value in signature order (what the compiled launcher takes)."""
        full = list(args)
        for name in self.names[len(args):]:
            full.append(kwargs[name] if name in kwargs else self.defaults[name])
        return full

    def launch(self, grid, args, kwargs):
        key = self._key(args, kwargs) if ENABLED and not callable(grid) else None
        compiled = self.cache.get(key) if key is not None else None
        if compiled is None:
            compiled = self.kernel[grid](*args, **kwargs)
            if key is not None and compiled is not None and not hasattr(compiled, "result"):
                self.cache[key] = compiled
            return compiled
        if CHECK:
            picked = self.kernel.warmup(*args, grid=grid, **kwargs)
            if picked is not compiled:
                raise RuntimeError(f"solattn launch cache: {self.kernel.fn.__name__} hit a compiled kernel "
                                   f"that Triton would not run for these arguments (key {key})")
        from triton import knobs
        full = self._bound(args, kwargs)
        device = key[0]
        stream = torch._C._cuda_getCurrentRawStream(device)
        g = tuple(grid) + (1, 1)
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        meta = None if enter is None else compiled.launch_metadata(grid, stream, *full)
        compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, meta,
                     enter, leave, *full)
        return compiled
