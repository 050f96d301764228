"""Backends: each one file (or folder), independent of the others.

Importing this package registers the built-in backends with the dispatcher.
"""

from .base import Backend
from .reference import ReferenceBackend

__all__ = ["Backend", "ReferenceBackend"]
