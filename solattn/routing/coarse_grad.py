"""The coarse branch's gradient at block granularity, from the forward's pooled terms.

The coarse term of query block i is ``coarse_i = sum_j a_ij vm_j`` with
``a_i = softmax_j(scale qm_i . km_j)`` (:func:`.plan.coarse_rows`). Given its gradient
``dcoarse_i`` (``sum_t gate_t dO_t`` over the block's live rows), the block means get

    dvm_j = sum_i a_ij dcoarse_i
    ds_ij = a_ij (dcoarse_i . vm_j - dcoarse_i . coarse_i)      (softmax backward)
    dqm_i = scale sum_j ds_ij km_j,     dkm_j = scale sum_i ds_ij qm_i

and a live row t of block i gets ``dqm_i / L_i`` (as its key and value rows get ``dkm_j / L_j``,
``dvm_j / L_j``): a mean spreads its gradient evenly. A few batched matrix products per chunk
of query-block rows, chunked as the plan is (:func:`.plan.plan_chunks`), so that the ``(rows,
n)`` temporaries stay within the ``sdpa`` memory budget; no autograd graph, no selection.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..budget import current_budget
from ..validation import BLOCK
from .plan import plan_chunks
from .stats import live_token_mask

Tensor = torch.Tensor


@torch.no_grad()
def coarse_block_grads(qm: Tensor, km: Tensor, vm: Tensor, dcoarse: Tensor, scale: float,
                       nbytes: Optional[int] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """``(dqm, dkm, dvm)``, fp32 ``(B, H, n, D)``: the gradients of the block means ``qm``, ``km``,
    ``vm`` (fp32 ``(B, H, n, D)``) through the coarse term, given its gradient ``dcoarse``
    (``(B, H, n, D)``); all may be ``(B * H, n, D)`` instead, the results then too. ``nbytes``
    bounds one chunk's temporaries (default: the ``sdpa`` memory budget in force). Batched
    products (``torch.bmm``, no broadcasting reshapes); a problem that fits one chunk is computed
    without staging buffers."""
    *lead, n, D = qm.shape
    G = qm.numel() // (n * D)
    qm, km, vm, dco = ((x if x.dim() == 3 else x.reshape(G, n, D)).to(torch.float32) for x in (qm, km, vm, dcoarse))
    nbytes = current_budget("sdpa") if nbytes is None else nbytes
    chunks = list(plan_chunks(G, n, nbytes))
    if len(chunks) == 1:
        a, ds = _softmax_grads(qm, km, vm, dco, scale)
        dqm = torch.bmm(ds, km).mul_(scale)
        dkm = torch.bmm(ds.transpose(-1, -2), qm).mul_(scale)
        dvm = torch.bmm(a.transpose(-1, -2), dco)
    else:
        dqm = torch.empty_like(qm)
        dkm = torch.zeros_like(km)
        dvm = torch.zeros_like(vm)
        for g0, g1, i0, i1 in chunks:
            rows = dco[g0:g1, i0:i1]
            a, ds = _softmax_grads(qm[g0:g1, i0:i1], km[g0:g1], vm[g0:g1], rows, scale)
            dqm[g0:g1, i0:i1] = torch.bmm(ds, km[g0:g1]).mul_(scale)
            dkm[g0:g1].add_(torch.bmm(ds.transpose(-1, -2), qm[g0:g1, i0:i1]), alpha=scale)
            dvm[g0:g1].add_(torch.bmm(a.transpose(-1, -2), rows))
    return (dqm, dkm, dvm) if len(lead) == 1 else tuple(x.view(*lead, n, D) for x in (dqm, dkm, dvm))


def _softmax_grads(qm: Tensor, km: Tensor, vm: Tensor, dco: Tensor, scale: float) -> Tuple[Tensor, Tensor]:
    """One chunk's softmax weights ``a`` ``(g, r, n)`` and logit gradients ``ds`` (query-block rows
    ``qm``, ``dco`` ``(g, r, D)`` against all blocks ``km``, ``vm`` ``(g, n, D)``)."""
    a = torch.softmax(torch.bmm(qm, km.transpose(-1, -2)).mul_(scale), dim=-1)
    ds = torch.bmm(dco, vm.transpose(-1, -2))                          # d a_ij = dcoarse_i . vm_j
    ds.sub_((a * ds).sum(dim=-1, keepdim=True)).mul_(a)               # softmax backward
    return a, ds


def per_row(block_grad: Tensor, L: Tensor) -> Tensor:
    """A block mean's gradient ``(B, H, n, D)`` as the gradient of each of its live rows:
    divided by the live length ``L`` ``(n,)``, fp32 contiguous."""
    return per_rows((block_grad,), L)[0]


def per_rows(block_grads, L: Tensor) -> Tuple[Tensor, ...]:
    """:func:`per_row` of each of ``block_grads`` (the lengths converted once)."""
    lengths = L.to(torch.float32)[:, None]
    return tuple((g / lengths).contiguous() for g in block_grads)


def spread_rows(block_grad: Tensor, L: Tensor, T: int) -> Tensor:
    """A block mean's gradient ``(B, H, n, D)`` as token gradients ``(B, T, H, D)`` fp32: each live
    row of block j gets :func:`per_row`'s share, dead rows 0 (for a backward that adds it with
    torch ops; a fused kernel adds :func:`per_row` in its own loop)."""
    B, H, n, D = block_grad.shape
    rows = per_row(block_grad, L).permute(0, 2, 1, 3)[:, :, None]            # (B, n, 1, H, D)
    live = live_token_mask(L).to(torch.float32)[None, :, :, None, None]      # (1, n, 64, 1, 1)
    return (rows * live).reshape(B, n * BLOCK, H, D)[:, :T]
