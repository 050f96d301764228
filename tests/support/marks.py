"""Marks written where the cases are made: ``gpu`` on the parameters that run on an accelerator
(``-m gpu`` runs a GPU machine's own cases). ``slow`` is written as ``pytest.mark.slow`` on the test,
``pytestmark`` on the module, or ``pytest.param(..., marks=pytest.mark.slow)`` on the slow part of a
parametrized family."""

from __future__ import annotations

import pytest
import torch

from solattn.devices import accelerator_types

#: the accelerators of solattn's device table (cuda, xpu, mps)
GPU_TYPES = tuple(accelerator_types())


def on_gpu(device) -> bool:
    """``device`` (a ``torch.device`` or its name, ``"cuda:1"`` included) is an accelerator."""
    if isinstance(device, torch.device):
        return device.type in GPU_TYPES
    return isinstance(device, str) and device.split(":")[0] in GPU_TYPES


def gpu_marked(values, cpu_slow: bool = False):
    """``values`` (devices) as parameters, the accelerator ones marked ``gpu``; with ``cpu_slow``
    the others marked ``slow`` (a case that takes seconds on a CPU, as the Triton kernel in the
    interpreter, and runs in the default run of a GPU machine)."""
    return [pytest.param(v, marks=pytest.mark.gpu) if on_gpu(v)
            else pytest.param(v, marks=pytest.mark.slow) if cpu_slow else v for v in values]
