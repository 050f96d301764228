"""The ``video_sparse_attn`` front door: :func:`video_sparse_attn` and :func:`video_plan`.

``video_sparse_attn`` follows FastVideo's VSA-H3 backend: a packed sequence of prefix segments
(text, audio, ...; each cut into its own 64-row tiles) and the video cubes is tiled
(:mod:`solattn.tiling`, which also gives :func:`tile` and :func:`untile`), the plan selects key
tiles per query tile (``solattn.routing.vsa``) and carries the coarse term, a backend that
consumes the plan computes fine + gate * coarse, and the result returns in raw token order:
the same :class:`~.call.Call` and custom op as ``sol_attn``, on VSA's route
(:class:`solattn.op.route.VideoRoute`).
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence, Tuple, Union

import torch

from .. import tiling
from ..routing import PREFIX_MODES, Plan, check_plan, vsa_topk_from_sparsity
from ..tiling import DEFAULT_CUBE, check_grid_cube, num_cubes
from ..validation import SUPPORTED_DTYPES, finite, validate
from ..validation import fail as _fail
from .call import Call
from .custom import call_op
from .route import VideoRoute, plan_backend

__all__ = ["video_sparse_attn", "video_plan"]


def video_sparse_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid, *,
                      sparsity: Optional[float] = None, topk: Optional[int] = None,
                      gate: Union[torch.Tensor, float, None] = None, scale: Optional[float] = None,
                      backend: Optional[str] = None, prefix_len: Union[int, Sequence[int]] = 0,
                      prefix_mode: str = "exempt", plan: Optional[Plan] = None) -> torch.Tensor:
    """Video sparse attention with FastVideo's VSA-H3 semantics (SPEC.md, "VSA entry point"),
    in the model's raw (packed) token order.

    Args:
        q, k, v: ``(B, P + t*h*w, H, D)``, bf16 / fp16 / fp32, one shape, dtype and device. The
            first ``P = sum(prefix_len)`` tokens are prefix segments (text, audio, ...) in packed
            order, the rest the video latent in raster order (t slowest).
        grid: ``(t, h, w)`` of the video latent.
        sparsity: ``k_vid = max(1, min(ceil((1 - sparsity) * n_video), n_video))`` video tiles
            kept per query tile, evaluated in Python floats as FastVideo does (``0 <= sparsity <= 1``;
            ``n_video`` = number of video cubes). Give exactly one of sparsity, topk.
        topk: ``k_vid`` directly, ``>= 1`` (values above ``n_video`` keep every tile).
        gate: the coarse branch's gate, used as is (no sigmoid). ``None``: no coarse branch
            (fine attention only, as FastVideo's H3 backend without a gate). A tensor of q's shape
            (``to_gate_compress`` output), or of the video part ``(B, t*h*w, H, D)`` (prefix rows
            then get gate 0). A Python number: that constant gate on every row; ``gate=1.0`` is
            FastVideo's kernel-level convention (coarse + fine when no gate is given).
        scale: logit scale, default ``D ** -0.5``.
        backend: force a backend by name; only backends that consume routing plans qualify.
        prefix_len: an int (one prefix segment) or a sequence of segment lengths in packed order,
            each ``>= 0`` (empty segments are dropped). Each segment gets its own zero-padded
            64-row tiles.
        prefix_mode: ``"exempt"`` (default): every prefix key tile is kept on top of the ``k_vid``
            best video tiles; ``"compete"``: the ``min(k_vid + n_prefix_tiles, n)`` best tiles of
            the whole row.
        plan: a selection to hold, from :func:`video_plan` on tensors of this batch, layout
            (grid and prefix), head count and device (checked), instead of the one the call would
            route to. Only its kept tiles are taken: the coarse term comes from this call's q, k,
            v and gate (with or without a gate, whatever the plan was built with). The selection
            is a constant of the call (no gradient); the call's own terms have gradients.

    Selection ranks ``S = scale * qm km^T`` (fp32 means over live rows, uncentred) per query
    tile; ties at the boundary are all kept. Prefix query tiles attend every tile; with
    ``k_vid == n_video`` every tile attends every tile (dense). No forced neighbours, no tail.
    Coarse branch (with a gate): ``softmax_j(S[i, j]) vm_j`` over all tiles, prefix included,
    added as ``gate_t * coarse_i`` to every row t of tile i, prefix rows too.

    Returns:
        ``(B, P + t*h*w, H, D)`` contiguous, v's dtype. Differentiable in q, k, v and a tensor
        gate when the chosen backend supports autograd (the selection is treated as constant).
    """
    fn = "video_sparse_attn"
    grid, segments, k_vid, gate = _checked(fn, q, k, v, grid, sparsity, topk, gate, scale, backend, prefix_len,
                                           prefix_mode)
    if plan is not None:
        B, _, H, D = q.shape
        plan = check_plan(fn, plan, B, H, tiling.tiled_rows(grid, segments), q.device)
    # the scale and the gate of sol_attn's arguments, and VSA's layout and selection (no tail,
    # sinks or bias)
    return call_op(fn, Call(q, k, v, gate=gate, scale=None if scale is None else float(scale), grid=list(grid),
                            k_vid=int(k_vid), segments=list(segments), prefix_mode=prefix_mode,
                            backend=backend or "", plan=plan))


def video_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid, *,
               sparsity: Optional[float] = None, topk: Optional[int] = None,
               gate: Union[torch.Tensor, float, None] = None, scale: Optional[float] = None,
               backend: Optional[str] = None, prefix_len: Union[int, Sequence[int]] = 0,
               prefix_mode: str = "exempt") -> Plan:
    """The selection :func:`video_sparse_attn` routes to for these arguments, in its tiled layout
    (``seq_len``: the tiled rows): VSA's kept tiles, no value of q, k or v. Pass it back as
    ``video_sparse_attn(..., plan=p)`` on other tensors of this layout (another layer, another
    denoising step): they run with this selection held. Built without autograd (see
    :func:`solattn.plan`); the gate does not change the selection."""
    fn = "video_plan"
    grid, segments, k_vid, gate = _checked(fn, q, k, v, grid, sparsity, topk, gate, scale, backend, prefix_len,
                                           prefix_mode)
    route = VideoRoute(Call(q, k, v, scale=None if scale is None else float(scale), grid=list(grid),
                            k_vid=int(k_vid), segments=list(segments), prefix_mode=prefix_mode))
    with torch.no_grad():        # the backend's problem: tiled copies, or the caller's tensors and the row table
        problem, chosen = route.prepare(route.call, route.requested(backend or None), False)
        return route.build(problem, fused=getattr(chosen, "fused_plan", False)).selection()


def _checked(fn: str, q, k, v, grid, sparsity, topk, gate, scale, backend, prefix_len, prefix_mode):
    """Every argument of :func:`video_sparse_attn` checked: ``(grid, segments, k_vid, gate)``."""
    try:
        validate(q, k, v, scale=scale)
    except (TypeError, ValueError) as err:  # same checks as sol_attn, named after this function
        raise type(err)(str(err).replace("sol_attn:", f"{fn}:", 1)) from None
    grid, cube = check_grid_cube(fn, grid, DEFAULT_CUBE)
    segments = _check_segments(fn, prefix_len)
    if not isinstance(prefix_mode, str):
        _fail(fn, "prefix_mode", repr(prefix_mode), f"one of {PREFIX_MODES}", TypeError)
    if prefix_mode not in PREFIX_MODES:
        _fail(fn, "prefix_mode", repr(prefix_mode), f"one of {PREFIX_MODES}")
    P = sum(segments)
    n_video_tokens = math.prod(grid)
    B, T, H, D = q.shape
    if T != P + n_video_tokens:
        _fail(fn, "q", f"a tensor of shape {tuple(q.shape)}",
              f"T = prefix + t*h*w = {P} + {n_video_tokens} = {P + n_video_tokens} "
              f"tokens on dim 1 for grid={grid}, prefix_len={prefix_len!r}")
    n_video = num_cubes(grid, cube)
    k_vid = _resolve_topk(fn, sparsity, topk, n_video)
    gate = _check_gate(fn, gate, q, P, n_video_tokens)
    plan_backend(backend)                          # a backend that cannot serve VSA: refuse now
    return grid, segments, k_vid, gate


def _check_segments(fn: str, prefix_len) -> Tuple[int, ...]:
    """``prefix_len`` -> the tuple of non-empty segment lengths."""
    allowed = "an int >= 0 or a sequence of ints >= 0 (prefix segment lengths in packed order)"
    values = list(prefix_len) if isinstance(prefix_len, (list, tuple)) else [prefix_len]
    if not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in values):
        _fail(fn, "prefix_len", repr(prefix_len), allowed, TypeError)
    if any(x < 0 for x in values):
        _fail(fn, "prefix_len", repr(prefix_len), allowed)
    return tuple(int(x) for x in values if x > 0)


def _resolve_topk(fn: str, sparsity, topk, n_video: int) -> int:
    if (sparsity is None) == (topk is None):
        _fail(fn, "sparsity/topk", f"sparsity={sparsity!r}, topk={topk!r}",
              "exactly one of them (sparsity: a float in [0, 1]; topk: an int >= 1)")
    if topk is not None:
        if isinstance(topk, bool) or not isinstance(topk, numbers.Integral):
            _fail(fn, "topk", f"{topk!r} of type {type(topk).__name__}", "an int >= 1", TypeError)
        if topk < 1:
            _fail(fn, "topk", repr(topk), "an int >= 1 (values above the number of cubes keep all)")
        return min(int(topk), n_video)
    if isinstance(sparsity, bool) or not isinstance(sparsity, numbers.Real):
        _fail(fn, "sparsity", f"{sparsity!r} of type {type(sparsity).__name__}",
              "a float 0 <= sparsity <= 1", TypeError)
    if not 0.0 <= float(sparsity) <= 1.0:           # False for nan too (and traceable, unlike isfinite)
        _fail(fn, "sparsity", repr(sparsity), "a float 0 <= sparsity <= 1")
    return vsa_topk_from_sparsity(float(sparsity), n_video)


def _check_gate(fn: str, gate, q: torch.Tensor, prefix_len: int, n_video_tokens: int):
    """None or a tensor of q's shape: a number's fp32 value as a stride-0 view (a constant gate),
    a video-shaped gate with its prefix rows filled with 0."""
    if gate is None:
        return None
    B, T, H, D = q.shape
    video_shape = (B, n_video_tokens, H, D)

    def refuse(received: str, kind=ValueError):       # the messages are built only when refused
        _fail(fn, "gate", received, f"None, a real number within fp32's range (a constant gate) or a float tensor "
              f"(bf16, fp16 or fp32) of q's shape {tuple(q.shape)} or of the video part's shape {video_shape}, "
              f"on {q.device}", kind)

    if not isinstance(gate, torch.Tensor):
        if not isinstance(gate, numbers.Real) or isinstance(gate, bool):
            refuse(type(gate).__name__, TypeError)
        if not finite(float(gate)):
            refuse(repr(gate))
        # one value for every row: a stride-0 view of q's shape, read as any gate is
        return torch.tensor(float(gate), dtype=torch.float32, device=q.device).expand(q.shape)
    wrong_dtype = gate.dtype not in SUPPORTED_DTYPES
    if wrong_dtype or gate.device != q.device or tuple(gate.shape) not in (tuple(q.shape), video_shape):
        refuse(f"a tensor of shape {tuple(gate.shape)}, dtype {gate.dtype}, device {gate.device}",
               TypeError if wrong_dtype else ValueError)
    if tuple(gate.shape) == tuple(q.shape) or prefix_len == 0:
        return gate
    return torch.cat([gate.new_zeros(B, prefix_len, H, D), gate], dim=1)
