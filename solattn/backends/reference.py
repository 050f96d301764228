"""The ``reference`` backend: SPEC.md computed literally, in fp32, with dense T x T scores.

It is the oracle every other backend is tested against, so it deliberately
shares no selection code with them: it does not import ``solattn.routing``.
Everything (block means, routing scores, thresholds, the exact set, the tail)
is derived here from the definition. Memory is O(B H T^2); a guard refuses
before allocating more than its memory budget (4 GiB by default).
"""

from __future__ import annotations

import math
from typing import List

import torch

from ..budget import BUDGETS
from ..validation import BLOCK, Problem
from .base import Backend

#: the most the score tensors may take, bytes (``solattn.set_memory_budget(n, backend="reference")``,
#: ``solattn.memory_budget(n, backend="reference")`` or ``SOLATTN_REFERENCE_BUDGET``)
budget = BUDGETS["reference"]


def estimated_bytes(B: int, H: int, T: int) -> int:
    """Working memory of :func:`reference_forward`: about three fp32 ``(B, H, T, T + n)``
    tensors (logits, their mask, the probabilities)."""
    n = (T + BLOCK - 1) // BLOCK
    return 3 * 4 * B * H * T * (T + n)


def _gib(x: int) -> str:
    return f"{x / 2**30:.2f} GiB"


def _live_lengths(p: Problem) -> torch.Tensor:
    """``L_j`` for every block, int64 (SPEC.md, "Blocks")."""
    n, T = p.n, p.T
    if p.block_len is None:
        L = torch.full((n,), BLOCK, dtype=torch.int64, device=p.device)
    else:
        L = p.block_len.to(torch.int64).clamp(1, BLOCK)
    L[n - 1] = L[n - 1].clamp(max=T - BLOCK * (n - 1))  # the last block is cut by T
    return L


def _block_means(x: torch.Tensor, L: torch.Tensor) -> torch.Tensor:
    """Mean over the live rows of each block, ``(B, H, T, D)`` -> ``(B, H, n, D)``.

    ``x``'s dead rows must already be zero. A sum per block (not a dense ``(n, T)`` averaging
    matrix, where ``NaN * 0`` would carry one token's NaN into every block's mean) keeps each
    mean a function of its own block's rows only, as the definition says.
    """
    B, H, T, D = x.shape
    n = L.shape[0]
    padded = torch.nn.functional.pad(x, (0, 0, 0, n * BLOCK - T))   # zero rows past T
    return padded.view(B, H, n, BLOCK, D).sum(dim=3) / L.to(x.dtype)[:, None]


