"""The ``sdpa`` (portable) backend: gather the kept key blocks, let the device's SDPA do the arithmetic.

For a chunk of query blocks that keep the same number ``c`` of key blocks,
the kept keys and values are gathered into contiguous ``(rows, c * 64, D)``
tensors and handed to ``F.scaled_dot_product_attention`` (oneDNN on XPU,
flash on CPU and CUDA, Metal on MPS). Grouping query blocks by their count
means no padding and, when nothing needs masking, no mask at all, so the
device's fastest kernel runs.

- Gathers read rows straight out of the caller's tensors through a strided
  ``(rows, D)`` view of their storage: no layout copy of q, k or v is made for
  any input whose last dim is contiguous (BTHD, BHTD-transposed, sliced).
- The pooled tail enters the same SDPA call as one extra key per query block
  whose mask entry is ``tail_lse`` and whose value is ``tail_value``
  (SPEC.md, DESIGN.md); its key is the centroid ``m``, which accounts for the
  centring of the exact keys without copying them.
- ``block_len``, ragged last blocks and ``key_bias`` become an additive key
  mask broadcast over the query rows.
- Working memory (gathers, masks, SDPA scratch) is bounded by sizing the chunk
  of query blocks from a byte budget; nothing of size T x T or T x n exists.
- Every op is a differentiable torch op, so autograd flows through q, k, v
  and coarse_gate with the selection held constant.
"""

from __future__ import annotations

import math
import os
from typing import List, Optional

import torch
import torch.nn.functional as F

from ..routing import Plan
from ..validation import BLOCK, Problem
from .base import ALL_FEATURES, Backend

_DEFAULT_BUDGET = int(os.environ.get("SOLATTN_SDPA_BUDGET", 1 << 30))
_budget = _DEFAULT_BUDGET


def set_memory_budget(nbytes: Optional[int]) -> None:
    """Set the portable backend's working-memory budget in bytes (``None`` restores 1 GiB or
    ``SOLATTN_SDPA_BUDGET``). The budget covers gathered keys/values, masks and SDPA scratch;
    inputs and output are not counted."""
    global _budget
    if nbytes is None:
        _budget = _DEFAULT_BUDGET
        return
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"set_memory_budget: argument 'nbytes' received {nbytes!r}; "
                         "allowed: a positive int (bytes) or None")
    _budget = nbytes


def memory_budget() -> int:
    return _budget


