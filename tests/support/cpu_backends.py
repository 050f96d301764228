"""Running a named backend on the CPU in a test: its context and dtype, or a skip saying why not."""

from __future__ import annotations

import contextlib

import pytest
import torch

import solattn
from solattn import testing


def cpu_context(name: str, dtype: torch.dtype = torch.float32):
    """``(context, dtype)`` to run backend ``name`` on the CPU: the Triton backend inside its
    interpreter, in fp16 (what its kernel takes); any other in ``dtype``. Skips the test where the
    backend cannot run here."""
    if name == "triton":
        if not testing.triton_interpretable():
            pytest.skip("Triton's interpreter cannot run the kernel here")
        return testing.interpreter(), torch.float16
    reasons = solattn.dispatch.get_backend(name).availability_reasons("cpu")
    if reasons:
        pytest.skip(f"{name}: {reasons}")
    return contextlib.nullcontext(), dtype
