"""The ``sdpa`` (portable) backend: gather the kept key blocks, let the device's SDPA do the arithmetic.

Work proceeds per (batch, chunk of heads). The chunk's q, k and v are laid out
as contiguous 64-row blocks ``(heads * n, 64, D)`` (one pass over them), so
every gather below moves whole 16 KB blocks (bf16, D = 128) rather than
256-byte rows: on an H200 a row gather ran at ~0.85 TB/s, block copies run near
the copy bandwidth. Then, for each group of query blocks that keep the same
number ``c`` of key blocks, the kept key and value blocks are gathered into
contiguous ``(rows, c * 64, D)`` tensors and handed to
``F.scaled_dot_product_attention`` (oneDNN on XPU, flash on CPU, cuDNN/flash
on CUDA, Metal on MPS). Equal counts need no padding and, when nothing needs
masking, no mask, so the device's fastest kernel runs.

- The pooled tail enters the same SDPA call as one extra key block per query
  block (SPEC.md, DESIGN.md): its row 0 has a zero key, the tail's mean value
  as value and ``tail_lse`` as mask entry; its other rows are masked. The
  exact keys are centred (``k - m``, subtracted in fp32 while laying out the
  blocks), so the zero key's logit is exactly ``tail_lse`` against them and
  the rounding of the keys scales with ``|k - m|``, not ``|k|``.
- ``block_len``, ragged last blocks and ``key_bias`` become an additive key
  mask broadcast over the query rows, only for the query blocks that need it.
- Working memory is bounded by a byte budget: half for the chunk's block
  layouts (sizing the chunk of heads), half for the gathers (sizing the chunk
  of query blocks); nothing of size T x T or T x n exists.
- In inference the scratch buffers are reused between chunks; with gradients
  every op is an ordinary differentiable torch op, so autograd flows through
  q, k, v and coarse_gate with the selection held constant.
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch
import torch.nn.functional as F

from ..budget import BUDGETS
from ..routing import Plan, live_token_mask
from ..validation import BLOCK, Problem
from .base import ALL_FEATURES, Backend

#: working memory beyond inputs and output, bytes (``solattn.set_memory_budget``,
#: ``solattn.memory_budget`` or ``SOLATTN_SDPA_BUDGET``; 1 GiB by default)
budget = BUDGETS["sdpa"]


def _new_output(shape, dtype, device) -> torch.Tensor:
    """The output buffer every element of which the backend writes (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


#: Device types whose SDPA computes correctly with an fp32 additive mask on bf16/fp16 inputs.
#: CUDA is not one: torch 2.11 on an H200 accepted an fp32 mask but returned NaN and wrong rows
#: once it held -inf (22 GPU tests failed); XPU and MPS were never run. Elsewhere the mask takes
#: q's dtype, and the tail's log-weight is re-centred so that bf16 rounding does not bite
#: (see ``_mask_for_device``).
_FP32_MASK_DEVICES = frozenset({"cpu"})


def _mask_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """Additive masks in fp32 where the device's SDPA is known to handle them, else q's dtype."""
    return torch.float32 if device.type in _FP32_MASK_DEVICES else dtype


def _mask_for_device(mask: torch.Tensor, tail_lse: Optional[torch.Tensor], mdt: torch.dtype) -> torch.Tensor:
    """The fp32 ``(rows, L)`` additive mask, made safe for SDPA in dtype ``mdt``.

    - With the tail, each row is shifted by its ``tail_lse`` rounded to ``mdt`` (a softmax does
      not change when every logit of a row moves by one constant). The tail entry becomes the
      small residual ``tail_lse - round(tail_lse)``, held precisely, and an unbiased exact key's
      entry ``-round(tail_lse)`` is exactly representable, so rounding the mask to bf16 no longer
      shifts the tail's weight against the exact keys (a bf16 tail_lse of ~10 is off by up to
      1/32, which alone gave 1.5e-2 relative error on an H200).
    - Finite entries are clamped into ``mdt``'s finite range, so a large finite bias (an fp32
      ``finfo.min`` "mask", or -1e5 in fp16) stays finite instead of becoming -inf (which would
      zero a row that SPEC.md says has finite terms). ``-inf`` stays ``-inf``.
    """
    if mdt == torch.float32:
        return mask
    if tail_lse is not None:
        c = tail_lse.to(mdt).to(torch.float32)
        mask = mask - torch.where(torch.isfinite(c), c, torch.zeros_like(c))[:, None]
    big = torch.finfo(mdt).max
    return torch.where(torch.isneginf(mask), mask, mask.clamp(-big, big)).to(mdt)


class SdpaBackend(Backend):
    name = "sdpa"
    description = ("portable: gathers kept key blocks, runs F.scaled_dot_product_attention "
                   "(oneDNN on XPU, flash on CPU/CUDA, Metal on MPS); memory bounded by a budget")
    devices = frozenset({"cpu", "cuda", "xpu", "mps"})
    features = ALL_FEATURES

    def device_reasons(self, device: torch.device) -> List[str]:
        if not hasattr(F, "scaled_dot_product_attention"):
            return ["torch.nn.functional.scaled_dot_product_attention missing (torch too old)"]
        return []

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
    """Scratch buffers reused by every chunk of one call in inference. With gradients
    (``enabled=False``) every request allocates, since ``out=`` ops do not record autograd."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.buffers = {}

    def empty(self, name: str, shape, dtype, device) -> torch.Tensor:
        numel = math.prod(shape)
        if not self.enabled:
            return torch.empty(shape, dtype=dtype, device=device)
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = self.buffers[name] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel].view(shape)

    def gather(self, name: str, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``table.index_select(0, index)``, written into a reused buffer when enabled."""
        if not self.enabled:
            return table.index_select(0, index)
        shape = (index.numel(),) + tuple(table.shape[1:])
        numel = math.prod(shape)
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != table.dtype:
            buf = self.buffers[name] = torch.empty(numel, dtype=table.dtype, device=table.device)
        return torch.index_select(table, 0, index, out=buf[:numel].view(shape))


def _blocked(work: _Workspace, name: str, x: torch.Tensor, n: int, extra_blocks: int,
             live: Optional[torch.Tensor] = None, shift: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x``: ``(T, nh, D)`` (one batch, a chunk of heads, any strides) -> ``(nh * n + extra_blocks,
    64, D)`` contiguous: head-major 64-row blocks, then zeroed extra blocks.

    Rows past T are zero, and so are dead rows when ``live`` (``(n, 64)`` bool) is given: a dead
    row never enters the arithmetic, even holding NaN. ``shift`` (``(nh, D)`` fp32) is subtracted
    in fp32 before the cast (the centred keys ``k - m`` of SPEC.md).
    """
    T, nh, D = x.shape
    buf = work.empty(name, (nh * n + extra_blocks, BLOCK, D), x.dtype, x.device)
    layout = buf[:nh * n].view(nh, n * BLOCK, D)
    src = x.transpose(0, 1)
    layout[:, :T].copy_(src if shift is None else src.to(torch.float32) - shift[:, None, :])
    layout[:, T:].zero_()
    if live is not None:
        layout.view(nh, n, BLOCK, D).masked_fill_(~live[None, :, :, None], 0)
    buf[nh * n:].zero_()
    return buf


def sdpa_forward(p: Problem, plan: Plan, nbytes: Optional[int] = None) -> torch.Tensor:
    """Run SPEC.md's output for ``p`` from ``plan`` through SDPA. ``(B, T, H, D)``, v's dtype."""
    B, T, H, D, n = p.B, p.T, p.H, p.D, p.n
    dev, dt = p.device, p.dtype
    nbytes = nbytes or budget.bytes
    elt = torch.finfo(dt).bits // 8
    tail = plan.tail_lse is not None
    kbias = _key_token_bias(p, plan)                    # (Bk, n, 64) fp32 or None
    masked_any = kbias is not None or tail
    mdt = _mask_dtype(dev, dt)
    work = _Workspace(enabled=not p.requires_grad)
    # half the budget for the block layouts of a chunk of heads (q, k, v, out, tail values)
    per_head = (n * BLOCK * D * elt * (5 if tail else 4) + (n * BLOCK * 4 * 2 if masked_any else 0)
                + (n * BLOCK * D * 4 if tail else 0))          # the fp32 centring temporary
    heads_per_chunk = max(1, min(H, (nbytes // 2) // per_head))
    gather_budget = min(nbytes // 2, _CHUNK_CAP.get(dev.type, nbytes))
    dead_block = plan.block_len < BLOCK                                       # (n,)
    out = _new_output((B, T, H, D), dt, dev)
    for b in range(B):
        for h0 in range(0, H, heads_per_chunk):
            h1 = min(H, h0 + heads_per_chunk)
            _attend_head_chunk(p, plan, b, h0, h1, out, kbias, dead_block, tail, mdt, elt,
                               gather_budget, work)
    if plan.coarse is not None and p.coarse_gate is not None:
        out = _add_coarse(out, p.coarse_gate, plan.coarse, nbytes)
    return out


def _attend_head_chunk(p, plan, b, h0, h1, out, kbias, dead_block, tail, mdt, elt, gather_budget, work):
    """Every query block of batch ``b``, heads ``[h0, h1)``: block layouts, then grouped SDPA calls."""
    T, D, n, dev = p.T, p.D, p.n, p.device
    nh = h1 - h0
    R = nh * n                                           # query blocks in this chunk: row = hl * n + i
    # K table: the chunk's key blocks (centred, k - m, when the tail is on), then one zero tail
    # block per head. V table: the value blocks, then one tail block per query block (row 0 =
    # the tail's mean value). Dead rows are zeroed so that nothing in them reaches the output.
    live = live_token_mask(plan.block_len) if p.block_len is not None else None
    qb = _blocked(work, "q", p.q[b, :, h0:h1], n, 0, live)
    kb = _blocked(work, "k", p.k[b, :, h0:h1], n, nh if tail else 0, live,
                  plan.key_mean[b, h0:h1, 0] if tail else None)
    vb = _blocked(work, "v", p.v[b, :, h0:h1], n, R if tail else 0, live)
    ob = work.empty("o", (R, BLOCK, D), p.dtype, dev) if work.enabled else None  # every row written
    mask_table = None
    if kbias is not None or tail:
        mask_table = (kbias[b if kbias.shape[0] > 1 else 0] if kbias is not None
                      else torch.zeros(n, BLOCK, dtype=torch.float32, device=dev))
    if tail:
        vb[R:, 0] = plan.tail_value[b, h0:h1].reshape(R, D).to(p.dtype)
        tail_rows = torch.full((R, BLOCK), -math.inf, dtype=torch.float32, device=dev)
        tail_rows[:, 0] = plan.tail_lse[b, h0:h1].reshape(R)
        mask_table = torch.cat([mask_table, tail_rows])  # key block j -> row j; tail of r -> n + r

    counts = plan.kv_num_blocks[b, h0:h1].reshape(R)
    indices = plan.kv_indices[b, h0:h1].reshape(R, -1).long()
    if mask_table is None:
        needs_mask = torch.zeros(R, dtype=torch.bool, device=dev)
    elif tail or p.key_bias is not None:
        needs_mask = torch.ones(R, dtype=torch.bool, device=dev)
    else:                                                # only dead rows: blocks that touch them
        needs_mask = plan.touches_dead[b, h0:h1].reshape(R)
    group_key = counts.long() * 2 + needs_mask.long()
    head_base = (torch.arange(R, device=dev) // n) * n   # first key block of each row's head
    outputs = []
    for key in torch.unique(group_key).tolist():
        c, masked = key // 2, bool(key % 2)
        group = torch.nonzero(group_key == key).squeeze(1)
        nb = c + (1 if tail else 0)                      # key blocks per query block in this group
        L = nb * BLOCK
        per_row = (2 * L * D * elt                      # gathered keys and values
                   + 3 * BLOCK * D * 4                  # queries, output, SDPA accumulators
                   + (L * 4 * 2 if masked else 0)       # mask
                   + BLOCK * L * 4)                     # scores of a math fallback
        step = max(1, gather_budget // per_row)
        for r0 in range(0, group.shape[0], step):
            rows = group[r0:r0 + step]
            nr = rows.shape[0]
            blocks = indices[rows, :c]                                          # (nr, c)
            k_idx = head_base[rows, None] + blocks
            v_idx = k_idx
            m_idx = blocks
            if tail:
                k_idx = torch.cat([k_idx, (R + rows // n)[:, None]], dim=1)
                v_idx = torch.cat([v_idx, (R + rows)[:, None]], dim=1)
                m_idx = torch.cat([m_idx, (n + rows)[:, None]], dim=1)
            q = work.gather("gq", qb, rows).view(nr, 1, BLOCK, D)
            k = work.gather("gk", kb, k_idx.reshape(-1)).view(nr, 1, L, D)
            v = work.gather("gv", vb, v_idx.reshape(-1)).view(nr, 1, L, D)
            mask = mask_table.index_select(0, m_idx.reshape(-1)).view(nr, L) if masked else None
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None if mask is None else
                _mask_for_device(mask, mask[:, -BLOCK] if tail else None, mdt)[:, None, None, :],
                scale=p.scale).view(nr, BLOCK, D)
            if mask is not None:
                dead = torch.isneginf(mask).all(dim=1)  # every term -inf: SPEC says 0, not NaN
                if bool(dead.any()):
                    o = torch.where(dead[:, None, None], torch.zeros_like(o), o)
            if ob is not None:
                ob.index_copy_(0, rows, o)
            else:
                outputs.append((rows, o))
            del q, k, v, o, mask  # free this chunk's gathers before the next chunk allocates its own
    if ob is None:                                       # autograd: one differentiable scatter
        rows = torch.cat([r for r, _ in outputs])
        ob = torch.zeros(R, BLOCK, D, dtype=p.dtype, device=dev).index_copy(
            0, rows, torch.cat([o for _, o in outputs]))
    out[b, :, h0:h1] = ob.view(nh, n * BLOCK, D)[:, :T].transpose(0, 1)


def _add_coarse(out: torch.Tensor, gate: torch.Tensor, coarse: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``out += (gate * coarse_of_block).to(dtype)`` in place, token chunk by token chunk (bounded memory)."""
    B, T, H, D = out.shape
    step = max(BLOCK, (nbytes // max(1, B * H * D * 12)) // BLOCK * BLOCK)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        blocks = torch.arange(t0, t1, device=out.device) // BLOCK
        c = coarse[:, :, blocks].permute(0, 2, 1, 3)                 # (B, t1-t0, H, D) fp32
        out[:, t0:t1] += (gate[:, t0:t1].to(torch.float32) * c).to(out.dtype)
    return out
