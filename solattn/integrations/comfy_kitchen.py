"""comfy-kitchen plug-in: ``comfy_kitchen.sol_attn`` on Intel GPUs, CPUs and Macs through solattn.

How comfy-kitchen picks an implementation (releases 0.2.36 to 0.2.40, whose ``sol_attn``,
registry and constraint code are the same): ``comfy_kitchen.sol_attn``
calls its custom op ``comfy_kitchen::sol_attn``; inside the op, the registry walks its
priority list and returns the first backend that is registered, not disabled, lists
``sol_attn`` among its capabilities and whose ``FunctionConstraints`` accept the call
(per-parameter dtypes / devices / shape rules, then the call rules). On devices other
than CUDA and ROCm the only candidate is its ``eager`` reference, which forms the
whole ``(B, H, T, T)`` score matrix and refuses once that matrix passes 4 GiB.

:func:`install` registers *this module* with comfy-kitchen's registry as the backend
``"solattn"`` (capability ``sol_attn`` only; a name of its own, so it never collides with
the ``xpu`` backend of Intel's comfy-kitchen fork) and puts it at the front of the priority
list. Its :func:`sol_attn` has comfy-kitchen's signature and runs solattn's portable
backend (:data:`SOLATTN_BACKEND`), which never materialises ``T x T``. Its constraints
admit exactly what that backend runs: q/k/v bf16 / fp16 / fp32, 4-D, on the devices
asked for (``default_devices``), comfy-kitchen's own shared ``sol_attn`` call rule
(which also fixes head_dim at 128 for every backend), and then solattn's validation
and the backend's capability check, so a call we cannot run falls through to the next
backend in comfy-kitchen's order instead of failing. :func:`uninstall` puts the
registry back exactly as it was.

comfy-kitchen is imported only when :func:`install` runs; ``import solattn`` never
needs it and never installs the plug-in (comfy-kitchen has no plug-in discovery: its
backends register when imported, so installing is an explicit call). :func:`install_from_env`
installs it as ``SOLATTN_COMFY_KITCHEN`` (``xpu``, ``xpu,cpu``, ``auto``...) asks; the
ComfyUI node folder calls it when ComfyUI starts.

comfy-kitchen has no public way to unregister a backend, so :func:`uninstall` (and the
snapshot :func:`install` takes) work on the registry's private tables; :func:`install`
checks that they are there and refuses clearly on a comfy-kitchen that lays them out
differently.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

import torch

from .. import dispatch, op
from ..backends.sdpa import SdpaBackend
from ..devices import DEVICES, present_devices
from ..validation import validate

#: the name this plug-in takes in comfy-kitchen's registry
BACKEND_NAME = "solattn"
#: the solattn backend that runs every call the plug-in accepts
SOLATTN_BACKEND = "sdpa"
#: device types where comfy-kitchen runs ``sol_attn`` with kernels of its own (its ``cuda`` backend)
OWN_KERNEL_DEVICES = frozenset({"cuda"})
#: device types the plug-in may be installed for: those the portable backend declares, in the
#: order of solattn's device table, less those comfy-kitchen has its own kernels for
ALLOWED_DEVICES = tuple(t for t in DEVICES if t in SdpaBackend.devices and t not in OWN_KERNEL_DEVICES)
#: environment variable read by :func:`install_from_env`
ENV_VAR = "SOLATTN_COMFY_KITCHEN"

_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})
_ARGS = ("q", "k", "v", "tau", "scale", "sink_blocks", "sink_q", "key_bias", "topk_ratio",
         "tail", "block_len", "coarse_gate", "token_aug")
# the private registry tables install / uninstall read and restore
_REGISTRY_TABLES = ("_backends", "_capabilities", "_constraints", "_unavailable", "_priority", "_lock")
_ABSENT = object()

logger = logging.getLogger(__name__)


def sol_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tau: float = 1.0,
             scale: Optional[float] = None, sink_blocks: Optional[List[int]] = None,
             sink_q: Optional[List[int]] = None, key_bias: Optional[torch.Tensor] = None,
             topk_ratio: float = 0.0, tail: bool = True, block_len: Optional[torch.Tensor] = None,
             coarse_gate: Optional[torch.Tensor] = None, token_aug: int = 0) -> torch.Tensor:
    """comfy-kitchen's ``sol_attn`` signature, computed by solattn's :data:`SOLATTN_BACKEND`
    backend (SPEC.md semantics). ``(B, T, H, D)`` in, ``(B, T, H, D)`` contiguous out in v's dtype.

    A bad argument raises ``ValueError`` (solattn's message: the argument, the value, what is
    allowed), never ``TypeError``: comfy-kitchen's backends raise ``ValueError`` for every bad
    argument, wrong dtypes included, and its callers catch that."""
    try:
        validate(q, k, v, tau, scale, sink_blocks, sink_q, key_bias, topk_ratio, tail, block_len,
                 coarse_gate, token_aug)
    except TypeError as exc:
        raise ValueError(str(exc)) from exc
    return op.sol_attn(q, k, v, tau, scale, sink_blocks, sink_q, key_bias, topk_ratio, tail,
                       block_len, coarse_gate, token_aug, backend=SOLATTN_BACKEND)


# --------------------------------------------------------------------------- constraints

def _argument_named(exc: Exception) -> str:
    """The argument a solattn validation error names (``'__solattn__'`` if none)."""
    found = re.search(r"argument '(\w+)'", str(exc))
    return found.group(1) if found else "__solattn__"


def _solattn_call_rule(kwargs: Mapping[str, object]):
    """comfy-kitchen call rule: solattn's validation plus the backend's capability check.

    Runs on metadata (and a cheap key_bias normalisation) only. A failure makes
    comfy-kitchen move on to the next backend in its priority list."""
    from comfy_kitchen.constraints import ValidationResult

    try:
        problem = validate(**{name: kwargs[name] for name in _ARGS if name in kwargs})
    except (TypeError, ValueError) as exc:
        return ValidationResult.fail(_argument_named(exc), str(exc))
    try:
        backend = dispatch.get_backend(SOLATTN_BACKEND)
    except ValueError:
        return ValidationResult.fail(
            "__backend__", f"solattn backend '{SOLATTN_BACKEND}' is not registered "
                           f"(registered: {', '.join(dispatch.registered())})")
    reasons = backend.not_supported_reasons(problem)
    if reasons:
        return ValidationResult.fail("__backend__", f"solattn backend '{SOLATTN_BACKEND}': " + "; ".join(reasons))
    return ValidationResult.ok()


def _constraints(ck_constraints, devices: Tuple[str, ...]):
    tensor = ck_constraints.ParamConstraint(dtypes=_DTYPES, shape_rules=(ck_constraints.ExactDims(4),))
    return ck_constraints.FunctionConstraints(
        params={"q": tensor, "k": tensor, "v": tensor},
        default_devices=frozenset(devices),
        call_rules=(ck_constraints.sol_attn_common_call_rule, _solattn_call_rule),
    )


# --------------------------------------------------------------------------- comfy-kitchen access

def _comfy_kitchen_version() -> str:
    try:
        from importlib.metadata import version
        return version("comfy-kitchen")
    except Exception:  # noqa: BLE001 - only used in messages
        return "unknown"


def _import_comfy_kitchen():
    """``(registry, constraints module)`` of comfy-kitchen, or a clear ImportError / RuntimeError."""
    try:
        import comfy_kitchen
        from comfy_kitchen import constraints as ck_constraints
        from comfy_kitchen.registry import registry
    except ImportError as exc:
        raise ImportError(
            "solattn's comfy-kitchen plug-in needs the comfy-kitchen package, which cannot be "
            f"imported here ({exc}). Install it with `pip install comfy-kitchen` "
            "(tested with 0.2.36 and 0.2.40; in a solattn checkout, `pip install -e \".[comfy]\"` does the same).") from exc
    missing = [name for name in _REGISTRY_TABLES if not hasattr(registry, name)]
    missing += [name for name in ("FunctionConstraints", "ParamConstraint", "ExactDims", "ValidationResult",
                                  "sol_attn_common_call_rule") if not hasattr(ck_constraints, name)]
    if not hasattr(comfy_kitchen, "sol_attn"):
        missing.append("comfy_kitchen.sol_attn")
    if missing:
        raise RuntimeError(
            f"comfy-kitchen {_comfy_kitchen_version()} lacks what solattn's plug-in relies on "
            f"({', '.join(missing)}); the plug-in is tested with comfy-kitchen 0.2.36 and 0.2.40 "
            "(`pip install \"comfy-kitchen>=0.2.36\"`).")
    return registry, ck_constraints


# --------------------------------------------------------------------------- install / uninstall

@dataclass
class _Snapshot:
    """What comfy-kitchen's registry held under :data:`BACKEND_NAME` before the first install."""

    backend: object
    capabilities: object
    constraints: Dict[tuple, object]
    unavailable: object
    priority: List[str]


