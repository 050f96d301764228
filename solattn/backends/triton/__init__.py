"""``triton`` backend: a fused block-index forward kernel (``kernel.py``) and its launcher (``backend.py``).

Importing this package does not import Triton; the kernel is compiled on first use.
"""

from .backend import DEFAULT_CONFIGS, KernelConfig, TritonBackend, launch

__all__ = ["TritonBackend", "KernelConfig", "DEFAULT_CONFIGS", "launch"]
