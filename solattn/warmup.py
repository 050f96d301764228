"""Compiling ahead: one call of a shape now, so that later calls of it run at once.

    import solattn
    seconds = solattn.warm_up(solattn.sol_attn, q, k, v, topk_ratio=0.1)
    out = solattn.sol_attn(q, k, v, topk_ratio=0.1)        # automatic choice: flex, compiled

The ``flex`` backend compiles a kernel for each call shape (device, dtype, B, T, H, D, key_bias
rows, tail, scale) on its first call: 15-90 s on a CPU. The automatic choice takes it on the CPU
only for shapes compiled in the process, so a program that calls one shape many times (a video
model's attention layers over its denoising steps) warms that shape up once, at start-up.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from . import dispatch


def warm_up(fn: Callable, *args, backend: str = "flex", **kwargs) -> float:
    """Run ``fn(*args, backend=backend, **kwargs)`` once without autograd (``fn`` is
    :func:`solattn.sol_attn` or :func:`solattn.video_sparse_attn`, with the arguments of the calls
    to come: tensors of their shapes, dtype and device, the same ``scale``, ``tail`` and kind of
    ``key_bias``) and return the seconds it took. Afterwards the automatic choice takes
    ``backend`` for calls of that shape where it comes first (``flex`` on CPUs with AMX).

    Raises :class:`solattn.BackendError` when the backend cannot run the call here (its compile
    failed: the compiler's error is given) and ``TypeError`` / ``ValueError`` for bad arguments."""
    from .op import sol_attn, video_sparse_attn
    if fn not in (sol_attn, video_sparse_attn):
        raise TypeError(f"warm_up: argument 'fn' received {fn!r}; allowed: solattn.sol_attn or "
                        f"solattn.video_sparse_attn")
    dispatch.get_backend(backend, asked_by="warm_up: argument 'backend'", optional=False)
    start = time.perf_counter()
    with torch.no_grad():
        fn(*args, backend=backend, **kwargs)
    return time.perf_counter() - start
