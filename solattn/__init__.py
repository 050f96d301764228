"""solattn: Sol-Attn and VSA block-sparse attention on every PyTorch device.

    >>> import torch, solattn
    >>> q = k = v = torch.randn(1, 256, 2, 64)
    >>> solattn.sol_attn(q, k, v, topk_ratio=0.25).shape
    torch.Size([1, 256, 2, 64])
"""

import os as _os

from . import dispatch
from .budget import memory_budget, set_memory_budget
from .backends.reference import ReferenceBackend
from .backends.sdpa import SdpaBackend
from .dispatch import BackendError, backends, best_device, use_backend
from .ops import sol_attn
from .routing import Plan, build_plan
from .validation import BLOCK, Problem, validate
from .video import tile, untile, video_sparse_attn

dispatch.register(ReferenceBackend())
try:  # the triton backend imports Triton lazily; it reports "triton not installed" as a reason
    from .backends.triton import TritonBackend
except ImportError:  # pragma: no cover - only if the package itself is broken
    TritonBackend = None
else:
    dispatch.register(TritonBackend())
dispatch.register(SdpaBackend())

__version__ = "0.1.0"

__all__ = ["sol_attn", "backends", "use_backend", "best_device", "BackendError", "Plan",
           "build_plan", "Problem", "validate", "BLOCK", "__version__",
           "tile", "untile", "video_sparse_attn", "memory_budget", "set_memory_budget"]

if _os.environ.get("SOLATTN_COMFY_KITCHEN", "").strip():  # opt-in comfy-kitchen plug-in (docs/comfyui.md)
    from .integrations.comfy_kitchen import install_from_env as _install_from_env
    _install_from_env()
