"""Shared test helpers: devices present, input builders with unambiguous routing, error metric."""

from __future__ import annotations


import pytest
import torch

import solattn
from solattn.synthetic import block_structured_qkv

BLOCK = 64


def available_devices():
    devs = ["cpu"]
    if torch.cuda.is_available():
        devs.append("cuda")
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        devs.append("xpu")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        devs.append("mps")
    return devs


DEVICES = available_devices()
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.isfinite(a).all(), "non-finite values in output"
    den = b.norm().item()
    return (a - b).norm().item() / (den if den > 0 else 1.0)


def make_qkv(B, T, H, D, dtype=torch.float32, device="cpu", seed=0, spread=3.0, key_offset=4.0):
    """Random q, k, v whose 64-token blocks carry distinct offsets, so block means (and hence
    routing scores) are well separated: selection is unambiguous at every dtype. The keys also
    share a per-head offset (``key_offset``), as real models' keys do: dense attention ignores
    it, SPEC.md's centring must too (a backend that rounds the centroid shows up here)."""
    return block_structured_qkv(B, T, H, D, dtype, device, seed=seed, spread=spread,
                                key_offset=key_offset, normalise=True)


def dense_sdpa(q, k, v, scale=None):
    """Plain dense attention for (B, T, H, D) inputs, fp32 math."""
    o = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2), scale=scale)
    return o.transpose(1, 2)


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(1234)


def plan_backends():
    """Registered backends that consume the routing plan and can run on the CPU here."""
    out = []
    for info in solattn.list_backends("cpu"):
        b = solattn.dispatch.get_backend(info["name"])
        if b.uses_plan and info["available"]:
            out.append(info["name"])
    return out
