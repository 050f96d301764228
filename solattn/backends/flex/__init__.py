"""The ``flex`` backend: the routing plan as FlexAttention's ``BlockMask``, run by compiled
``torch.nn.attention.flex_attention`` (gather free: the kernel walks ``kv_indices`` itself).

What it needs, and says when missing (:meth:`FlexBackend.device_reasons`): a torch with
FlexAttention, a working ``torch.compile`` for the device (on the CPU a C++ compiler and
AVX2), and on XPU an explicit opt-in (``SOLATTN_FLEX_XPU=1``: never run on Intel GPUs here).

Compiling: the first call of each shape (device type, dtype, B, T, H, D, key_bias rows, tail,
scale) compiles a kernel, 15-90 s on a CPU (torch's on-disk cache, :func:`compile_cache_dir`,
shortens it in later processes). A log line (logger ``solattn.flex``, WARNING) says so when it
starts and how long it took. :func:`solattn.warm_up` compiles a shape ahead of time.

When it runs:

- by name (``backend="flex"``, ``use_backend("flex")``): always; a compile that fails raises
  :class:`~solattn.BackendError` with the compiler's error (and is tried again on the next call).
- automatically (:func:`automatic`, :meth:`FlexBackend.automatic_reasons`): on CPUs whose matrix
  unit (AMX) the compiled kernel uses, where it measured faster than the ``sdpa`` backend, with a
  torch whose CPU lowering has compiled every shape of the test suite (:data:`CPU_TORCH`), and
  on XPU when opted in; on the CPU only for shapes already compiled in this process (a compile
  costs as much as hundreds of calls save; ``SOLATTN_FLEX_CPU=1`` takes it for every shape,
  compiling on first use, ``=0`` never). A compile that fails in an automatic call is logged once,
  the call runs on the next backend, and the automatic choice passes flex over for that shape for
  the rest of the process (not retried; ``list_backends()`` shows why; a call by name or
  :func:`solattn.warm_up` tries again and, if it compiles, clears the record).
- never where its working memory (the ``BlockMask``'s lists, ``O(B H n^2)``, and the copies a
  tail or dead rows need: :func:`~.kernel.working_bytes`) exceeds the memory budget in force
  (:func:`solattn.memory_budget`), by name or not.

The coarse branch is added outside the compiled graph: fused into it, it was an epilogue torch
2.13's CPU lowering refused ("Unsupported for epilogue_nodes in CppFlexAttentionTemplate").
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import threading
import time
from typing import Dict, List

import torch

from ...budget import current_budget
from ...validation import Problem
from ..base import ALL_FEATURES, Backend, Declined
from .kernel import call_key, clear_cache, flex_forward, forget, is_compiled, mark_compiled, working_bytes

__all__ = ["FlexBackend", "XPU_OPT_IN", "CPU_SWITCH", "amx_usable", "automatic", "flex_forward",
           "clear_cache", "failures", "compile_cache_dir"]

log = logging.getLogger("solattn.flex")

#: environment variable that opts in to running flex on Intel XPUs
XPU_OPT_IN = "SOLATTN_FLEX_XPU"
#: environment variable that overrides the CPU rule of the automatic choice: 1 (take flex first), 0 (never)
CPU_SWITCH = "SOLATTN_FLEX_CPU"
#: the oldest torch whose CPU flex_attention lowering is known to compile every shape of the test
#: suite (2.11 on a 16-core AMX Xeon and 2.13 on an AVX2 CPU were run; older torches may too, but
#: have not been run since the coarse branch left the compiled graph)
CPU_TORCH = "2.11"

#: shape (device type, dtype, B, T, H, D) -> why its compilation failed in an automatic call
#: (the automatic choice passes flex over for it; see FlexBackend.forward)
_failures: Dict[tuple, str] = {}
_failures_lock = threading.Lock()


def compile_cache_dir() -> str:
    """Where torch.compile keeps compiled kernels between processes (``TORCHINDUCTOR_CACHE_DIR``,
    else torch's default, a folder under the system's temporary directory)."""
    path = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if path:
        return path
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        return cache_dir()
    except Exception:  # noqa: BLE001 - older torch: its documented default
        import getpass
        import tempfile
        return os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")


def failures() -> Dict[str, str]:
    """Shapes whose compilation failed in this process (``"cpu float32 B=1 T=320 H=1 D=16"``),
    and the error."""
    return {f"{d} {str(t).replace('torch.', '')} B={b} T={n} H={h} D={e}": why
            for (d, t, b, n, h, e), why in _failures.items()}


def _shape(problem: Problem) -> tuple:
    return (problem.device.type, problem.dtype, problem.B, problem.T, problem.H, problem.D)


def cpu_torch_known_good() -> bool:
    """Whether this torch is at least :data:`CPU_TORCH` (its CPU lowering is known to compile every shape)."""
    from torch.torch_version import TorchVersion
    return TorchVersion(torch.__version__.split("+")[0]) >= CPU_TORCH


def amx_usable() -> bool:
    """Whether this CPU has AMX tiles and nothing caps torch below them: ``ONEDNN_MAX_CPU_ISA``
    set below an AMX level, or ``ATEN_CPU_CAPABILITY`` set below ``avx512``."""
    probe = getattr(getattr(torch, "cpu", None), "_is_amx_tile_supported", None)
    try:
        if probe is None or not probe():
            return False
    except RuntimeError:
        return False
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if isa and isa not in ("ALL", "DEFAULT") and "AMX" not in isa:
        return False
    aten = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    return aten in ("", "avx512", "amx")


def automatic(device_type: str) -> bool:
    """Whether the automatic choice may take ``flex`` on ``device_type`` (it is listed ahead of
    ``sdpa`` there): CPUs with usable AMX and torch :data:`CPU_TORCH` or later (or
    ``SOLATTN_FLEX_CPU=1``; ``=0`` never), XPUs opted in with ``SOLATTN_FLEX_XPU=1``. Elsewhere it
    runs only when asked for by name (then on any torch with flex_attention)."""
    if device_type == "cpu":
        switch = os.environ.get(CPU_SWITCH, "").strip()
        if switch in ("0", "1"):
            return switch == "1"
        if switch:
            raise ValueError(f"environment variable {CPU_SWITCH} received {switch!r}; allowed: unset, "
                             f"'1' (flex first on the CPU) or '0' (never chosen automatically)")
        return amx_usable() and cpu_torch_known_good()
    if device_type == "xpu":
        return os.environ.get(XPU_OPT_IN, "0") == "1"
    return False


def _flex_importable() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def _compile_reasons(device: torch.device) -> List[str]:
    """Why ``torch.compile`` cannot build flex_attention's kernel for ``device`` (cheap checks)."""
    try:
        import torch._dynamo
        if not torch._dynamo.is_dynamo_supported():
            return [f"torch.compile is not supported on this Python / platform (torch {torch.__version__})"]
    except Exception as err:  # noqa: BLE001 - any failure here means torch.compile cannot run
        return [f"torch.compile is unavailable: {type(err).__name__}: {err}"]
    if device.type == "cpu":
        avx2 = getattr(torch.cpu, "_is_avx2_supported", lambda: True)()
        if not avx2 or os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower() == "default":
            return ["torch.compile's CPU flex_attention needs AVX2 (absent, or ATEN_CPU_CAPABILITY=default)"]
        if not _cpp_compiler():
            return ["no C++ compiler found for torch.compile's CPU code (install g++/clang, or MSVC on "
                    "Windows and run from its developer prompt)"]
    elif device.type in ("cuda", "xpu"):
        import importlib.util
        if importlib.util.find_spec("triton") is None:
            return [f"torch.compile's {device.type} flex_attention needs Triton (pip install triton"
                    + ("-xpu" if device.type == "xpu" else "") + ")"]
    return []


