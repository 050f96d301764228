"""Synthetic inputs with block structure, shared by ``check``, ``bench`` and the tests.

Random tokens alone give routing scores that all sit near each other, so a selection would
hinge on rounding. Adding a random offset per 64-token block spreads the block means, as real
attention inputs do, and makes the selection unambiguous at every dtype.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch

from .validation import BLOCK


def block_structured_qkv(B: int, T: int, H: int, D: int, dtype: torch.dtype = torch.float32,
                         device="cpu", seed: int = 0, spread: float = 2.0, key_offset: float = 0.0,
                         normalise: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v ``(B, T, H, D)``: ``0.5 * randn`` per token plus ``spread * randn`` per 64-token
    block; k also gets ``key_offset * randn`` per head (a common key offset, which dense attention
    and SPEC.md's centring both ignore). ``normalise`` multiplies by ``D ** -0.25`` so logits keep
    their size across head dims. Drawn on the CPU from a seeded generator, then moved."""
    n = math.ceil(T / BLOCK)
    g = torch.Generator().manual_seed(seed)
    out = []
    for which in range(3):
        x = torch.randn(B, T, H, D, generator=g).mul_(0.5)
        x.add_(torch.randn(B, n, H, D, generator=g).mul_(spread).repeat_interleave(BLOCK, dim=1)[:, :T])
        if which == 1 and key_offset:
            x.add_(torch.randn(1, 1, H, D, generator=g).mul_(key_offset))
        if normalise:
            x.mul_(D ** -0.25)
        out.append(x.to(dtype=dtype, device=device))
    return tuple(out)
