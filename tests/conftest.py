"""Fixtures shared by test modules."""

from __future__ import annotations

import pytest


@pytest.fixture
def vsa_plan_marks(monkeypatch):
    """The ``dead_rows_zero`` mark of every problem ``video_sparse_attn`` builds a VSA plan for,
    in call order (a spy on ``solattn.video.build_vsa_plan``)."""
    import solattn.video
    marks = []
    real = solattn.video.build_vsa_plan

    def spy(problem, *args, **kwargs):
        marks.append(problem.dead_rows_zero)
        return real(problem, *args, **kwargs)

    monkeypatch.setattr(solattn.video, "build_vsa_plan", spy)
    return marks


def pytest_configure(config):
    # on a GPU every cache hit of the launch cache is checked against the compiled kernel Triton
    # itself would run (solattn.backends.triton.launcher.CHECK): the whole suite exercises its key
    import importlib.util
    import torch
    if torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
        from solattn.backends.triton import launcher as launch
        launch.CHECK = True
