"""Configuration: the launch and routing settings of the GPU paths as explicit values, process-wide or
scoped to a block of calls, like the memory budgets (the scope covers only the thread or asyncio
task that entered it).

Each kind of setting is a frozen dataclass deriving from :class:`Tuning` whose defaults are the
shipped, measured choices, e.g. :class:`solattn.backends.triton.TritonTuning` (the attention
kernels' launches) and :class:`solattn.routing.fused.FusedPlanTuning` (the fused routing plan)::

    from solattn.backends.triton import TritonTuning
    from solattn.config import reset_tuning, set_tuning, tuning
    with tuning(TritonTuning(tma_min_programs=0)):     # only the calls inside the block
        out = solattn.sol_attn(q, k, v, topk_ratio=0.1)
    set_tuning(TritonTuning(tma_in_graphs=False))      # from now on
    reset_tuning(TritonTuning)                         # the defaults again

Results do not depend on tuning beyond floating-point rounding (the fused plan's ``tl.dot``
precision can flip near-ties of the selection). The settings in force are part of every cache
key that depends on them (:func:`tuning_key`: the CUDA graphs of :mod:`solattn.graphs`); Triton keys its
compiled kernels by their launch parameters itself.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Dict, Hashable, Iterator, Tuple, Type, TypeVar

__all__ = ["Tuning", "current_tuning", "graph_recording", "recording_graph", "reset_tuning", "set_tuning",
           "tuning", "tuning_key"]


class Tuning:
    """Base of a kind of tuning: subclasses are frozen dataclasses (hashable values) whose
    defaults are the shipped settings and which check their fields on construction."""


T = TypeVar("T", bound=Tuning)

_PROCESS: Dict[type, Tuning] = {}
#: ``kind()`` per kind, made once: the values are frozen, and a call's launch reads several kinds
_DEFAULTS: Dict[type, Tuning] = {}
_SCOPED: contextvars.ContextVar[Tuple[Tuning, ...]] = contextvars.ContextVar("solattn_tuning", default=())
_GRAPH_RECORDING: contextvars.ContextVar[bool] = contextvars.ContextVar("solattn_graph_recording", default=False)


def _check(values) -> Tuple[Tuning, ...]:
    for i, value in enumerate(values):
        if not isinstance(value, Tuning):
            raise TypeError(f"argument {i} received {type(value).__name__}; allowed: a tuning value "
                            "(an instance of a solattn.tuning.Tuning subclass, e.g. TritonTuning())")
    kinds = [type(v) for v in values]
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"arguments received two values of one kind ({', '.join(k.__name__ for k in kinds)}); "
                         "allowed: at most one value per kind")
    return tuple(values)


def current_tuning(kind: Type[T]) -> T:
    """The ``kind`` settings in force here: the innermost :func:`tuning` value, else the
    process-wide one (:func:`set_tuning`), else ``kind()`` (the defaults)."""
    for value in reversed(_SCOPED.get()):
        if type(value) is kind:
            return value
    value = _PROCESS.get(kind)
    if value is None:
        value = _DEFAULTS.get(kind)
        if value is None:
            value = _DEFAULTS[kind] = kind()
    return value


def set_tuning(*values: Tuning) -> None:
    """Make ``values`` the process-wide settings of their kinds (scoped values still win)."""
    for value in _check(values):
        _PROCESS[type(value)] = value


def reset_tuning(*kinds: type) -> None:
    """The defaults again for ``kinds`` process-wide (every kind when none is named)."""
    for kind in kinds or list(_PROCESS):
        _PROCESS.pop(kind, None)


@contextlib.contextmanager
def tuning(*values: Tuning) -> Iterator[None]:
    """Context manager: ``values`` are the settings of their kinds for the calls inside the block
    (this thread or asyncio task only); nested blocks: the inner value of a kind applies."""
    token = _SCOPED.set(_SCOPED.get() + _check(values))
    try:
        yield
    finally:
        _SCOPED.reset(token)


def tuning_key() -> Hashable:
    """The settings in force of every kind set here (scoped or process-wide; kinds never set are
    at their defaults), as a hashable value for cache keys."""
    kinds = {type(v) for v in _SCOPED.get()} | _PROCESS.keys()
    named = ((f"{k.__module__}.{k.__qualname__}", current_tuning(k)) for k in kinds)
    return tuple(sorted(named, key=lambda entry: entry[0]))


def graph_recording() -> bool:
    """True while a CUDA-graph cache (:mod:`solattn.graphs`) warms up and captures a call in this
    thread / task (the two runs see the same answer, so they launch the same kernels): work whose
    host cost is paid per launch costs nothing per replay then. The ``triton`` backend gives small
    problems TMA loads there, whose descriptors cost ~0.1 ms of host time per eager launch."""
    return _GRAPH_RECORDING.get()


@contextlib.contextmanager
def recording_graph(flag: bool = True) -> Iterator[None]:
    """Context manager: :func:`graph_recording` answers ``flag`` inside the block (the graph cache
    sets it around its warm-up and capture, and clears it around the calls it runs eagerly)."""
    token = _GRAPH_RECORDING.set(bool(flag))
    try:
        yield
    finally:
        _GRAPH_RECORDING.reset(token)
