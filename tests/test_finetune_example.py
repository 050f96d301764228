"""examples/finetune_vsa.py trains through video_sparse_attn: the loss falls."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from solattn.testing import interpreter, triton_interpretable

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "finetune_vsa.py"


def _example():
    spec = importlib.util.spec_from_file_location("finetune_vsa", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_finetune_example_loss_falls_on_cpu():
    losses = _example().main(["--device", "cpu", "--grid", "4", "4", "8", "--heads", "2", "--dim", "16",
                              "--steps", "15"])
    assert len(losses) == 15 and all(x == x for x in losses)
    assert losses[-1] < 0.3 * losses[0], losses


@pytest.mark.skipif(not triton_interpretable(), reason="needs Triton >= 3.9 for its CPU interpreter")
def test_finetune_example_through_the_fused_triton_backward():
    """The same training loop with the triton backend (kernels in the interpreter), so every step's
    gradients come from the fused backward."""
    import solattn.backends.triton.backward as bw
    calls = []
    real = bw.fused_backward

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    bw.fused_backward = spy
    try:
        with interpreter():
            losses = _example().main(["--device", "cpu", "--backend", "triton", "--grid", "4", "8", "8",
                                      "--heads", "2", "--dim", "16", "--steps", "6", "--lr", "1e-2"])
    finally:
        bw.fused_backward = real
    assert len(calls) == 6
    assert losses[-1] < 0.6 * losses[0], losses
