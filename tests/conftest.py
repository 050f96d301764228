"""Fixtures shared by test modules, and the test run's environment.

Markers (declared in pyproject.toml) are written in the test files: ``slow`` tests are left out of
the default run (``python -m pytest -q -m slow`` runs them, ``-m ""`` runs everything); a module
marks itself (``pytestmark = pytest.mark.slow``), a test with ``@pytest.mark.slow``, and the slow part
of a parametrized family with ``pytest.param(..., marks=pytest.mark.slow)`` (a case that took a second
of CPU time or more on a 2-core CPU, the Triton kernel in the CPU interpreter, the flex backend's
compiles), so that every family keeps a representative in the default run. ``gpu`` marks the tests
and parameters that run on a GPU (``tests.support.marks.gpu_marked`` for device lists), so
``-m gpu`` runs a GPU machine's own cases.

The automatic CPU choice depends on the machine (the ``flex`` backend comes first on CPUs with
AMX, for shapes compiled in the process): the test process sets ``SOLATTN_FLEX_CPU=0`` when
this file is imported, before any fixture (a module-scoped one starting worker processes
included) and every test again (:func:`cpu_priority_without_flex`), so the CPU priority is
``sdpa > reference`` on any CPU, in this process and in the processes its tests start. The
tests about the automatic CPU choice force it both ways themselves (AMX present or not,
tests/backends/flex/test_flex.py::test_automatic_cpu_choice_both_ways), so an AMX CPU and one without
run the same cases.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

# torch.compile's on-disk cache (shared by every checkout of one user) can return a graph compiled
# against another version of solattn's custom ops, whose fake outputs then disagree with the real
# ones; each test run compiles against this checkout's code in a cache of its own
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _INDUCTOR_CACHE = tempfile.mkdtemp(prefix="solattn-tests-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_CACHE
    atexit.register(shutil.rmtree, _INDUCTOR_CACHE, ignore_errors=True)

os.environ["SOLATTN_FLEX_CPU"] = "0"


@pytest.fixture(autouse=True)
def cpu_priority_without_flex(monkeypatch):
    """The automatic CPU choice independent of the CPU's AMX: flex only when asked for by name."""
    monkeypatch.setenv("SOLATTN_FLEX_CPU", "0")


@pytest.fixture
def vsa_plan_marks(monkeypatch):
    """The ``dead_rows_zero`` mark of every problem ``video_sparse_attn`` builds a VSA plan for,
    in call order (a spy on ``solattn.op.route.build_vsa_plan``)."""
    import solattn.op.route as route
    marks = []
    real = route.build_vsa_plan

    def spy(problem, *args, **kwargs):
        marks.append(problem.dead_rows_zero)
        return real(problem, *args, **kwargs)

    monkeypatch.setattr(route, "build_vsa_plan", spy)
    return marks
