"""Whether the calling thread is being traced by ``torch.compile`` or ``torch.export``.

``torch.compiler.is_compiling()`` alone cannot say: outside traced code it reads one flag of the
whole process, True while any thread compiles (for the whole compile, tens of seconds for a
first flex call on a small CPU). Code that runs eagerly in another thread meanwhile must keep
its context variables (``use_backend``, memory budgets) and its eager path, so :func:`tracing`
looks further when the flag is up: Dynamo folds ``is_dynamo_compiling()`` to True in the code it
traces, and the rest of a compile (AOTAutograd's traces, export's) runs in the compiling thread
under torch's thread-local tracing or compile context, or a fake-tensor mode.
"""

from __future__ import annotations

import torch


def tracing() -> bool:
    """True when this thread's current code is traced (or compiled) by torch.compile or
    torch.export; False in eager code, even while another thread compiles."""
    if torch.compiler.is_dynamo_compiling():   # constant True in what Dynamo traces
        return True
    if not torch.compiler.is_compiling():      # no compile anywhere in the process: the common case
        return False
    return _compiling_here()


def _compiling_here() -> bool:
    """The process-wide compile flag is up: whether the compile is this thread's."""
    try:
        from torch._guards import CompileContext, TracingContext
        if TracingContext.try_get() is not None or CompileContext.try_get() is not None:
            return True
    except (ImportError, AttributeError):      # a torch without these: trust the flag
        return True
    try:
        fake = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
        proxy = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY)
    except AttributeError:
        return False
    return fake is not None or proxy is not None
