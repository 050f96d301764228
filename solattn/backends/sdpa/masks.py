"""Additive SDPA masks: key bias and dead rows per key slot, the tail's per-row logit, and the
conversion that keeps every entry safe in the dtype the device's SDPA needs.

Masks are built in fp32 (differentiable in ``key_bias``) and converted last by
:func:`finish_mask`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ...devices import entry
from ...routing import Plan
from ...validation import BLOCK, Problem

#: Largest magnitude a finite mask entry keeps. Fused GPU kernels multiply logit + mask by
#: log2(e) in fp32 before exponentiating: bf16's own limit (3.39e38) times 1.44 overflows to
#: -inf there and the row reads as fully masked (all-zero output). 1e30 leaves room for that
#: factor plus any logit, and still swamps every logit (its fp32 ulp is ~7e22).
MASK_LIMIT = 1e30


def mask_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """Additive masks in fp32 where the device's SDPA is known to handle them (its entry's
    ``fp32_masks``, :mod:`solattn.devices`), else q's dtype."""
    return torch.float32 if entry(device.type).fp32_masks else dtype


def finite_limit(mdt: torch.dtype) -> float:
    """The clamp bound of finite mask entries in dtype ``mdt`` (fp16: its own max, 65504)."""
    return min(MASK_LIMIT, torch.finfo(mdt).max)


def key_slot_bias(p: Problem, plan: Plan) -> Optional[torch.Tensor]:
    """``(Bk, n, 64)`` fp32 additive bias per key slot: ``key_bias``, ``-inf`` on dead rows and
    rows past T. None when no key is ever masked. Differentiable in ``key_bias``."""
    n, T = p.n, p.T
    if p.key_bias is None and p.block_len is None and T % BLOCK == 0:
        return None
    live = torch.arange(BLOCK, device=p.device)[None, :] < plan.block_len[:, None]   # (n, 64)
    if p.key_bias is None:
        bias = torch.zeros(1, n * BLOCK, dtype=torch.float32, device=p.device)
    else:
        bias = torch.nn.functional.pad(p.key_bias.to(torch.float32), (0, n * BLOCK - T))
    return bias.view(-1, n, BLOCK).masked_fill(~live, -math.inf)


def rounded_shift(shift: torch.Tensor, mdt: torch.dtype) -> torch.Tensor:
    """``shift`` rounded to ``mdt`` (fp32; 0 where not finite, and 0 for fp32 masks, which need
    no re-centring): the constant :func:`finish_mask` subtracts from each row."""
    if mdt == torch.float32:
        return torch.zeros_like(shift)
    rounded = shift.detach().to(mdt).to(torch.float32)
    return torch.where(torch.isfinite(rounded), rounded, torch.zeros_like(rounded))


def finish_mask(mask: torch.Tensor, mdt: torch.dtype, row_shift: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The fp32 mask ``(..., keys)`` made safe for SDPA in dtype ``mdt``.

    - ``row_shift`` (``mask.shape[:-1]``, finite or -inf), when given, is rounded to ``mdt`` and
      subtracted from its row (a softmax does not change when every logit of a row moves by one
      constant). The tail's entry then becomes a small residual, held precisely in bf16, and an
      unbiased exact key's entry ``-round(shift)`` is exactly representable.
    - Finite entries are clamped to ``±finite_limit(mdt)``: a huge finite bias (fp32 ``finfo.min``)
      stays a finite term instead of becoming ``-inf`` (which zeroes a row SPEC.md says has
      finite terms). ``-inf`` stays ``-inf``. The clamp passes gradients of in-range entries.
    """
    if row_shift is not None and mdt != torch.float32:
        mask = mask - rounded_shift(row_shift, mdt)[..., None]
    big = finite_limit(mdt)
    return torch.where(torch.isneginf(mask), mask, mask.clamp(-big, big)).to(mdt)


#: Largest spread ``max_t |r_t - mean_r|`` of the tail's per-row residual over a query block's
#: live rows for which the block's tail logit takes the block mean instead: below bf16's own
#: relative precision (2**-8), so it is lost next to the rounding of the exact logits.
ROW_MASK_EPS = 2.0 ** -10


def tail_residuals(p: Problem, plan: Plan, step: int):
    """The tail's rounding residual ``r_t = scale q_t . (m - round(m))`` (``round``: to the input
    dtype, as the tail's key) summarised per query block: ``(B, H, n)`` fp32 mean over the block's
    live rows (differentiable in q) and ``(B, H, n)`` bool, True where some live row lies more than
    :data:`ROW_MASK_EPS` from that mean (the block then needs one mask row per query row).
    ``step`` tokens (a multiple of 64) at a time; no host sync."""
    B, T, H, n = p.B, p.T, p.H, p.n
    dev = p.device
    m = plan.key_mean[:, :, 0]                                               # (B, H, D) fp32
    mean = torch.zeros(B, H, n, dtype=torch.float32, device=dev)
    per_row = torch.zeros(B, H, n, dtype=torch.bool, device=dev)
    if p.dtype == torch.float32:    # fp32 inputs: the key is m itself, r = 0
        return mean, per_row
    res = m - m.to(p.dtype).to(torch.float32)
    live = torch.arange(n * BLOCK, device=dev).view(n, BLOCK) < T
    if p.block_len is not None:
        live = live & (torch.arange(BLOCK, device=dev)[None, :] < plan.block_len[:, None])
    means = []
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        j0, j1 = t0 // BLOCK, (t1 + BLOCK - 1) // BLOCK
        r = p.scale * torch.einsum("bthd,bhd->bht", p.q[:, t0:t1].to(torch.float32), res)
        r = torch.nn.functional.pad(r, (0, (j1 - j0) * BLOCK - (t1 - t0))).view(B, H, j1 - j0, BLOCK)
        lv = live[j0:j1]
        r = torch.where(lv, r, torch.zeros((), device=dev))        # dead rows may hold NaN
        mu = r.sum(-1) / lv.sum(-1).clamp(min=1)
        means.append(mu)
        with torch.no_grad():
            spread = torch.where(lv, (r - mu[..., None]).abs(), torch.zeros((), device=dev)).amax(-1)
            per_row[:, :, j0:j1] = ~(spread <= ROW_MASK_EPS)         # NaN or inf: per row
    return torch.cat(means, dim=2), per_row


def all_keys_can_die(p: Problem) -> bool:
    """Whether some query row can find every exact key masked (its output is then 0, SPEC.md): only
    through ``key_bias``. Without it a key is masked only as a dead row (past ``block_len`` or T);
    every block has a live row (``L_j`` is clamped to 1..64) and every query block keeps a key
    block (``sol_attn`` forces its own, VSA keeps ``k_vid >= 1``). The chunks then skip the test
    and, off the CPU, the select on the output."""
    return p.key_bias is not None
