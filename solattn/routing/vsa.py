"""VSA (video sparse attention) selection, as FastVideo's VSA-H3 backend defines it.

The VSA entry point (:mod:`solattn.op.video`) lays a packed sequence out as prefix tiles
(text, audio, ... each segment cut into its own 64-row tiles) followed by the video cubes.
With ``S = scale * qm km^T`` over all ``n`` tiles (pooled means over live rows):

- ``k_vid = max(1, min(ceil((1 - sparsity) * n_video), n_video))`` (Python floats);
  ``k_vid == n_video`` makes every tile attend every tile;
- "exempt": a video query tile keeps every prefix key tile plus the ``k_vid`` video key
  tiles of largest ``S``; "compete": the ``min(k_vid + n_prefix, n)`` tiles of largest ``S``
  over the whole row;
- prefix query tiles attend every key tile.

A tie at the boundary keeps the whole tied group, as ``sol_attn``'s top-k mode does. No
forced neighbours, no tail. The coarse term, when the call has a gate, is the plan's one
coarse formula over all tiles.
"""

from __future__ import annotations

import math
from typing import FrozenSet, Optional, Tuple

import torch

from ..validation import Problem
from .plan import CallPlan, Selector, assemble_plan
from .select import default_topk_method, kth_largest
from .stats import BlockStats, block_stats

PREFIX_MODES = ("exempt", "compete")


def vsa_topk_from_sparsity(sparsity: float, n_video: int) -> int:
    """``k_vid = max(1, min(ceil((1 - sparsity) * n_video), n_video))`` in Python floats.

    This is FastVideo's rule, rounding included: ``(1 - 0.7) * 10`` is ``3.0000000000000004``
    in floats, so sparsity 0.7 keeps 4 of 10 video tiles (a VSA-trained model saw that count).
    """
    return max(1, min(math.ceil((1 - float(sparsity)) * n_video), n_video))


def vsa_competition(n: int, k_vid: int, num_prefix_blocks: int, mode: str) -> Tuple[int, bool, int]:
    """VSA's arguments checked against ``n`` tiles, as ``(P, exempt, kk)``: the number of prefix
    tiles, whether they are exempt from the competition (every video row keeps them all), and how
    many competing tiles a video row keeps (``k_vid``, or ``min(k_vid + P, n)`` in "compete"). The
    torch rule (:func:`vsa_selector`) and the fused one (:func:`.fused.vsa_rule`) both start here."""
    P, n_video = int(num_prefix_blocks), n - int(num_prefix_blocks)
    if not 0 <= P < n:
        raise ValueError(f"VSA selection: argument 'num_prefix_blocks' received {num_prefix_blocks!r}; "
                         f"allowed: an int 0 <= num_prefix_blocks < n = {n}")
    if isinstance(k_vid, bool) or not isinstance(k_vid, int) or not 1 <= k_vid <= n_video:
        raise ValueError(f"VSA selection: argument 'k_vid' received {k_vid!r}; "
                         f"allowed: an int 1 <= k_vid <= {n_video} (the number of video tiles)")
    if mode not in PREFIX_MODES:
        raise ValueError(f"VSA selection: argument 'mode' received {mode!r}; allowed: one of {PREFIX_MODES}")
    exempt = mode == "exempt" or P == 0
    return P, exempt, k_vid if exempt else min(k_vid + P, n)


def vsa_selector(stats: BlockStats, k_vid: int, num_prefix_blocks: int = 0, mode: str = "exempt",
                 scale: float = 1.0, topk_method: Optional[str] = None) -> Selector:
    """The chunk rule of VSA's selection (see the module docstring); validated arguments."""
    B, H, n, D = stats.qm.shape
    P, exempt, kk = vsa_competition(n, k_vid, num_prefix_blocks, mode)
    n_video = n - P
    G, dev = B * H, stats.qm.device
    qm, km = stats.qm.reshape(G, n, D), stats.km.reshape(G, n, D)
    method = topk_method or default_topk_method(dev, n_video if exempt else n)

    def select(g0: int, g1: int, i0: int, i1: int) -> torch.Tensor:
        if k_vid == n_video:                             # the whole call is dense
            return torch.ones(g1 - g0, i1 - i0, n, dtype=torch.bool, device=dev)
        S = (qm[g0:g1, i0:i1] @ km[g0:g1].transpose(-1, -2)).mul_(scale)
        if exempt:
            video = S[..., P:]
            exact = torch.ones(S.shape, dtype=torch.bool, device=dev)
            exact[..., P:] = video >= kth_largest(video, kk, method)[..., None]
        else:
            exact = S >= kth_largest(S, kk, method)[..., None]
        if i0 < P:                                       # prefix query tiles attend everything
            exact[:, :P - i0] = True
        return exact

    return select


@torch.no_grad()
def select_vsa(stats: BlockStats, k_vid: int, num_prefix_blocks: int = 0, mode: str = "exempt",
               scale: float = 1.0, topk_method: Optional[str] = None) -> torch.Tensor:
    """VSA's selection as a dense ``(B, H, n, n)`` bool mask, in one chunk (for inspection and
    tests; :func:`build_vsa_plan` never forms it)."""
    B, H, n, _ = stats.qm.shape
    rule = vsa_selector(stats, k_vid, num_prefix_blocks, mode, scale, topk_method)
    return rule(0, B * H, 0, n).view(B, H, n, n)


def build_vsa_plan(problem: Problem, k_vid: int, num_prefix_blocks: int = 0, mode: str = "exempt",
                   topk_method: Optional[str] = None, fused: bool = False,
                   extras: FrozenSet[str] = frozenset()) -> CallPlan:
    """The routing plan of a VSA call.

    ``problem`` is the tiled layout (prefix tiles, then cube tiles, ``block_len`` set, no tail);
    its ``coarse_gate``, when set, makes the plan carry the coarse term over all tiles.
    ``fused=True``: from the Triton kernels where :func:`.fused.fused_plan_usable` allows it, as
    :func:`solattn.routing.build_plan` does (``kv_indices`` then ``n`` wide, for the ``triton``
    backend; ``extras`` as there).
    """
    if fused:
        from .fused import fused_plan, fused_plan_usable, vsa_rule
        if fused_plan_usable(problem):
            return fused_plan(problem, vsa_rule(*vsa_competition(problem.n, k_vid, num_prefix_blocks, mode)),
                              extras)
    stats = block_stats(problem)
    rule = vsa_selector(stats, k_vid, num_prefix_blocks, mode, problem.scale, topk_method)
    return assemble_plan(problem, stats, rule, tail=False, coarse=problem.coarse_gate is not None)
