"""solattn: Sol-Attn and VSA block-sparse attention on every PyTorch device.

    >>> import torch, solattn
    >>> q = k = v = torch.randn(1, 256, 2, 64)
    >>> solattn.sol_attn(q, k, v, topk_ratio=0.25).shape
    torch.Size([1, 256, 2, 64])

The names below are the public surface; internals (the routing plan, validation, the
dispatcher, the built-in backend classes) stay reachable from their modules, e.g.
``solattn.routing.build_plan`` or ``solattn.backends.sdpa.SdpaBackend``.
"""

from . import dispatch as _dispatch
from .backends.base import Backend
from .backends.reference import ReferenceBackend as _ReferenceBackend
from .backends.flex import FlexBackend as _FlexBackend
from .backends.sdpa import SdpaBackend as _SdpaBackend
from .budget import memory_budget, set_memory_budget
from .devices import best_device
from .dispatch import BackendError, list_backends, use_backend
from .dispatch import register as register_backend
from .graphs import cuda_graphs
from .op import plan, sol_attn, video_plan, video_sparse_attn
from .tiling import tile, untile
from .validation import BLOCK
from .warmup import warm_up

_dispatch.register(_ReferenceBackend())
try:  # the triton backend imports Triton lazily; it reports a missing Triton as a reason
    from .backends.triton import TritonBackend as _TritonBackend
except ImportError:  # pragma: no cover - only if the package itself is broken
    pass
else:
    _dispatch.register(_TritonBackend())
_dispatch.register(_SdpaBackend())
_dispatch.register(_FlexBackend())

__version__ = "0.1.0"

__all__ = ["sol_attn", "video_sparse_attn", "plan", "video_plan", "tile", "untile", "list_backends", "use_backend",
           "best_device", "BackendError", "memory_budget", "set_memory_budget", "register_backend",
           "Backend", "BLOCK", "cuda_graphs", "warm_up", "__version__"]