@dataclass
class _Installed:
    registry: object
    snapshot: _Snapshot
    devices: Tuple[str, ...]
    first: bool
    priority: List[str] = field(default_factory=list)  # the order install() set


_installed: Optional[_Installed] = None
_lock = threading.RLock()


def _this_module():
    return sys.modules[__name__]


def _take_snapshot(registry) -> _Snapshot:
    with registry._lock:
        caps = registry._capabilities.get(BACKEND_NAME, _ABSENT)
        return _Snapshot(
            backend=registry._backends.get(BACKEND_NAME, _ABSENT),
            capabilities=set(caps) if caps is not _ABSENT else _ABSENT,
            constraints={key: c for key, c in registry._constraints.items() if key[0] == BACKEND_NAME},
            unavailable=registry._unavailable.get(BACKEND_NAME, _ABSENT),
            priority=list(registry._priority),
        )


def _check_devices(devices, arg: str = "devices") -> Tuple[str, ...]:
    allowed = f"a non-empty tuple of device types from {ALLOWED_DEVICES}"
    items = (devices,) if isinstance(devices, str) else devices
    try:
        items = tuple(items)
    except TypeError:
        raise ValueError(f"install: argument '{arg}' received {devices!r}; allowed: {allowed}") from None
    if not items or any(not isinstance(d, str) or d not in ALLOWED_DEVICES for d in items):
        raise ValueError(f"install: argument '{arg}' received {devices!r}; allowed: {allowed}")
    return tuple(dict.fromkeys(items))  # de-duplicated, order kept


