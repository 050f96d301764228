"""Routing: block statistics, selection and the plan backends consume.

- :mod:`.stats`: live lengths and fp32 block means over live rows.
- :mod:`.select`: ``sol_attn``'s selection (tau or top-k, plus forced blocks).
- :mod:`.vsa`: VSA's selection (FastVideo's VSA-H3 rule).
- :mod:`.plan`: the :class:`Plan` (an ordered selection, no values), the :class:`CallPlan` a
  backend runs (a selection plus one call's tail, coarse and centring terms) and their assembly,
  chunked to fit the memory budget.

Backends that consume a :class:`Plan` (``sdpa``, ``triton``) never re-derive selection;
the ``reference`` backend does not import this package.
"""

from __future__ import annotations

from typing import FrozenSet, Optional

from ..validation import Problem
from .plan import (BYTES_PER_SCORE, CallPlan, Plan, Selector, assemble_plan, check_plan, coarse_rows,
                   indices_from_mask, plan_chunks, plan_with_values, tail_rows)
from .select import (TOPK_METHODS, default_topk_method, force_blocks_, kth_largest,
                     select_exact, sink_mask, sol_attn_selector, topk_count)
from .stats import BlockStats, block_means, block_stats, live_lengths, live_token_mask
from .vsa import PREFIX_MODES, build_vsa_plan, select_vsa, vsa_selector, vsa_topk_from_sparsity


def build_plan(problem: Problem, topk_method: Optional[str] = None, fused: bool = False,
               extras: FrozenSet[str] = frozenset()) -> CallPlan:
    """The routing plan of a ``sol_attn`` call (SPEC.md, "The routing plan").

    ``fused=True`` lets a caller whose backend takes a ``kv_indices`` wider than the largest
    count (padded with 0; the ``triton`` backend) get the plan from Triton kernels without
    a host synchronisation, where :func:`.fused.fused_plan_usable` allows it (CUDA, no autograd
    graph); everywhere else, and by default, the torch path below builds it. ``extras``: what
    the fused plan also makes for the backend (:data:`.fused.PLAN_EXTRAS`; the torch path makes
    none, the backend then makes them itself).
    """
    if fused:
        from .fused import fused_plan, fused_plan_usable
        if fused_plan_usable(problem):
            return fused_plan(problem, extras=extras)
    stats = block_stats(problem)
    rule = sol_attn_selector(problem, stats, topk_method)
    return assemble_plan(problem, stats, rule, tail=problem.tail, coarse=problem.coarse_gate is not None)


__all__ = ["BYTES_PER_SCORE", "BlockStats", "CallPlan", "PREFIX_MODES", "Plan", "Selector", "TOPK_METHODS",
           "assemble_plan", "block_means", "block_stats", "build_plan", "build_vsa_plan", "check_plan", "coarse_rows",
           "default_topk_method", "force_blocks_", "indices_from_mask", "kth_largest",
           "live_lengths", "live_token_mask", "plan_chunks", "plan_with_values", "select_exact", "select_vsa", "sink_mask",
           "sol_attn_selector", "tail_rows", "topk_count", "vsa_selector", "vsa_topk_from_sparsity"]
