"""Memory budgets: a byte limit per backend, process-wide or scoped to a block of calls
(the scope covers only the thread or asyncio task that entered it).

    solattn.set_memory_budget(256 << 20)              # the portable backend, from now on
    with solattn.memory_budget(64 << 20):             # only the calls inside the block
        out = solattn.sol_attn(q, k, v, topk_ratio=0.1)
    solattn.set_memory_budget(8 << 30, backend="reference")

The ``sdpa`` budget bounds the portable backend's working memory beyond inputs and
output, routing plan included, to 1.25 times the budget plus 32 MiB (it sizes the chunks;
results do not change); a budget below a call's floor (what the plan and the per-call tables
hold whatever the chunk sizes, :func:`solattn.backends.sdpa.memory.floor_bytes`) is refused. The ``reference`` budget is
the most the dense oracle may allocate; above it the backend refuses with a reason.
"""

from __future__ import annotations

import contextlib
import contextvars
import numbers
import os
from typing import Dict, Iterator, Optional


def _check(nbytes, what: str) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral):
        raise TypeError(f"{what} received {nbytes!r} of type {type(nbytes).__name__}; "
                        "allowed: a positive int (bytes)")
    if nbytes <= 0:
        raise ValueError(f"{what} received {nbytes!r}; allowed: a positive int (bytes)")
    return int(nbytes)


class MemoryBudget:
    """A byte budget with a default (overridable by an environment variable), a process-wide
    setting and nested scopes; :attr:`bytes` is the one in force.

    Scopes live in a context variable: a ``with`` block binds the thread (or asyncio task)
    that entered it, never calls made concurrently elsewhere."""

    def __init__(self, backend: str, env: str, default: int):
        self.backend, self.env = backend, env
        raw = os.environ.get(env, "").strip()
        self.default = _check(int(raw), f"environment variable {env}") if raw.isdigit() else default
        if raw and not raw.isdigit():
            raise ValueError(f"environment variable {env} received {raw!r}; allowed: a positive int (bytes)")
        self._value = self.default
        self._scope: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar(
            f"solattn_{backend}_budget", default=None)

    @property
    def bytes(self) -> int:
        scoped = self._scope.get()
        return self._value if scoped is None else scoped

    def set(self, nbytes: Optional[int]) -> None:
        """Set the process-wide budget; ``None`` restores the default."""
        self._value = self.default if nbytes is None else _check(nbytes, "argument 'nbytes'")

    @contextlib.contextmanager
    def scope(self, nbytes: int) -> Iterator[int]:
        token = self._scope.set(_check(nbytes, "argument 'nbytes'"))
        try:
            yield nbytes
        finally:
            self._scope.reset(token)


BUDGETS: Dict[str, MemoryBudget] = {
    "sdpa": MemoryBudget("sdpa", "SOLATTN_SDPA_BUDGET", 1 << 30),
    "reference": MemoryBudget("reference", "SOLATTN_REFERENCE_BUDGET", 4 << 30),
}


def _get(backend: str) -> MemoryBudget:
    if backend not in BUDGETS:
        raise ValueError(f"argument 'backend' received {backend!r}; allowed: one of {sorted(BUDGETS)}")
    return BUDGETS[backend]


def set_memory_budget(nbytes: Optional[int], backend: str = "sdpa") -> None:
    """Set ``backend``'s memory budget in bytes for the whole process (``None``: the default,
    1 GiB for ``sdpa`` and 4 GiB for ``reference``, or ``SOLATTN_SDPA_BUDGET`` /
    ``SOLATTN_REFERENCE_BUDGET``)."""
    _get(backend).set(nbytes)


def memory_budget(nbytes: int, backend: str = "sdpa"):
    """Context manager: ``backend``'s budget is ``nbytes`` for the calls inside the block."""
    return _get(backend).scope(nbytes)


def current_budget(backend: str = "sdpa") -> int:
    """The budget in force for ``backend``, in bytes."""
    return _get(backend).bytes
