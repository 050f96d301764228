"""Fixtures and markers shared by test modules.

Markers (declared in pyproject.toml): ``slow`` tests are left out of the default run
(``python -m pytest -q -m slow`` runs them, ``-m ""`` runs everything). A test is slow when
its module marks it so, when its id is listed in ``slow_tests.txt`` (the cases that took a
second of CPU time or more, measured on a 2-core CPU), or when it matches :data:`SLOW` (the
Triton kernel in the CPU interpreter, the flex backend's compiles); :data:`_KEEP` keeps one
representative of each family in the default run, so every path is still exercised there.
``gpu`` is given here to every test that runs on a GPU (a ``cuda``/``xpu``/``mps`` device
parameter, or a skip condition that asks for one), so ``-m gpu`` runs a GPU machine's own cases.

The automatic CPU choice depends on the machine (the ``flex`` backend comes first on CPUs with
AMX, for shapes compiled in the process): the test process sets ``SOLATTN_FLEX_CPU=0`` when
this file is imported, before any fixture (a module-scoped one starting worker processes
included) and every test again (:func:`cpu_priority_without_flex`), so the CPU priority is
``sdpa > reference`` on any CPU, in this process and in the processes its tests start. The
tests about the automatic CPU choice force it both ways themselves (AMX present or not,
tests/backends/flex/test_flex.py::test_automatic_cpu_choice_both_ways), so an AMX CPU and one without run the
same cases.
"""

from __future__ import annotations

import atexit
import fnmatch
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

os.environ["SOLATTN_FLEX_CPU"] = "0"

from solattn.devices import accelerator_types  # noqa: E402 (after the environment is set)

#: the accelerators of solattn's device table (cuda, xpu, mps), and a skip reason that names one
_GPU_TYPES = tuple(accelerator_types())
_GPU_REASON = re.compile(r"\b(" + "|".join(["GPU", *(t.upper() for t in _GPU_TYPES)]) + r")\b")


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


#: test ids left out of the default run: those listed in slow_tests.txt (measured), and the
#: patterns below for the families measured as a whole (the Triton kernel in the CPU
#: interpreter, the flex backend's compiles); _KEEP names the representative each family keeps
#: in the default run
_LISTED = frozenset(line.split("#")[0].strip() for line in
                    open(os.path.join(os.path.dirname(__file__), "slow_tests.txt"), encoding="utf-8")
                    if line.split("#")[0].strip())
SLOW = (
    "tests/backends/triton/test_triton_backward.py::*cpu*",
    "tests/backends/triton/test_triton_backend.py::test_*",
    "tests/backends/triton/test_fused_plan.py::test_*",
    "tests/backends/test_backends.py::*triton-cpu-interpreted*",
    "tests/op/test_video.py::*-triton*",
    "tests/op/test_video.py::*[[]triton]",
    "tests/op/test_video.py::*-flex*",
    "tests/op/test_video.py::*[[]flex]",
    "tests/test_finetune_example.py::*",
)
_KEEP = frozenset({
    "tests/backends/test_backends.py::test_backend_matches_reference[triton-cpu-interpreted-bfloat16-everything]",
    "tests/op/test_video.py::test_matches_oracle[(4, 8, 8)-B1-P(70, 5, 64)-exempt-tensor-triton-bfloat16]",
    "tests/op/test_video.py::test_matches_oracle[(4, 8, 8)-B1-P(70, 5, 64)-exempt-tensor-flex-bfloat16]",
    "tests/backends/triton/test_triton_backward.py::test_sol_attn_fused_gradients_match_reference[topk-notail-gate-bias-bf16-cpu]",
    "tests/backends/triton/test_triton_backend.py::test_modes_and_tail[False-topk]",
    "tests/backends/triton/test_triton_backend.py::test_kernel_config_accepts_what_ships",
    "tests/backends/triton/test_triton_backend.py::test_launch_refuses_configs_that_do_not_ship",
    "tests/backends/triton/test_triton_backend.py::test_interpreter_run_leaves_triton_unpatched",
    "tests/backends/triton/test_triton_backend.py::test_reasons",
    "tests/backends/triton/test_triton_backend.py::test_gpu_launches_ask_for_fused_multiply_adds",
    "tests/backends/triton/test_fused_plan.py::test_modes_tail_coarse[topk-False]",
    "tests/backends/triton/test_fused_plan.py::test_vsa_plan_matches_torch_plan[(70,)-True-exempt]",
    "tests/backends/triton/test_fused_plan.py::test_dot_precision_follows_the_device",
    "tests/backends/triton/test_fused_plan.py::test_not_used_with_autograd_or_off_the_interpreter",
})


def _is_slow(nodeid: str) -> bool:
    if nodeid in _KEEP:
        return False
    if nodeid.startswith("tests/backends/triton/test_triton_backend.py::test_kernel_config"):
        return False                                  # argument checks: no kernel runs
    return nodeid in _LISTED or any(fnmatch.fnmatchcase(nodeid, pattern) for pattern in SLOW)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _runs_on_gpu(item) and item.get_closest_marker("gpu") is None:
            item.add_marker(pytest.mark.gpu)
        if item.get_closest_marker("slow") is None and (_compiles_flex(item) or _is_slow(item.nodeid)):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def cpu_priority_without_flex(monkeypatch):
    """The automatic CPU choice independent of the CPU's AMX: flex only when asked for by name."""
    monkeypatch.setenv("SOLATTN_FLEX_CPU", "0")


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
