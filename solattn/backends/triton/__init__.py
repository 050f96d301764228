"""``triton`` backend: a fused block-index forward kernel (``kernel.py``) and its launcher (``backend.py``).

Importing this package does not import Triton; the kernel is compiled on first use.
"""

from .backend import TritonBackend, launch
from .tuning import DEFAULT_CONFIGS, BackwardConfig, KernelConfig, TritonTuning

__all__ = ["TritonBackend", "TritonTuning", "KernelConfig", "BackwardConfig", "DEFAULT_CONFIGS", "launch"]