def _new_output(shape, dtype, device) -> torch.Tensor:
    """The output buffer every element of which the backend writes (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _row_table(x: torch.Tensor):
    """A ``(rows, D)`` view of x's storage in which token ``(b, t, h)`` is row
    ``(b * sB + t * sT + h * sH) // g``; returns ``(table, (sB, sT, sH) // g)``.

    Needs a unit stride on D; other tensors are made contiguous first (one copy).
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    sB, sT, sH, _ = x.stride()
    B, T, H, D = x.shape
    g = 0
    for s, size in ((sB, B), (sT, T), (sH, H)):
        if size > 1:
            g = math.gcd(g, s)
    g = g or D
    if g < D:  # rows would overlap (exotic strides): use a plain layout
        x = x.contiguous()
        sB, sT, sH, _ = x.stride()
        g = D
    rows = ((B - 1) * sB + (T - 1) * sT + (H - 1) * sH) // g + 1
    table = torch.as_strided(x, (rows, D), (g, 1), x.storage_offset())
    return table, (sB // g, sT // g, sH // g)


def _mask_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """Additive masks in fp32 where the device's SDPA accepts them (bias precision), else q's dtype."""
    return torch.float32 if device.type == "cpu" else dtype


class SdpaBackend(Backend):
    name = "sdpa"
    description = ("portable: gathers kept key blocks, runs F.scaled_dot_product_attention "
                   "(oneDNN on XPU, flash on CPU/CUDA, Metal on MPS); memory bounded by a budget")
    devices = frozenset({"cpu", "cuda", "xpu", "mps"})
    features = ALL_FEATURES

    def availability_reasons(self, device_type: str) -> List[str]:
        reasons = super().availability_reasons(device_type)
        if not reasons and not hasattr(F, "scaled_dot_product_attention"):
            reasons.append("torch.nn.functional.scaled_dot_product_attention missing (torch too old)")
        return reasons

    def forward(self, problem: Problem, plan: Plan) -> torch.Tensor:
        return sdpa_forward(problem, plan)


def _key_token_bias(p: Problem, plan: Plan) -> Optional[torch.Tensor]:
    """``(Bk, n, 64)`` fp32 additive bias per key slot (key_bias, -inf on dead and padded rows),
    or None when no key is ever masked."""
    n, T = p.n, p.T
    dead = p.block_len is not None or T % BLOCK != 0
    if p.key_bias is None and not dead:
        return None
    live = torch.arange(BLOCK, device=p.device)[None, :] < plan.block_len[:, None]  # (n, 64)
    bias = torch.zeros(p.key_bias.shape[0] if p.key_bias is not None else 1, n * BLOCK,
                       dtype=torch.float32, device=p.device)
    if p.key_bias is not None:
        bias[:, :T] = p.key_bias
    bias = bias.view(-1, n, BLOCK)
    return bias.masked_fill(~live, -math.inf)


#: On the CPU, gathered chunks are kept small (and reused) so that they stay in cache and in
#: the allocator's heap: fresh multi-hundred-MB allocations each page-fault on first touch,
#: which costs more than the gather itself (measured: 0.6 s vs 0.06 s for a 512 MB gather).
_CHUNK_CAP = {"cpu": 32 << 20}


class _Workspace:
    """Flat scratch buffers reused by every chunk of one call (inference only: ``out=`` ops
    do not record autograd, so with gradients each chunk allocates its own tensors)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.buffers = {}

    def gather(self, name: str, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``table.index_select(0, index)``, written into a reused buffer when enabled."""
        if not self.enabled:
            return table.index_select(0, index)
        numel = index.numel() * table.shape[1]
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < numel:
            buf = self.buffers[name] = torch.empty(numel, dtype=table.dtype, device=table.device)
        out = buf[:numel].view(index.numel(), table.shape[1])
        return torch.index_select(table, 0, index, out=out)


def sdpa_forward(p: Problem, plan: Plan, budget: Optional[int] = None) -> torch.Tensor:
    """Run SPEC.md's output for ``p`` from ``plan`` through SDPA. ``(B, T, H, D)``, v's dtype."""
    B, T, H, D, n = p.B, p.T, p.H, p.D, p.n
    dev, dt = p.device, p.dtype
    budget = budget or _budget
    R = B * H * n
    qt, qs = _row_table(p.q)
    kt, ks = _row_table(p.k)
    vt, vs = _row_table(p.v)
    kbias = _key_token_bias(p, plan)                    # (Bk, n, 64) or None
    tail = plan.tail_lse is not None
    if tail:
        # The pooled tail is one extra key per query block, stored after the token rows. Its key
        # is the centroid m: scale q_t . m + tail_lse against the uncentred exact logits
        # scale q_t . k_u equals tail_lse against the centred ones, so keys need no centring copy.
        k_tail_row, v_tail_row = kt.shape[0], vt.shape[0]
        kt = torch.cat([kt, plan.key_mean.to(dt).expand(B, H, n, D).reshape(R, D)])
        vt = torch.cat([vt, plan.tail_value.reshape(R, D).to(dt)])
        if kbias is None:
            kbias = torch.zeros(1, n, BLOCK, dtype=torch.float32, device=dev)
        bias_table = torch.cat([kbias.reshape(-1), plan.tail_lse.reshape(R)])
    else:
        bias_table = kbias.reshape(-1) if kbias is not None else None
    same_kv_index = ks == vs and (not tail or k_tail_row == v_tail_row)
    mdt = _mask_dtype(dev, dt)
    elt = torch.finfo(dt).bits // 8
    work = _Workspace(enabled=not p.requires_grad)
    chunk_budget = min(budget, _CHUNK_CAP.get(dev.type, budget))

    # token offsets of every 64-row block, clamped into the sequence (rows past T read token
    # T-1: as keys they are masked, as queries their outputs go to a sink row)
    blk_tok = (torch.arange(n, device=dev)[:, None] * BLOCK
               + torch.arange(BLOCK, device=dev)).clamp_max(T - 1)             # (n, 64)
    out = _new_output((B * T * H + 1, D), dt, dev)   # last row: sink for rows past T
    counts = plan.kv_num_blocks.reshape(-1)             # (R,)
    indices = plan.kv_indices.reshape(R, -1).long()
    # Query blocks are grouped by (count, needs a mask): equal counts need no padding, and
    # blocks whose keys are all live and unbiased run the device's fastest (mask-free) kernel.
    if bias_table is None:
        needs_mask = torch.zeros_like(counts, dtype=torch.bool)
    elif tail or p.key_bias is not None:
        needs_mask = torch.ones_like(counts, dtype=torch.bool)
    else:                                               # only dead rows: blocks that touch them
        needs_mask = (plan.exact & (plan.block_len < BLOCK)).any(dim=-1).reshape(-1)
    group_key = counts.long() * 2 + needs_mask.long()
    for key in torch.unique(group_key).tolist():
        c, masked = key // 2, bool(key % 2)
        group = torch.nonzero(group_key == key).squeeze(1)
        L = c * BLOCK + (1 if tail else 0)              # keys per query block in this group
        per_row = (2 * L * D * elt                      # gathered keys and values
                   + 3 * BLOCK * D * 4                  # queries, output, SDPA accumulators
                   + (L * 4 * 2 if masked else 0)       # mask and its index
                   + L * 8 * 2                          # gather indices
                   + BLOCK * L * 4)                     # scores of a math fallback
        step = max(1, chunk_budget // per_row)
        for r0 in range(0, group.shape[0], step):
            rows = group[r0:r0 + step]                  # flat (b, h, i) query-block ids
            nr = rows.shape[0]
            b, h, i = rows // (H * n), (rows // n) % H, rows % n
            blocks = indices[rows, :c]                                             # (nr, c)
            key_tok = blk_tok[blocks].reshape(nr, c * BLOCK)                      # (nr, c*64)
            q_idx = ((b * qs[0] + h * qs[2])[:, None] + blk_tok[i] * qs[1]).reshape(-1)
            k_idx = (b * ks[0] + h * ks[2])[:, None] + key_tok * ks[1]
            v_idx = k_idx if same_kv_index else (b * vs[0] + h * vs[2])[:, None] + key_tok * vs[1]
            m_idx = None
            if masked:
                bk = b if kbias.shape[0] > 1 else torch.zeros_like(b)
                m_idx = (bk * (n * BLOCK))[:, None] + (blocks[:, :, None] * BLOCK
                                                       + torch.arange(BLOCK, device=dev)).reshape(nr, -1)
            if tail:
                k_idx = torch.cat([k_idx, (k_tail_row + rows)[:, None]], dim=1)
                v_idx = k_idx if same_kv_index else torch.cat([v_idx, (v_tail_row + rows)[:, None]], dim=1)
                m_idx = torch.cat([m_idx, (kbias.numel() + rows)[:, None]], dim=1)
            q = work.gather("q", qt, q_idx).view(nr, 1, BLOCK, D)
            k = work.gather("k", kt, k_idx.reshape(-1)).view(nr, 1, L, D)
            v = work.gather("v", vt, v_idx.reshape(-1)).view(nr, 1, L, D)
            mask = bias_table.index_select(0, m_idx.reshape(-1)).view(nr, L) if m_idx is not None else None
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None if mask is None else mask.to(mdt)[:, None, None, :],
                scale=p.scale).view(nr, BLOCK, D)
            if mask is not None:
                dead = torch.isneginf(mask).all(dim=1)  # every term -inf: SPEC says 0, not NaN
                if bool(dead.any()):
                    o = torch.where(dead[:, None, None], torch.zeros_like(o), o)
            tq = i[:, None] * BLOCK + torch.arange(BLOCK, device=dev)
            dst = torch.where(tq < T, (b[:, None] * T + tq) * H + h[:, None], B * T * H)
            out.index_copy_(0, dst.reshape(-1), o.reshape(-1, D))
            del q, k, v, o, mask  # free this chunk's gathers before the next chunk allocates its own

    out = out[:-1].view(B, T, H, D)
    if plan.coarse is not None and p.coarse_gate is not None:
        out = _add_coarse(out, p.coarse_gate, plan.coarse, budget)
    return out


def _add_coarse(out: torch.Tensor, gate: torch.Tensor, coarse: torch.Tensor, budget: int) -> torch.Tensor:
    """``out += (gate * coarse_of_block).to(dtype)`` in place, token chunk by token chunk (bounded memory)."""
    B, T, H, D = out.shape
    step = max(BLOCK, (budget // max(1, B * H * D * 12)) // BLOCK * BLOCK)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        blocks = torch.arange(t0, t1, device=out.device) // BLOCK
        c = coarse[:, :, blocks].permute(0, 2, 1, 3)                 # (B, t1-t0, H, D) fp32
        out[:, t0:t1] += (gate[:, t0:t1].to(torch.float32) * c).to(out.dtype)
    return out