def install(devices: Iterable[str] = ("xpu",), first: bool = True) -> Tuple[str, ...]:
    """Register solattn as comfy-kitchen's ``"solattn"`` backend for ``sol_attn`` on ``devices``.

    Args:
        devices: device types whose ``comfy_kitchen.sol_attn`` calls the plug-in takes,
            from ``("xpu", "cpu", "mps")`` (a single string is accepted too).
        first: put ``"solattn"`` at the front of comfy-kitchen's priority list; otherwise just
            before comfy-kitchen's ``eager`` reference (or last if there is none).

    Returns:
        The device types installed for.

    Idempotent: installing again with the same arguments changes nothing; with other
    ``devices`` or ``first`` it updates the registration in place. :func:`uninstall`
    always returns to the state before the first install. Raises ``ValueError`` for bad
    arguments, ``ImportError`` when comfy-kitchen is not installed, and ``RuntimeError``
    when comfy-kitchen already has a backend of its own called ``"solattn"``.

    comfy-kitchen's ``set_backend_priority`` replaces its whole priority list, and the
    registry only ever tries backends on that list: a list that leaves out ``"solattn"``
    turns the plug-in off while it stays registered. Call :func:`install` again afterwards
    to put it back into the new list.
    """
    global _installed
    devices = _check_devices(devices)
    if not isinstance(first, bool):
        raise TypeError(f"install: argument 'first' received {first!r}; allowed: True or False")
    registry, ck_constraints = _import_comfy_kitchen()
    module = _this_module()
    with _lock:
        state = _installed if _installed is not None and _installed.registry is registry else None
        current = registry._backends.get(BACKEND_NAME)
        if state is None and current is not None and current is not module:
            raise RuntimeError(
                f"comfy-kitchen already has a backend named '{BACKEND_NAME}' ({current!r}); "
                "solattn's plug-in does not replace it. Use that backend, or remove it from "
                "comfy-kitchen's registry before installing solattn's.")
        if (state is not None and state.devices == devices and state.first == first
                and current is module and registry._priority == state.priority):
            return devices
        snapshot = state.snapshot if state is not None else _take_snapshot(registry)
        registry.register(BACKEND_NAME, module, {"sol_attn": _constraints(ck_constraints, devices)})
        order = [name for name in registry._priority if name != BACKEND_NAME]
        if first:
            order.insert(0, BACKEND_NAME)
        else:
            order.insert(order.index("eager") if "eager" in order else len(order), BACKEND_NAME)
        registry.set_priority(order)
        _installed = _Installed(registry, snapshot, devices, first, list(order))
    logger.debug("solattn: comfy-kitchen backend '%s' installed for %s, priority %s",
                 BACKEND_NAME, devices, order)
    return devices


