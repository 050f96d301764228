"""Fixtures and markers shared by test modules.

Markers (declared in pyproject.toml): ``slow`` tests are left out of the default run
(``python -m pytest -q -m slow`` runs them, ``-m ""`` runs everything). A test is slow when
its module marks it so, or when its id matches :data:`SLOW` below: the cases that took two
seconds of CPU time or more, measured on a 2-core CPU, except one representative of each
family (kept in the default run so every path is still exercised there). ``gpu`` is given here
to every test that runs on a GPU (a ``cuda``/``xpu``/``mps`` device parameter, or a skip
condition that asks for one), so ``-m gpu`` runs a GPU machine's own cases.
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


#: test ids (fnmatch patterns) left out of the default run, with the representative each
#: family keeps in it
SLOW = (
    # the Triton kernel in the CPU interpreter; kept: [triton-cpu-interpreted-bfloat16-everything]
    "tests/test_backends.py::test_backend_matches_reference[[]triton-cpu-interpreted-*-[!e]*]",
    "tests/test_backends.py::test_backend_matches_reference[[]triton-cpu-interpreted-float16-everything]",
    "tests/test_backends.py::test_common_key_offset_keeps_bf16_precision[[]triton-cpu-interpreted]",
    # video_sparse_attn through the interpreted kernel; kept: (4, 8, 8)-B1-P(70, 5, 64)-exempt-tensor-triton
    "tests/test_video.py::test_matches_oracle[[]*-triton-*]",
    "tests/test_video.py::test_k_vid_equal_to_cube_count_is_dense[[]segments[12]-*-triton]",
    "tests/test_video.py::test_prefix_modes_differ_and_match_oracle[[]triton]",
    "tests/test_video.py::test_gradients_match_float64_oracle[[]segments0-*]",
    "tests/test_video.py::test_example_runs_and_reports_errors",
    # the float64 loop oracle at T=260; kept: the shorter lengths
    "tests/test_reference.py::test_reference_matches_plain_loop[[]260-*]",
    # process groups and torchrun; kept: the other single-process comparisons
    "tests/test_distributed.py::test_matches_single_process[[]topk]",
    "tests/test_distributed.py::test_matches_single_process[[]grad_key_bias]",
    "tests/test_distributed.py::test_matches_single_process[[]grad_sol]",
    "tests/test_distributed.py::test_example_under_torchrun",
    # a transformer against a float64 model; kept: the block-level comparisons' other cases
    "tests/test_diffusers_fasth3.py::test_transformer_equals_float64_reference_model",
    "tests/test_diffusers_fasth3.py::test_outside_the_window_dense_bit_for_bit_and_disable_restores",
    "tests/test_diffusers_fasth3.py::test_block_attention_equals_float64_definition[[]compete]",
    "tests/test_diffusers_fasth3.py::test_a_compiled_wrapper_reaches_its_module_and_enabling_twice_is_refused",
    # a fresh interpreter per case
    "tests/test_dispatch.py::test_backends_subpackage_and_listing_function_coexist",
    "tests/test_dispatch.py::test_real_backward_in_a_thread_leaves_other_threads_forced_backend_alone",
    "tests/test_dispatch.py::test_use_backend_reaches_compiled_calls_at_run_time",
    "tests/test_bench_vsa.py::test_cpu_run_times_dense_and_solattn_forward_and_backward",
)
_KEEP = ("tests/test_video.py::test_matches_oracle[(4, 8, 8)-B1-P(70, 5, 64)-exempt-tensor-triton-bfloat16]",)


def _is_slow(nodeid: str) -> bool:
    return nodeid not in _KEEP and any(fnmatch.fnmatchcase(nodeid, pattern) for pattern in SLOW)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _runs_on_gpu(item) and item.get_closest_marker("gpu") is None:
            item.add_marker(pytest.mark.gpu)
        if item.get_closest_marker("slow") is None and (_compiles_flex(item) or _is_slow(item.nodeid)):
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
