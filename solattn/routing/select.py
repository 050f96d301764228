"""``sol_attn``'s selection: the sets ``E_i`` of SPEC.md (tau or top-k, plus forced blocks).

:func:`sol_attn_selector` returns the chunk rule :func:`.plan.assemble_plan` calls for
query-block rows ``[i0, i1)`` of (batch, head) groups ``[g0, g1)``; it forms only that
chunk's ``(rows, n)`` scores.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch

from ..devices import TOPK_METHODS, entry
from ..validation import Problem
from .plan import _SERIAL_SCORES, Selector
from .stats import BlockStats, parallel_cpu, serial_cpu

def default_topk_method(device: torch.device, n: int) -> str:
    """How to find the k-th largest routing score on this device.

    ``torch.topk`` is reported to fail above 4096 fp32 elements, so rows longer than 4096
    blocks use a full sort (exact, same result); so does a device whose entry says so
    (:mod:`solattn.devices`: XPU, where it is reported to crash above 2048 elements). The
    environment variable ``SOLATTN_TOPK=topk|sort`` overrides the choice.
    """
    env = os.environ.get("SOLATTN_TOPK", "").strip().lower()
    if env:
        if env not in TOPK_METHODS:
            raise ValueError(f"SOLATTN_TOPK received {env!r}; allowed: one of {TOPK_METHODS}")
        return env
    if n > 4096:
        return "sort"
    return entry(device.type).topk


#: scores from which the CPU's search for the k-th largest runs on the caller's threads inside a
#: one-thread section of the plan (:func:`.stats.parallel_cpu`): about 1.5 ms and more on one
#: thread (B=1 T=8192 H=16, 262144 scores: 3.1 ms on one thread, 1.6 ms on two of a 2-core CPU)
_PARALLEL_KTH = 1 << 17


def kth_largest(scores: torch.Tensor, kk: int, method: str) -> torch.Tensor:
    """The ``kk``-th largest value along the last dim (``kk >= 1``), by ``torch.topk`` (the least
    of the ``kk`` largest, unsorted: 5-20 % faster on the CPU than reading the sorted ones) or by a
    sort."""
    if method not in TOPK_METHODS:
        raise ValueError(f"kth_largest: argument 'method' received {method!r}; allowed: one of {TOPK_METHODS}")
    with parallel_cpu(scores.numel() >= _PARALLEL_KTH):
        if method == "topk":
            return scores.topk(kk, dim=-1, sorted=False).values.amin(dim=-1)
        return scores.sort(dim=-1, descending=True).values[..., kk - 1]


def topk_count(topk_ratio: float, n_eff: int) -> int:
    """SPEC.md's ``kk``: 0 when ``n_eff <= 1``, else ``clamp(round(r n_eff), 1, n_eff - 1)``."""
    if n_eff <= 1:
        return 0
    return min(max(round(topk_ratio * n_eff), 1), n_eff - 1)


def sink_mask(rng, n: int, device) -> torch.Tensor:
    """``(n,)`` bool, True inside the clipped ``[start, end)`` range (all False for ``None``)."""
    mask = torch.zeros(n, dtype=torch.bool, device=device)
    if rng is not None:
        mask[rng[0]:rng[1]] = True
    return mask


def force_blocks_(exact: torch.Tensor, problem: Problem, i0: int) -> torch.Tensor:
    """Add the forced blocks to ``exact`` ``(G, rows, n)`` (query blocks ``i0 ...``) in place:
    neighbours ``|i - j| <= 1``, sink key blocks, and every key for ``sink_q`` rows."""
    G, r, n = exact.shape
    ii = torch.arange(i0, i0 + r, device=exact.device)
    band = (ii[:, None] + torch.arange(-1, 2, device=exact.device)).clamp_(0, n - 1)   # (r, 3)
    exact.scatter_(-1, band.expand(G, r, 3), True)
    if problem.sink_blocks is not None:
        exact[..., problem.sink_blocks[0]:problem.sink_blocks[1]] = True
    if problem.sink_q is not None:
        s0, s1 = max(problem.sink_q[0] - i0, 0), min(problem.sink_q[1] - i0, r)
        if s1 > s0:
            exact[:, s0:s1] = True
    return exact


class _ForcedRows:
    """The forced blocks of query-block rows ``[i0, i1)`` as a ``(rows, n)`` bool table, built once
    per row band and OR-ed into every group's selection (one op per chunk instead of a scatter
    and fills per chunk). Only the last band is kept: in whole-group chunks that is the only
    one, and it is no larger than one group's selection."""

    def __init__(self, problem: Problem, n: int, device) -> None:
        self.problem, self.n, self.device = problem, n, device
        self.key, self.table = None, None

    def __call__(self, i0: int, i1: int) -> torch.Tensor:
        if self.key != (i0, i1):
            self.table = None
            self.table = force_blocks_(torch.zeros(1, i1 - i0, self.n, dtype=torch.bool, device=self.device),
                                       self.problem, i0)[0]
            self.key = (i0, i1)
        return self.table


def sol_attn_selector(problem: Problem, stats: BlockStats, topk_method: Optional[str] = None) -> Selector:
    """The chunk rule of ``sol_attn``'s selection (SPEC.md, "Which key blocks are exact")."""
    B, H, n, D = stats.qm.shape
    G, dev = B * H, stats.qm.device
    c = problem.scale * math.log2(math.e)
    with serial_cpu(dev.type == "cpu" and G * n * n < _SERIAL_SCORES):   # block-level ops: small
        qm = stats.qm.reshape(G, n, D)
        kmc = (stats.km - stats.m).reshape(G, n, D)
        var = kmc.pow(2).mean(dim=1) if problem.topk_ratio == 0.0 else None   # population, (G, D)
    if problem.topk_ratio == 0.0:
        kk, sinks, method = 0, None, None
    else:
        sinks = sink_mask(problem.sink_blocks, n, dev)
        n_sinks = problem.sink_blocks[1] - problem.sink_blocks[0] if problem.sink_blocks else 0
        kk = topk_count(problem.topk_ratio, n - n_sinks)
        method = topk_method or default_topk_method(dev, n)

    has_sinks = problem.sink_blocks is not None
    forced_rows = _ForcedRows(problem, n, dev)

    def select(g0: int, g1: int, i0: int, i1: int) -> torch.Tensor:
        q = qm[g0:g1, i0:i1]
        R = (q @ kmc[g0:g1].transpose(-1, -2)).mul_(c)   # (g, rows, n) routing scores
        if problem.topk_ratio == 0.0:
            thr = problem.tau * torch.sqrt(c * c * (q.pow(2) * var[g0:g1, None, :]).sum(-1) + 1e-6)
            exact = R > thr[..., None]
        elif kk > 0:
            cand = R.masked_fill_(sinks, -math.inf) if has_sinks else R
            theta = kth_largest(cand, kk, method)
            exact = cand >= theta[..., None]
            del cand, R                                 # sink columns: forced below
        else:
            exact = torch.zeros(R.shape, dtype=torch.bool, device=dev)
        return exact.logical_or_(forced_rows(i0, i1))

    return select


@torch.no_grad()
def select_exact(problem: Problem, stats: BlockStats, topk_method: Optional[str] = None) -> torch.Tensor:
    """The sets ``E_i`` as a dense ``(B, H, n, n)`` bool mask, in one chunk (for inspection and
    tests; :func:`solattn.routing.build_plan` never forms it)."""
    B, H, n, _ = stats.qm.shape
    return sol_attn_selector(problem, stats, topk_method)(0, B * H, 0, n).view(B, H, n, n)
