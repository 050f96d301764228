"""Fixtures and markers shared by test modules.

Markers (declared in pyproject.toml): ``slow`` tests are left out of the default run
(``python -m pytest -q -m slow`` runs them, ``-m ""`` runs everything); ``gpu`` is given here
to every test that runs on a GPU (a ``cuda``/``xpu``/``mps`` device parameter, or a skip
condition that asks for one), so ``-m gpu`` runs a GPU machine's own cases.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile

import pytest
import torch

# torch.compile's on-disk cache (shared by every checkout of one user) can return a graph compiled
# against another version of solattn's custom ops, whose fake outputs then disagree with the real
# ones; each test run compiles against this checkout's code in a cache of its own
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _INDUCTOR_CACHE = tempfile.mkdtemp(prefix="solattn-tests-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_CACHE
    atexit.register(shutil.rmtree, _INDUCTOR_CACHE, ignore_errors=True)

_GPU_TYPES = ("cuda", "xpu", "mps")
_GPU_REASON = re.compile(r"\b(CUDA|GPU|XPU|MPS)\b")


def _is_gpu_device(value) -> bool:
    if isinstance(value, torch.device):
        return value.type in _GPU_TYPES
    return isinstance(value, str) and value.split(":")[0] in _GPU_TYPES


def _runs_on_gpu(item) -> bool:
    callspec = getattr(item, "callspec", None)
    if callspec is not None and any(_is_gpu_device(v) for v in callspec.params.values()):
        return True
    return any(_GPU_REASON.search(str(mark.kwargs.get("reason", ""))) for mark in item.iter_markers("skipif"))


def _compiles_flex(item) -> bool:
    """A generated backend case on the flex backend: its first call per shape compiles (tens of
    seconds on a small CPU, in each run's fresh compile cache)."""
    callspec = getattr(item, "callspec", None)
    return callspec is not None and any(getattr(v, "backend", None) == "flex" for v in callspec.params.values())


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _runs_on_gpu(item) and item.get_closest_marker("gpu") is None:
            item.add_marker(pytest.mark.gpu)
        if _compiles_flex(item) and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def vsa_plan_marks(monkeypatch):
    """The ``dead_rows_zero`` mark of every problem ``video_sparse_attn`` builds a VSA plan for,
    in call order (a spy on ``solattn.pipeline.build_vsa_plan``)."""
    import solattn.pipeline
    marks = []
    real = solattn.pipeline.build_vsa_plan

    def spy(problem, *args, **kwargs):
        marks.append(problem.dead_rows_zero)
        return real(problem, *args, **kwargs)

    monkeypatch.setattr(solattn.pipeline, "build_vsa_plan", spy)
    return marks
