"""Fixtures shared by test modules."""

from __future__ import annotations

import pytest


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
