"""The fast path and the modes a call meets: a plain eager call (no tracing, transform, tensor
subclass or dispatch mode, :func:`plain_eager`) runs the op's computation directly, through the
active :func:`solattn.graphs.cuda_graphs` cache when there is one (:func:`eager_call`); the rest
goes through the ``torch.library`` custom op (:mod:`.custom`), with transforms that would drop a
derivative refused first (:func:`check_transforms`). Also the forward's scoped settings for its
backward, and autograd recording inside a backward op.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Optional, Sequence, Tuple

import torch

from .. import dispatch, graphs
from ..budget import BUDGETS, current_budget
from ..compiling import tracing

Tensor = torch.Tensor


def plain_eager(*tensors: Optional[Tensor]) -> bool:
    """True when a call needs nothing the custom op gives: no tracing (torch.compile, export), no
    tensor subclass (fake, meta or distributed tensors) and no active dispatch mode (e.g. a FLOP
    counter). Then the public functions call the op's computation directly and skip the op's
    dispatch and autograd wrapping (several hundred microseconds per call), which is the whole
    cost of small problems; everything else goes through the op."""
    if tracing() or torch.jit.is_tracing() or _dispatch_mode_active() \
            or _transforms_active():
        return False
    return all(t is None or (type(t) is torch.Tensor and t.device.type != "meta") for t in tensors)


def eager_call(fn: Callable[[], Tensor], device: torch.device,
               key: Callable[[], Tuple[Sequence[Optional[Tensor]], tuple]]) -> Tensor:
    """Run a plain eager call ``fn``: through the active :func:`solattn.graphs.cuda_graphs` cache
    when there is one and ``device`` (the inputs') is a CUDA device, else directly. ``key()``
    (asked only then): every tensor ``fn`` reads, and every other argument (lists as tuples). The
    cache's key also holds the settings a call's work depends on (the backend choice's, the memory
    budgets); module-level tunables (e.g. the triton launcher's defaults) are not in it: change
    them outside the block."""
    cache = graphs.active_cache()
    if cache is None or device.type != "cuda":
        return fn()
    tensors, extra = key()
    extra = tuple(tuple(x) if isinstance(x, list) else x for x in extra)
    settings = (*dispatch.choice_key(), *(current_budget(name) for name in sorted(BUDGETS)))
    return cache.run(fn, tensors, extra + settings)


def _transforms_active() -> bool:
    """functorch transforms (vmap, grad, jvp) or forward-mode AD: the op's batching / forward-AD
    rules apply to the op, not to its computation."""
    functorch = getattr(torch._C, "_are_functorch_transforms_active", None)
    if functorch is None or functorch():
        return True
    forward_ad = getattr(torch.autograd, "forward_ad", None)
    level = getattr(forward_ad, "_current_level", None)
    return level is None or level >= 0


def _differentiated_by_functorch(t) -> bool:
    """Whether ``t`` is wrapped at a torch.func grad / vjp / jvp level (a ``GradTrackingTensor``
    somewhere under its vmap wrappers): an input those transforms differentiate. Tensors the
    transformed function merely closes over are not wrapped."""
    f = torch._C._functorch
    while isinstance(t, Tensor) and f.is_functorch_wrapped_tensor(t):
        if f.is_gradtrackingtensor(t):
            return True
        t = f.get_unwrapped(t)
    return False


def check_transforms(fn: str, tensors: Sequence[Optional[Tensor]]) -> None:
    """Refuse, before any work, an input that a transform differentiates through the op, which
    has no rule for it: torch.func's grad / vjp / jacrev / jvp (a jvp would silently return a zero
    tangent) and forward-mode AD through dual tensors. ``torch.vmap`` runs (one call per batch entry),
    and so does a transformed function whose derivative does not pass through the op. Skipped while
    torch.compile traces (Dynamo cannot follow these checks; the compiled call runs as before)."""
    if tracing() or not _transforms_active():
        return
    what = None
    try:
        if any(_differentiated_by_functorch(t) for t in tensors):
            what = "a torch.func transform that differentiates (grad, vjp, jacrev, jvp, ...)"
    except AttributeError:                      # a torch without these functorch queries
        pass
    if what is None:
        from torch.autograd import forward_ad
        if getattr(forward_ad, "_current_level", -1) >= 0 and any(
                isinstance(t, Tensor) and forward_ad.unpack_dual(t).tangent is not None for t in tensors):
            what = "forward-mode AD (a dual tensor with a tangent)"
    if what is not None:
        raise NotImplementedError(
            f"{fn}: {what} is not supported: its derivative would be dropped or rejected. Differentiate "
            f"with torch.autograd instead (loss.backward() or torch.autograd.grad); torch.vmap is supported")


def _dispatch_mode_active() -> bool:
    try:
        from torch.utils._python_dispatch import _get_current_dispatch_mode
    except ImportError:          # a future torch without it: be conservative, use the op
        return True
    return _get_current_dispatch_mode() is not None


def forward_settings():
    """The caller's scoped settings, for the backward pass. They are context variables, and
    autograd may run a backward on a worker thread of its own (CUDA) or long after the ``with``
    block has ended: the recomputation must use the settings the forward ran under."""
    if tracing():  # Dynamo cannot trace context variables; compiled code
        return None                    # reads them when the op runs
    return contextvars.copy_context()


def traced(t: Tensor) -> bool:
    """Whether autograd is running a backward under tracing (torch.compile's AOTAutograd traces
    the backward with fake tensors): the backward must then be one opaque op, as its branch on the
    forward's ``fused`` flag reads data."""
    return type(t) is not torch.Tensor or tracing()


@contextlib.contextmanager
def autograd_dispatch():
    """Autograd recording inside a custom op's implementation. The dispatcher runs an op's kernel
    with the autograd keys excluded, so a backward op that differentiates a recomputation (or the
    plan's block terms) must put them back for its own local graph, with ADInplaceOrView (excluded
    too when the op runs under a dispatch mode, e.g. AOTAutograd's runtime under compiled autograd:
    without it, in-place writes into views drop out of the graph); the autocast exclusions stay."""
    try:
        exclude = torch._C._dispatch_tls_local_exclude_set()
        keys = exclude - exclude                        # an empty set (the constructor wants a key)
        for name in dir(torch._C.DispatchKey):
            if name == "ADInplaceOrView" or (name.startswith("Autograd")
                                             and name not in ("Autograd", "AutogradFunctionality")):
                keys = keys | torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, name))
        guard = torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude - keys)
    except (AttributeError, TypeError) as err:          # private dispatcher API of this torch
        raise RuntimeError(
            f"solattn: a traced (compiled) backward needs torch's dispatch-key guards, which torch "
            f"{torch.__version__} does not offer as expected ({err}); run the backward eagerly "
            f"(compile without the backward, or call the op outside torch.compile)") from err
    with guard:
        yield
