"""Backend registry and selection.

Order of precedence: an explicit ``backend=`` argument, then the innermost
``use_backend(...)`` block, then the ``SOLATTN_BACKEND`` environment variable
(a preference: if that backend cannot run a call, solattn warns once and falls
back to the priority list), then the per-device-type priority list: the built-in
order of the device type's entry (``solattn.devices.DEVICES``) with the positions given to
``register(backend, priority=...)``.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import warnings
from typing import Dict, Iterator, List, Mapping, Optional, Union

import torch

from .backends.base import Backend
from .compiling import tracing
from .devices import best_device, entry
from .validation import Problem

_REGISTRY: Dict[str, Backend] = {}

#: positions given at registration: backend name -> {device type (or "*" for every type): index}
_POSITIONS: Dict[str, Dict[str, int]] = {}

#: the innermost ``use_backend`` name; a context variable, so a block scopes only the thread
#: (or asyncio task) that entered it, and other threads' calls are not forced onto it
#: bumped by register / unregister (see choice_key)
_GENERATION = 0
_forced: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("solattn_forced_backend", default=None)
_warned_env: set = set()


class BackendError(RuntimeError):
    """No backend (or not the requested one) can run a call; the message lists the reasons."""


def _positions(backend: Backend, priority) -> Dict[str, int]:
    """Check ``register``'s ``priority`` argument and turn it into {device type: index}."""
    def index(value, what):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"argument 'priority' received {what}={value!r}; allowed: an int >= 0 "
                            f"(0 = tried first)")
        if value < 0:
            raise ValueError(f"argument 'priority' received {what}={value!r}; allowed: an int >= 0 "
                             f"(0 = tried first)")
        return value

    if priority is None:
        return {}
    if isinstance(priority, Mapping):
        out = {}
        for dev_type, value in priority.items():
            if not isinstance(dev_type, str) or (backend.devices is not None and dev_type not in backend.devices):
                allowed = "any device type" if backend.devices is None else sorted(backend.devices)
                raise ValueError(f"argument 'priority' received device type {dev_type!r}; allowed: the "
                                 f"device types backend '{backend.name}' declares ({allowed})")
            out[dev_type] = index(value, repr(dev_type))
        return out
    if isinstance(priority, int) and not isinstance(priority, bool):
        pos = index(priority, "position")
        return {"*": pos} if backend.devices is None else {d: pos for d in backend.devices}
    raise TypeError(f"argument 'priority' received {type(priority).__name__} {priority!r}; allowed: None, "
                    f"an int >= 0 (the position on every device type the backend declares) or a dict "
                    f"mapping device types to positions, e.g. {{'cuda': 0}}")


def register(backend: Backend, priority: Union[None, int, Mapping[str, int]] = None) -> Backend:
    """Register ``backend`` (a :class:`~solattn.backends.base.Backend` instance) under its name.

    ``priority`` places it in the automatic choice: a dict ``{device type: position}``
    (0 = tried first, e.g. ``{"cuda": 0}``) or one int for every device type the backend
    declares. Without it the backend runs only when asked for by name (``backend=``,
    ``use_backend``, ``SOLATTN_BACKEND``), unless it is a built-in. Registering a name
    again replaces the backend and its positions. Returns ``backend``.
    """
    if not isinstance(backend, Backend):
        raise TypeError(f"argument 'backend' received {type(backend).__name__}; allowed: an instance of "
                        f"solattn.Backend")
    if not backend.name or backend.name != backend.name.lower() or not backend.name.isalpha():
        raise ValueError(f"backend names are lowercase words; received {backend.name!r}")
    positions = _positions(backend, priority)
    global _GENERATION
    _GENERATION += 1
    _REGISTRY[backend.name] = backend
    _POSITIONS.pop(backend.name, None)
    if positions:
        _POSITIONS[backend.name] = positions
    return backend


def unregister(name: str) -> Backend:
    """Remove the backend called ``name`` (and its priority); returns it."""
    backend = get_backend(name)
    global _GENERATION
    _GENERATION += 1
    del _REGISTRY[backend.name]
    _POSITIONS.pop(backend.name, None)
    return backend


def get_backend(name: str, *, asked_by: str = "argument 'backend'", optional: bool = True) -> Backend:
    """The registered backend called ``name`` (``ValueError`` listing the names otherwise, the
    name given as ``asked_by``; ``optional``: the caller may also pass None)."""
    if not isinstance(name, str) or name.lower() not in _REGISTRY:
        raise ValueError(f"{asked_by} received {name!r}; allowed: {'None or ' if optional else ''}"
                         f"one of {sorted(_REGISTRY)}")
    return _REGISTRY[name.lower()]


def registered() -> List[str]:
    return sorted(_REGISTRY)


def priority(device_type: str) -> List[str]:
    """The registered backends the automatic choice tries on ``device_type``, in order: the
    device type's built-in order (``solattn.devices``), less the names not registered and the
    backends whose ``automatic(device_type)`` says False (``flex``: taken first only where it
    measured faster, see its module), with the positions given at registration."""
    placed = {n: p.get(device_type, p.get("*")) for n, p in _POSITIONS.items()}
    placed = {n: i for n, i in placed.items() if i is not None}
    order = [n for n in entry(device_type).priority if n in _REGISTRY and n not in placed
             and _REGISTRY[n].automatic(device_type)]
    for name, i in placed.items():   # in registration order
        order.insert(min(i, len(order)), name)
    return order