def uninstall() -> bool:
    """Undo :func:`install`: comfy-kitchen's registry entries under ``"solattn"`` and its priority
    list return to what they were before the first install. Returns False if not installed.

    If the priority list was changed by someone else since the install, their order is
    kept and only the plug-in's own entry is taken out of it."""
    global _installed
    with _lock:
        state = _installed
        if state is None:
            return False
        registry, snap = state.registry, state.snapshot
        with registry._lock:
            for table, saved in ((registry._backends, snap.backend),
                                 (registry._capabilities, snap.capabilities),
                                 (registry._unavailable, snap.unavailable)):
                if saved is _ABSENT:
                    table.pop(BACKEND_NAME, None)
                else:
                    table[BACKEND_NAME] = set(saved) if isinstance(saved, set) else saved
            for key in [key for key in registry._constraints if key[0] == BACKEND_NAME]:
                del registry._constraints[key]
            registry._constraints.update(snap.constraints)
            if registry._priority == state.priority:
                registry._priority = list(snap.priority)
            elif BACKEND_NAME not in snap.priority:
                registry._priority = [name for name in registry._priority if name != BACKEND_NAME]
        _installed = None
    logger.debug("solattn: comfy-kitchen backend '%s' uninstalled", BACKEND_NAME)
    return True


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _installed is not None


def installed_devices() -> Optional[Tuple[str, ...]]:
    """The device types the plug-in is installed for, or None."""
    state = _installed
    return state.devices if state is not None else None


def available_devices(include_cpu: bool = True) -> Tuple[str, ...]:
    """Device types present here that the plug-in can serve: the accelerators of
    :data:`ALLOWED_DEVICES` (``xpu``, ``mps``) when available, then ``cpu`` (unless
    ``include_cpu`` is False)."""
    types = {name.split(":")[0] for name in present_devices()}
    return tuple(t for t in ALLOWED_DEVICES if DEVICES[t].accelerator and t in types) + (("cpu",) if include_cpu else ())


def install_from_env(environ: Optional[Mapping[str, str]] = None) -> Optional[Tuple[str, ...]]:
    """Install the plug-in as ``SOLATTN_COMFY_KITCHEN`` asks (the ComfyUI node folder calls this).

    The value is a comma-separated list of device types (``xpu``, ``xpu,cpu``...) or
    ``auto`` (:func:`available_devices`); unset or empty does nothing and returns None.
    A bad value raises ``ValueError`` naming the variable; a missing comfy-kitchen raises
    ``ImportError`` (the variable asked for the plug-in explicitly)."""
    env = os.environ if environ is None else environ
    value = env.get(ENV_VAR, "").strip()
    if not value:
        return None
    if value.lower() == "auto":
        devices: Tuple[str, ...] = available_devices()
    else:
        devices = tuple(part.strip().lower() for part in value.split(","))
        try:
            devices = _check_devices(devices)
        except ValueError:
            raise ValueError(f"environment variable {ENV_VAR} received {value!r}; allowed: 'auto' or a "
                             f"comma-separated list of device types from {ALLOWED_DEVICES}, "
                             "e.g. 'xpu' or 'xpu,cpu'") from None
    return install(devices)


__all__ = ["install", "uninstall", "is_installed", "installed_devices", "available_devices",
           "install_from_env", "sol_attn", "BACKEND_NAME", "SOLATTN_BACKEND", "ALLOWED_DEVICES", "ENV_VAR"]
