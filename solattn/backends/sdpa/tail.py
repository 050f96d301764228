"""The pooled tail as one extra key per query block: what its slots hold and how a chunk's keys,
values and mask take it (see the package docstring)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

import torch

from . import masks
from .grouping import split_rows
from .memory import TAIL_ROWS


@dataclass
class TailRows:
    """What the tail slots of some query blocks hold (see :func:`append_tail`), sliced per chunk."""

    m: torch.Tensor                    # (N, D) fp32 key centroid
    m_key: torch.Tensor                # (N, D) the centroid rounded to the input dtype: the tail's key
    value: torch.Tensor                # (N, D) tail value in v's dtype
    lse: torch.Tensor                  # (N,) fp32 tail_lse
    exact_entry: torch.Tensor          # (N,) mask dtype: every unbiased exact key's entry
    entry: Optional[torch.Tensor]      # (N,) mask dtype: the tail's entry, when one per block

    def split(self, step: int) -> List["TailRows"]:
        """Chunks of ``step`` rows (see :meth:`_Slice.split`)."""
        return [TailRows(*tables) for tables in
                split_rows((self.m, self.m_key, self.value, self.lse, self.exact_entry, self.entry), step)]


def tail_rows(call, b, h, i, block_residual: Optional[torch.Tensor]) -> TailRows:
    """The tail slots of query blocks ``(b, h, i)``. The exact keys are not centred, so the tail's
    logit carries the centroid: ``tail_lse_i + scale q_t . m``. The key ``m`` rounded to the input
    dtype gives the bulk of ``scale q_t . m`` (exact products, fp32 sums in the kernel); the
    rounding residual ``r_t = scale q_t . (m - round(m))`` varies per query row ``t``. Where it
    barely varies within the block, ``block_residual`` (``(N,)``, its mean over the block's live
    rows) stands for it and the tail's entry is one per block; otherwise (None) :func:`append_tail`
    computes one per query row. Each query block's mask is re-centred by its rounded tail_lse (see
    masks.finish_mask), so an unbiased exact key's entry is ``-round(tail_lse)``."""
    plan, mdt = call.plan, call.mdt
    m = plan.key_mean[b, h, 0]
    lse = plan.tail_lse[b, h, i]
    shift = masks.rounded_shift(lse, mdt)
    entry = None
    if block_residual is not None:
        entry = masks.finish_mask((lse + block_residual - shift)[:, None], mdt)[:, 0]
    return TailRows(m=m, m_key=m.to(call.p.dtype), value=plan.tail_value[b, h, i].to(call.p.dtype), lse=lse,
                     exact_entry=(-shift).to(mdt), entry=entry)


def append_tail(call, q, k, v, base: Optional[torch.Tensor], t: TailRows, zeroed: bool):
    """Fill the tail slots of a chunk: the centroid as key and the tail's mean value in the first,
    masked padding after it (see :func:`tail_rows`). ``base``: the exact keys' bias, ``(nr, E)``:
    None (no bias, no dead key), without ``key_bias`` the dead-slot entries (0 / -inf, mask dtype,
    from ``call.slot_entries``), with it the fp32 bias; ``zeroed``: the tail slots of k and v
    already hold zeros. Returns k, v, the mask in the device's dtype and the all-masked query rows
    (None: none can be)."""
    p, mdt = call.p, call.mdt
    nr = q.shape[0]
    E = k.shape[1] - TAIL_ROWS                                               # exact key slots
    grad = not call.work.enabled                 # this call records autograd (see sdpa_forward)
    if grad:
        # out of place: in-place writes into slices record CopySlices, whose backward calls
        # as_strided, which has no batching rule when the gradients are vmapped (jacobian(
        # vectorize=True), torch.func.jacrev); the gathered tensors stay untouched too
        pad = k.new_zeros(nr, TAIL_ROWS - 1, k.shape[2])
        k = torch.cat([k[:, :E], t.m_key[:, None].to(k.dtype), pad], dim=1)
        v = torch.cat([v[:, :E], t.value[:, None].to(v.dtype), pad], dim=1)      # (k, v: one dtype)
    else:
        if not zeroed:
            k[:, E:] = 0
            v[:, E:] = 0
        k[:, E] = t.m_key
        v[:, E] = t.value
    if t.entry is None:                          # one tail entry per query row
        residual = (t.m - t.m_key.to(torch.float32))[:, :, None]
        tail_logit = t.lse[:, None] + p.scale * torch.bmm(q.to(torch.float32), residual)[..., 0]  # (nr, Lq)
        tail_entry = masks.finish_mask(tail_logit - masks.rounded_shift(t.lse, mdt)[:, None], mdt)
    else:
        tail_logit = t.lse[:, None]              # -inf exactly where the block's entry is
        tail_entry = t.entry[:, None]
    mask_rows = tail_entry.shape[1]
    dead = None
    if base is None:                             # every exact entry is -round(tail_lse)
        exact = t.exact_entry[:, None, None]
    elif not masks.all_keys_can_die(p):          # base: call.slot_entries' 0 (live) / -inf (dead)
        # in the mask dtype; the live entries are -round(tail_lse), as above
        # (an add, then a copy into the view: plain ops every device runs, rather than out= into a
        # strided view, which MPS and XPU were not tested with here)
        exact = base[:, None, :] + t.exact_entry[:, None, None]
    else:                                        # key_bias: some row may lose every exact key
        exact = masks.finish_mask(base, mdt, row_shift=t.lse)[:, None, :]
        dead = torch.isneginf(base).all(dim=1)[:, None] & torch.isneginf(tail_logit)  # (nr, mask_rows)
    if grad:                                     # out of place, as k and v above
        exact = exact.to(mdt).expand(nr, mask_rows, E)
        mask = torch.cat([exact, tail_entry.to(mdt)[..., None],
                          exact.new_full((nr, mask_rows, TAIL_ROWS - 1), -math.inf)], dim=2)
        return k, v, mask[:, None], dead
    mask = call.work.empty("mask", (nr, mask_rows, E + TAIL_ROWS), mdt, q.device)
    mask[:, :, :E] = exact
    mask[:, :, E] = tail_entry
    mask[:, :, E + 1:] = -math.inf
    return k, v, mask[:, None], dead