@functools.lru_cache(maxsize=1)
def _cpp_compiler() -> bool:
    """A C++ compiler torch.compile's CPU code can use is on this machine (looked up once: the
    automatic choice asks on every call where flex comes first)."""
    try:
        from torch._inductor import config
        cxx = config.cpp.cxx
        names = [c for c in (cxx if isinstance(cxx, (tuple, list)) else (cxx,)) if c]
    except Exception:  # noqa: BLE001 - no inductor config: look for the usual names
        names = []
    names += [os.environ.get("CXX", ""), "g++", "clang++", "c++", "cl"]
    return any(n and shutil.which(n) for n in names)


class FlexBackend(Backend):
    name = "flex"
    description = ("compiled FlexAttention with the plan as its BlockMask (gather free); the first call of "
                   "each shape compiles (15-90 s on a CPU); chosen automatically on CPUs with AMX (torch 2.11+) "
                   "for shapes compiled in the process (solattn.warm_up) and on XPU with SOLATTN_FLEX_XPU=1")
    devices = frozenset({"cpu", "cuda", "xpu"})
    #: forward only: torch 2.13's CPU flex_attention lowering is inference-only, so gradients of a
    #: call that ran here come from recomputing it on the device's first differentiable backend
    features = ALL_FEATURES - {"autograd"}

    def automatic(self, device_type: str) -> bool:
        """Whether the automatic choice may take this backend on ``device_type`` (:func:`automatic`)."""
        return automatic(device_type)

    def device_reasons(self, device: torch.device) -> List[str]:
        if not _flex_importable():
            return [f"torch {torch.__version__} has no torch.nn.attention.flex_attention (needs torch 2.5+)"]
        if device.type == "xpu" and os.environ.get(XPU_OPT_IN, "0") != "1":
            return [f"not yet run on real Intel hardware, so xpu needs an explicit opt-in: set {XPU_OPT_IN}=1"]
        return _compile_reasons(device)

    def problem_reasons(self, problem: Problem) -> List[str]:
        need, budget = working_bytes(problem), current_budget()
        if need > budget:
            return [f"needs about {need / 2**20:.0f} MiB of working memory (its BlockMask's lists grow as "
                    f"B*H*n^2), over the memory budget of {budget / 2**20:.0f} MiB (solattn.memory_budget)"]
        return []

    def automatic_reasons(self, problem: Problem) -> List[str]:
        """Why the automatic choice passes flex over for ``problem`` although it could run it: a
        compile that failed for the shape earlier; on the CPU, a shape not compiled yet."""
        failed = _failures.get(_shape(problem))
        if failed:
            return [f"its compile failed for this shape earlier ({failed}); not retried automatically "
                    "(backend='flex' or solattn.warm_up tries again)"]
        if (problem.device.type == "cpu" and os.environ.get(CPU_SWITCH, "").strip() != "1"
                and not is_compiled(call_key(problem))):
            return ["not compiled for this shape yet (a CPU compile takes 15-90 s): the automatic choice "
                    "takes flex for shapes compiled in this process (solattn.warm_up) or, with "
                    f"{CPU_SWITCH}=1, for every shape"]
        return []

    def automatic_notes(self, device) -> List[str]:
        """What :meth:`automatic_reasons` holds for every call on ``device``, for ``list_backends``."""
        kind = torch.device(device).type
        if not automatic(kind):
            return [f"not in the automatic choice on this {kind} (CPUs with AMX and torch {CPU_TORCH}+ or "
                    f"{CPU_SWITCH}=1; XPU with {XPU_OPT_IN}=1): runs when asked for by name"]
        notes = [f"compile failed for {shape} (automatic choice passes it over): {why}"
                 for shape, why in failures().items() if shape.split()[0] == kind]
        if kind == "cpu" and os.environ.get(CPU_SWITCH, "").strip() != "1":
            notes.append("chosen automatically only for shapes compiled in this process (solattn.warm_up); "
                         f"{CPU_SWITCH}=1 takes it for every shape (compiling 15-90 s per new shape)")
        return notes

    def forward(self, problem: Problem, plan=None) -> torch.Tensor:
        if plan is None:
            raise ValueError("flex backend: forward needs the routing plan (solattn.routing.build_plan(problem))")
        key = call_key(problem)
        if is_compiled(key):
            return flex_forward(problem, plan)
        log.warning("solattn: compiling the flex kernel for %s (first call of this shape; 15-90 s on a CPU, "
                    "seconds on a GPU; torch caches it under %s for later processes; solattn.warm_up compiles "
                    "ahead, backend='sdpa' or %s=0 avoids it)", problem.describe(), compile_cache_dir(), CPU_SWITCH)
        start = time.perf_counter()
        try:
            out = flex_forward(problem, plan)
        except Exception as err:  # noqa: BLE001 - the op layer decides: raise (by name) or fall back
            return self._decline(problem, err)
        mark_compiled(key)
        with _failures_lock:
            _failures.pop(_shape(problem), None)
        log.warning("solattn: flex kernel compiled in %.1f s", time.perf_counter() - start)
        return out

    def _decline(self, problem: Problem, err: Exception) -> torch.Tensor:
        """Record why compiling failed for this shape (the automatic choice passes flex over for
        it) and decline the call: the op layer raises it when flex was asked for by name, else
        runs the call on the next backend."""
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        why = f"{type(err).__name__}: {first[:300]} (at {problem.describe()})"
        with _failures_lock:
            _failures[_shape(problem)] = why
        forget(call_key(problem))
        raise Declined(f"the flex backend could not compile this call ({why})") from err
