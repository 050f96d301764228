"""The host side of a call on the ``triton`` backend: what is made once and shared (tuning
defaults, launch configs, device capabilities, the fused plan's zero centroid). Each cache is
checked against a freshly built value and keyed by what it depends on."""

from __future__ import annotations

import pytest
import torch

from solattn import config, kernels
from solattn.backends.triton import KernelConfig, TritonTuning
from solattn.backends.triton.operands import _as
from solattn.routing import fused


def test_default_tuning_is_made_once_and_equals_a_fresh_one():
    for kind in (TritonTuning, fused.FusedPlanTuning):
        config.reset_tuning(kind)
        first = config.current_tuning(kind)
        assert first == kind() and config.current_tuning(kind) is first
        chosen = kind(**({"tma_min_programs": 7} if kind is TritonTuning else {"block_i": 8}))
        with config.tuning(chosen):
            assert config.current_tuning(kind) is chosen           # scoped and process-wide values win
        config.set_tuning(chosen)
        try:
            assert config.current_tuning(kind) is chosen
        finally:
            config.reset_tuning(kind)
        assert config.current_tuning(kind) is first


def test_pointer_load_config_is_shared_and_equals_a_fresh_one():
    t = TritonTuning()
    small = t.forward_config(programs=8, recording=False, head_dim=64)
    assert small == KernelConfig(4, 3, tma=False) and t.forward_config(8, False, 64) is small
    assert t.forward_config(1 << 20, False, 64).tma and t.forward_config(8, True, 64).tma
    assert t.forward_config(8, False, 48) == KernelConfig(tma=False)          # no default for D=48


def test_cuda_capability_is_asked_once_per_device_and_query(monkeypatch):
    asked = []

    def query(device=None):
        asked.append(device)
        return (9, 0) if device.index == 0 else (8, 6)

    monkeypatch.setattr(torch.cuda, "get_device_capability", query)
    for _ in range(3):
        assert kernels.cuda_capability(torch.device("cuda", 0)) == (9, 0)
        assert kernels.cuda_capability(torch.device("cuda", 1)) == (8, 6)
    assert [d.index for d in asked] == [0, 1]
    assert kernels.cuda_capability(torch.device("cuda")) == (8, 6)          # no index: asked each time
    assert len(asked) == 3
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert kernels.cuda_capability(torch.device("cuda", 0)) == (7, 5)       # another query: asked afresh


def test_shared_zero_centroid_is_zeros_per_shape_and_device():
    a = fused._zeros(3, 16, torch.device("cpu"))
    assert torch.equal(a, torch.zeros(3, 16)) and a.dtype == torch.float32
    assert fused._zeros(3, 16, torch.device("cpu")) is a
    b = fused._zeros(4, 16, torch.device("cpu"))
    assert b is not a and b.shape == (4, 16) and torch.equal(b, torch.zeros(4, 16))


def test_kernel_operand_conversion_copies_only_what_it_must():
    t = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    assert _as(t, torch.int32) is t
    assert _as(t.t(), torch.int32).is_contiguous() and torch.equal(_as(t.t(), torch.int32), t.t())
    f = torch.ones(3, requires_grad=True)
    g = _as(f, torch.float32)
    assert not g.requires_grad and torch.equal(g, f.detach())
    assert _as(t, torch.int64).dtype == torch.int64