def _walk(device_type: str) -> List[str]:
    """Every registered backend: the priority list, then the rest by name (the order in which
    listings and error tables show them)."""
    order = priority(device_type)
    return order + [n for n in registered() if n not in order]


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[Backend]:
    """Force backend ``name`` for every ``sol_attn`` call inside the block (raises if it cannot run)."""
    backend = get_backend(name, asked_by="use_backend: argument 'name'", optional=False)
    token = _forced.set(backend.name)
    try:
        yield backend
    finally:
        _forced.reset(token)


@contextlib.contextmanager
def without_forced_backend() -> Iterator[None]:
    """Suspend every ``use_backend`` block (a backward pass must not inherit a forward-only one)."""
    token = _forced.set(None)
    try:
        yield
    finally:
        _forced.reset(token)


def differentiable_request(requested: Optional[str]) -> Optional[str]:
    """For a backward pass: the requested (or ``use_backend``) backend when it supports autograd,
    else None (then the device's priority list picks one that does)."""
    name = requested or forced_backend()
    return name if name and "autograd" in get_backend(name).features else None


def choice_key() -> tuple:
    """Everything outside a call's arguments that decides which backend runs it: the forced
    backend (``use_backend``), ``SOLATTN_BACKEND`` and the registry's generation (it changes with
    every ``register`` / ``unregister``). Equal keys, equal arguments: the same choice."""
    return (forced_backend(), os.environ.get("SOLATTN_BACKEND"), _GENERATION)


def forced_backend() -> Optional[str]:
    """The innermost ``use_backend`` name, or None.

    None while ``torch.compile`` traces this thread (:func:`solattn.compiling.tracing`; a compile
    in another thread changes nothing here): Dynamo cannot trace a context variable, and only the
    entry points' early argument checks run at trace time; the custom ops, which dispatch,
    read it again when they run.
    """
    if tracing():
        return None
    return _forced.get()


def _reasons(backend: Backend, problem: Problem, plan_only: bool) -> List[str]:
    reasons = backend.not_supported_reasons(problem)
    if plan_only and not backend.uses_plan:
        reasons = reasons + ["does not consume a routing plan (video_sparse_attn's selection and a caller's plan need one)"]
    return reasons


def _automatic_reasons(backend: Backend, problem: Problem, plan_only: bool) -> List[str]:
    return _reasons(backend, problem, plan_only) + backend.automatic_reasons(problem)


def choose(problem: Problem, requested: Optional[str] = None, plan_only: bool = False) -> Backend:
    """Pick the backend for ``problem``; raise :class:`BackendError` with every reason if none fits.

    ``plan_only`` admits only backends that consume a routing plan (the VSA entry point builds
    its own selection into the plan, which the reference would ignore).
    """
    explicit = requested or _forced.get()
    if explicit:
        backend = get_backend(explicit)
        reasons = _reasons(backend, problem, plan_only)
        if reasons:
            others = [n for n in _walk(problem.device.type) if n != backend.name
                      and not _reasons(_REGISTRY[n], problem, plan_only)]
            raise BackendError(
                f"backend '{backend.name}' cannot run this call ({problem.describe()}): "
                + "; ".join(reasons)
                + (f". Backends that can: {', '.join(others)}" if others else ". No other backend can either."))
        return backend

    order = priority(problem.device.type)
    env = os.environ.get("SOLATTN_BACKEND", "").strip().lower()
    if env:
        if env not in _REGISTRY:
            raise ValueError(f"environment variable SOLATTN_BACKEND received {env!r}; "
                             f"allowed: unset or one of {sorted(_REGISTRY)}")
        preferred = _REGISTRY[env]
        reasons = _reasons(preferred, problem, plan_only)
        if not reasons:
            return preferred
        key = (env, problem.device.type, tuple(reasons))
        if key not in _warned_env:
            _warned_env.add(key)
            warnings.warn(f"SOLATTN_BACKEND={env} cannot run this call ({'; '.join(reasons)}); "
                          f"falling back to the priority list {order}", RuntimeWarning, stacklevel=3)
    for name in order:
        if not _automatic_reasons(_REGISTRY[name], problem, plan_only):
            return _REGISTRY[name]
    table = "\n".join(f"  {n}: " + ("; ".join(_automatic_reasons(_REGISTRY[n], problem, plan_only)) or "can run")
                      for n in _walk(problem.device.type))
    raise BackendError(f"no solattn backend can run this call ({problem.describe()}):\n" + table)


def list_backends(device=None) -> List[dict]:
    """For each registered backend: can it run on ``device`` (default: the best present) and why not.

    Returns a list of ``{"name", "available", "reasons", "priority", "description",
    "automatic"}`` dicts, in the device's priority order first, then the rest; ``automatic``
    lists what keeps the automatic choice from taking an available backend for some calls.
    """
    dev = as_device("list_backends", device) if device is not None else best_device()
    order = priority(dev.type)
    out = []
    for name in _walk(dev.type):
        b = _REGISTRY[name]
        reasons = b.availability_reasons(dev)
        out.append({"name": name, "available": not reasons, "reasons": reasons,
                    "priority": order.index(name) if name in order else None,
                    "description": b.description, "automatic": b.automatic_notes(dev) if not reasons else []})
    return out


def as_device(fn: str, device) -> torch.device:
    """``device`` (a ``torch.device`` or a device string) as a ``torch.device``, or a clear error."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        exc = TypeError if not isinstance(device, (str, int)) else ValueError
        raise exc(f"{fn}: argument 'device' received {device!r}; allowed: None, a torch.device or a device "
                  f"string such as 'cpu', 'cuda', 'cuda:1', 'xpu' or 'mps' ({err})") from None