def reference_forward(p: Problem) -> torch.Tensor:
    """SPEC.md's output, literally. Returns ``(B, T, H, D)`` in v's dtype, contiguous."""
    B, T, H, n = p.B, p.T, p.H, p.n
    dev, f32 = p.device, torch.float32
    q = p.q.to(f32).permute(0, 2, 1, 3)  # (B, H, T, D)
    k = p.k.to(f32).permute(0, 2, 1, 3)
    v = p.v.to(f32).permute(0, 2, 1, 3)
    scale, c = p.scale, p.scale * math.log2(math.e)

    # live rows: token t is in block t // 64 at position t % 64
    L = _live_lengths(p)                                   # (n,)
    tok_block = torch.arange(T, device=dev) // BLOCK       # (T,)
    tok_live = (torch.arange(T, device=dev) % BLOCK) < L[tok_block]
    # dead rows never enter anything (a NaN there must not reach a mean or an exact key); their
    # own outputs are unspecified, computed here from zeros
    q, k, v = (torch.where(tok_live[:, None], x, torch.zeros((), device=dev)) for x in (q, k, v))

    qm = _block_means(q, L)                                # (B, H, n, D)
    km = _block_means(k, L)
    vm = _block_means(v, L)
    m = km.mean(dim=2, keepdim=True)                       # (B, H, 1, D)
    kmc = km - m

    R = c * (qm @ kmc.transpose(-1, -2))                   # (B, H, n, n)
    jj = torch.arange(n, device=dev)
    exact = torch.zeros(B, H, n, n, dtype=torch.bool, device=dev)
    if p.topk_ratio == 0.0:
        var = kmc.pow(2).mean(dim=2)                       # population variance over blocks, (B, H, D)
        thr = p.tau * torch.sqrt(c * c * (qm.pow(2) * var[:, :, None, :]).sum(-1) + 1e-6)
        exact |= R > thr[..., None]
    else:
        is_sink = torch.zeros(n, dtype=torch.bool, device=dev)
        if p.sink_blocks is not None:
            is_sink[p.sink_blocks[0]:p.sink_blocks[1]] = True
        n_eff = n - int(is_sink.sum().item())
        kk = 0 if n_eff <= 1 else min(max(round(p.topk_ratio * n_eff), 1), n_eff - 1)
        if kk > 0:
            cand = R.masked_fill(is_sink, -math.inf)
            theta = cand.sort(dim=-1, descending=True).values[..., kk - 1]
            exact |= (cand >= theta[..., None]) & ~is_sink
    exact |= (jj[:, None] - jj[None, :]).abs() <= 1
    if p.sink_blocks is not None:
        exact[..., p.sink_blocks[0]:p.sink_blocks[1]] = True
    if p.sink_q is not None:
        exact[:, :, p.sink_q[0]:p.sink_q[1], :] = True

    # exact logits e_u = scale q_t . (k_u - m) + bias_u over live keys of exact blocks
    e = scale * (q @ (k - m).transpose(-1, -2))            # (B, H, T, T)
    if p.key_bias is not None:
        e = e + p.key_bias[:, None, None, :]
    key_ok = exact[:, :, tok_block][:, :, :, tok_block] & tok_live[None, None, None, :]
    e = e.masked_fill(~key_ok, -math.inf)

    # pooled logits p_j + log L_j for blocks outside E_i (tail only)
    pooled = scale * (qm @ kmc.transpose(-1, -2)) + torch.log(L.to(f32))
    pooled = pooled.masked_fill(exact if p.tail else torch.ones_like(exact), -math.inf)
    pooled = pooled[:, :, tok_block]                       # (B, H, T, n)

    logits = torch.cat([e, pooled], dim=-1)
    values = torch.cat([v, vm], dim=2)                     # (B, H, T + n, D)
    mx = logits.amax(dim=-1, keepdim=True)
    all_masked = torch.isneginf(mx)
    w = torch.exp(logits - torch.where(all_masked, torch.zeros_like(mx), mx))
    out = (w @ values) / w.sum(-1, keepdim=True).clamp_min(torch.finfo(f32).tiny)
    out = torch.where(all_masked, torch.zeros_like(out), out)
    out = out.permute(0, 2, 1, 3).to(p.v.dtype)            # (B, T, H, D)

    if p.coarse_gate is not None:
        a = torch.softmax(scale * (qm @ km.transpose(-1, -2)), dim=-1)   # (B, H, n, n)
        coarse = (a @ vm)[:, :, tok_block].permute(0, 2, 1, 3)          # (B, T, H, D)
        out = out + (p.coarse_gate.to(f32) * coarse).to(p.v.dtype)
    return out.contiguous()


class ReferenceBackend(Backend):
    name = "reference"
    description = "SPEC.md literally in fp32 with dense T x T scores (the oracle); small problems only"
    devices = None  # plain torch ops: runs wherever torch runs
    uses_plan = False

    def problem_reasons(self, problem: Problem) -> List[str]:
        need = estimated_bytes(problem.B, problem.H, problem.T)
        if need > budget.bytes:
            return [f"would need about {_gib(need)} for dense T x T scores "
                    f"(B={problem.B}, H={problem.H}, T={problem.T}), over its budget of "
                    f"{_gib(budget.bytes)} (solattn.set_memory_budget(nbytes, backend='reference'))"]
        return []

    def forward(self, problem: Problem, plan=None) -> torch.Tensor:
        return reference_forward(problem)
