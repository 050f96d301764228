"""Backends: each one file (or folder), independent of the others.

``import solattn`` registers the built-in backends with the dispatcher (solattn/__init__.py).
"""

from .base import Backend
from .reference import ReferenceBackend

__all__ = ["Backend", "ReferenceBackend"]
