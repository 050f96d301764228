"""Video sparse attention (VSA): the cube token layout and the ``video_sparse_attn`` entry point.

A ``(t, h, w)`` latent grid in raster order (t slowest, w fastest) is cut into cubes
(4x4x4 by default, 64 tokens = one routing block). Cubes are numbered in t, then h, then w
order; inside a cube the tokens keep raster order. Edge cubes of grids not divisible by the
cube are partial: their tokens occupy the front of the cube's 64-slot block, the remaining
slots are dead (zero), and the live counts are the ``block_len`` table of SPEC.md.

``video_sparse_attn`` follows FastVideo's VSA-H3 backend: a packed sequence of prefix segments
(text, audio, ...; each cut into its own 64-row tiles) and the video cubes is tiled, the plan
selects key tiles per query tile (``solattn.routing.vsa``) and carries the coarse term, a
backend that consumes the plan computes fine + gate * coarse, and the result returns in raw
token order.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from . import dispatch
from .backends.base import Backend
from .ops import (PLANS, _fake_fused, autograd_dispatch, backward_buffers, backward_grads, check_transforms,
                  eager_call, fake_grads, forward_settings, fused_grads, fused_plan_allowed, grads_as_outputs,
                  own_backward, plain_eager, recompute_grads, run_for_backward)
from .routing import PREFIX_MODES, build_vsa_plan, vsa_topk_from_sparsity
from .validation import BLOCK, SUPPORTED_DTYPES, Problem, finite, validate
from .validation import fail as _fail

Grid = Tuple[int, int, int]
DEFAULT_CUBE: Grid = (4, 4, 4)


def _check_triple(fn: str, arg: str, value, what: str) -> Grid:
    allowed = f"a tuple of 3 positive ints {what}"
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        _fail(fn, arg, repr(value), allowed, TypeError)
    if not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in value):
        _fail(fn, arg, repr(tuple(value)), allowed, TypeError)
    value = tuple(int(x) for x in value)
    if min(value) < 1:
        _fail(fn, arg, repr(value), allowed)
    return value


def _check_grid_cube(fn: str, grid, cube) -> Tuple[Grid, Grid]:
    grid = _check_triple(fn, "grid", grid, "(t, h, w), the latent grid")
    cube = _check_triple(fn, "cube", cube, f"(ct, ch, cw) whose product is {BLOCK} (one routing block)")
    if math.prod(cube) != BLOCK:
        _fail(fn, "cube", f"{cube} (volume {math.prod(cube)})",
              f"a cube of volume exactly {BLOCK} = solattn.BLOCK tokens, e.g. (4, 4, 4), (1, 8, 8), (2, 4, 8)")
    return grid, cube


def num_cubes(grid: Grid, cube: Grid = DEFAULT_CUBE) -> int:
    """Number of (possibly partial) cubes, i.e. routing blocks, of a grid."""
    return math.prod([-(-g // c) for g, c in zip(grid, cube)])


def _cube_slots(grid: Grid, cube: Grid) -> Tuple[torch.Tensor, torch.Tensor]:
    """Raw token -> slot of the tiled layout, ``(t*h*w,)`` int64, and ``block_len`` ``(n,)`` int32 (CPU)."""
    counts = [-(-g // c) for g, c in zip(grid, cube)]              # cubes per axis
    coords = torch.meshgrid(*[torch.arange(g) for g in grid], indexing="ij")
    cube_idx = [x // c for x, c in zip(coords, cube)]              # which cube along each axis
    offset = [x % c for x, c in zip(coords, cube)]                 # position inside that cube
    # live extent of each token's cube along each axis (edge cubes are cut by the grid)
    extent = [torch.clamp(g - i * c, max=c) for g, i, c in zip(grid, cube_idx, cube)]
    cube_id = (cube_idx[0] * counts[1] + cube_idx[1]) * counts[2] + cube_idx[2]
    pos = (offset[0] * extent[1] + offset[1]) * extent[2] + offset[2]  # raster order in the live box
    slots = (cube_id * BLOCK + pos).reshape(-1)

    def axis_len(g, c, k):
        return torch.clamp(g - torch.arange(k) * c, max=c)

    lt, lh, lw = (axis_len(g, c, k) for g, c, k in zip(grid, cube, counts))
    block_len = (lt[:, None, None] * lh[None, :, None] * lw[None, None, :]).reshape(-1)
    return slots, block_len.to(torch.int32)


class _Layout(NamedTuple):
    """Index tables of one tiled layout (all on the target device)."""

    slots: torch.Tensor          # (tokens,) int64: row of the tiled sequence of every raw token
    gather: torch.Tensor         # (rows,) int64: raw token of every tiled row (0 for dead rows)
    dead: Optional[torch.Tensor]  # (dead rows,) int64, or None when every row is live
    block_len: torch.Tensor      # (n,) int32 live rows per block
    num_prefix_blocks: int


@functools.lru_cache(maxsize=64)
def _layout(grid: Grid, cube: Grid, segments: Tuple[int, ...], device: torch.device) -> _Layout:
    """The tiled layout of prefix segments (lengths ``segments``, packed in that order) followed by
    a video grid: each segment's own 64-row tiles (its last one partial), then the cube blocks.
    Cached per arguments, so a model's repeated calls pay for one gather per tensor and nothing else."""
    video_slots, video_len = _cube_slots(grid, cube)
    prefix_slots, prefix_lens, tile = [], [], 0
    for length in segments:                         # a segment's row r sits in row r of its tiles
        prefix_slots.append(torch.arange(length) + tile * BLOCK)
        prefix_lens += [min(BLOCK, length - BLOCK * j) for j in range(-(-length // BLOCK))]
        tile += -(-length // BLOCK)
    slots = torch.cat(prefix_slots + [video_slots + tile * BLOCK])
    block_len = torch.cat([torch.tensor(prefix_lens, dtype=torch.int32), video_len])
    rows = block_len.shape[0] * BLOCK
    gather = torch.zeros(rows, dtype=torch.int64)
    gather[slots] = torch.arange(slots.shape[0])
    live = torch.zeros(rows, dtype=torch.bool)
    live[slots] = True
    dead = torch.nonzero(~live).squeeze(1)
    return _Layout(slots=slots.to(device), gather=gather.to(device),
                   dead=dead.to(device) if dead.numel() else None, block_len=block_len.to(device),
                   num_prefix_blocks=tile)


def _to_tiled(x: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """Raw tokens (dim 1) -> tiled rows: one gather, then zeros written into the dead rows only."""
    tiled = x.index_select(1, layout.gather)
    return tiled if layout.dead is None else tiled.index_fill_(1, layout.dead, 0)


def _check_tokens(fn: str, arg: str, x, expected: int, what: str):
    allowed = f"a tensor of shape (B, {expected}, ...) with tokens on dim 1 ({what})"
    if not isinstance(x, torch.Tensor):
        _fail(fn, arg, type(x).__name__, allowed, TypeError)
    if x.dim() < 2 or x.shape[1] != expected:
        _fail(fn, arg, f"a tensor of shape {tuple(x.shape)}", allowed)


def tile(x: torch.Tensor, grid, cube=DEFAULT_CUBE) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reorder raw video tokens into cube blocks.

    Args:
        x: ``(B, t*h*w, ...)`` (typically ``(B, t*h*w, H, D)``), tokens in raster order, t slowest.
        grid: ``(t, h, w)``.
        cube: cube shape, volume 64 (default ``(4, 4, 4)``).

    Returns:
        ``(tiled, block_len)``: ``tiled`` is ``(B, 64 n, ...)`` with ``n`` cubes in t, h, w order,
        each cube's live tokens in raster order at the front of its 64 rows and zeros after;
        ``block_len`` is the ``(n,)`` int32 live count per cube, on x's device.
    """
    grid, cube = _check_grid_cube("tile", grid, cube)
    _check_tokens("tile", "x", x, math.prod(grid), f"t*h*w for grid={grid}")
    layout = _layout(grid, cube, (), x.device)
    return _to_tiled(x, layout), layout.block_len


def untile(y: torch.Tensor, grid, cube=DEFAULT_CUBE) -> torch.Tensor:
    """Inverse of :func:`tile`: ``(B, 64 n, ...)`` cube blocks -> ``(B, t*h*w, ...)`` raw order.

    Dead rows of partial cubes are dropped; ``untile(tile(x, grid)[0], grid)`` equals ``x`` exactly.
    """
    grid, cube = _check_grid_cube("untile", grid, cube)
    rows = num_cubes(grid, cube) * BLOCK
    _check_tokens("untile", "y", y, rows, f"64 x {rows // BLOCK} cubes for grid={grid}, cube={cube}")
    return y.index_select(1, _layout(grid, cube, (), y.device).slots)


def _explicit_backend(requested: Optional[str]) -> Optional[Backend]:
    """The backend asked for by ``backend=`` or ``use_backend``, checked to consume plans; or None.

    The ``reference`` backend recomputes ``sol_attn``'s own selection and ignores plans, so it
    cannot serve VSA: asking for it (or for any backend with ``uses_plan=False``) is an error.
    """
    explicit = requested or dispatch.forced_backend()
    if not explicit:
        return None
    backend = dispatch.get_backend(explicit)
    if not backend.uses_plan:
        usable = [n for n in dispatch.registered() if dispatch.get_backend(n).uses_plan]
        raise dispatch.BackendError(
            f"video_sparse_attn: backend '{backend.name}' cannot serve VSA: it does not consume a "
            f"routing plan, so it would apply sol_attn's own selection instead of VSA's. "
            f"Backends that consume plans: {', '.join(usable) or 'none registered'}")
    return backend


def _plan_backend(problem: Problem, explicit: Optional[Backend]) -> Backend:
    """The backend that runs the fine stage: ``dispatch.choose`` restricted to backends that
    consume a routing plan (explicit choice, ``use_backend``, ``SOLATTN_BACKEND`` as a preference
    that warns when it falls back, then the device's priority list)."""
    return dispatch.choose(problem, explicit.name if explicit is not None else None, plan_only=True)


def video_sparse_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid, *,
                      sparsity: Optional[float] = None, topk: Optional[int] = None,
                      gate: Union[torch.Tensor, float, None] = None, scale: Optional[float] = None,
                      backend: Optional[str] = None, prefix_len: Union[int, Sequence[int]] = 0,
                      prefix_mode: str = "exempt") -> torch.Tensor:
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
    try:
        validate(q, k, v, scale=scale)
    except (TypeError, ValueError) as err:  # same checks as sol_attn, named after this function
        raise type(err)(str(err).replace("sol_attn:", f"{fn}:", 1)) from None
    grid, cube = _check_grid_cube(fn, grid, DEFAULT_CUBE)
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
    _explicit_backend(backend)                      # a backend that cannot serve VSA: refuse now
    want_lse = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v, gate))
    args = (q, k, v, list(grid), int(k_vid), gate, None if scale is None else float(scale),
            backend or "", list(segments), prefix_mode, want_lse)
    if not want_lse and plain_eager(q, k, v, gate):
        # through the cuda_graphs() cache when one is active: the fused plan (CUDA, triton) has no
        # host syncs, other plans stay eager; the cached layout's tables are read too, so they key
        layout = _layout(grid, cube, segments, q.device)
        return eager_call(lambda: _vsa_op_forward(*args)[0], (q, k, v, gate, *layout[:3], layout.block_len),
                          ("video_sparse_attn", *args[3:5], *args[6:]))
    check_transforms("video_sparse_attn", (q, k, v, gate))
    return _vsa_op(*args)[0]


def _tiled_gate(gate, tq: torch.Tensor, layout: _Layout):
    """The coarse gate in the tiled layout (None, a 0-dim constant, or a tensor of q's shape)."""
    if gate is None:
        return None
    return gate.expand(tq.shape) if gate.dim() == 0 else _to_tiled(gate, layout)


def _tiled_problem(tq, tk, tv, scale, layout: _Layout, gate) -> Problem:
    """The problem of a call in the tiled layout (``gate`` tiled too), marked ``dead_rows_zero``:
    :func:`_to_tiled` wrote zeros into the dead rows, so block sums and TMA loads may read them.
    The forward and the backward's rebuild take it from here, so both sum the same way."""
    problem = validate(tq, tk, tv, scale=scale, tail=False, block_len=layout.block_len, coarse_gate=gate)
    return dataclasses.replace(problem, dead_rows_zero=True)


def _vsa_forward(q, k, v, grid, k_vid: int, gate, scale, backend: Optional[str], segments, mode: str,
                 buffers: Optional[Tuple[torch.Tensor, torch.Tensor]] = None):
    """The computation behind ``video_sparse_attn`` (validated arguments; ``gate``: None, a 0-dim
    tensor (a constant gate) or a tensor of q's shape). With ``buffers`` (``(lse, resid)`` from
    :func:`backward_buffers` in the tiled layout) returns ``(out, fused)`` as
    :func:`run_for_backward` does; else the output."""
    explicit = _explicit_backend(backend)
    layout = _layout(tuple(grid), DEFAULT_CUBE, tuple(segments), q.device)
    tq, tk, tv = (_to_tiled(x, layout) for x in (q, k, v))
    tg = _tiled_gate(gate, tq, layout)              # the backend applies plan.coarse with it
    problem = _tiled_problem(tq, tk, tv, scale, layout, tg)
    chosen = _plan_backend(problem, explicit)
    want_lse = buffers is not None and buffers[0].numel() > 0
    plan = build_vsa_plan(problem, k_vid, layout.num_prefix_blocks, mode,
                          fused=fused_plan_allowed(chosen, problem, want_lse))
    if buffers is None:
        return chosen.forward(problem, plan).index_select(1, layout.slots)    # (B, T, H, D), v's dtype
    out, fused = run_for_backward(chosen, problem, plan, *buffers)
    return out.index_select(1, layout.slots), fused


# ``video_sparse_attn`` is the torch.library custom op ``solattn::video_sparse_attn``: the routing
# plan has data-dependent sizes, so torch.compile must see one opaque node (fake implementation
# below). Autograd recomputes the forward through a differentiable backend, as for ``sol_attn``.
def _vsa_op_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: List[int], k_vid: int,
                    gate: Optional[torch.Tensor], scale: Optional[float], backend: str,
                    segments: List[int], mode: str, want_lse: bool):
    """``(out, lse, resid, fused)`` as ``solattn::sol_attn`` returns them; ``lse`` and ``resid`` in
    the tiled layout."""
    with torch.no_grad():
        buffers = backward_buffers(q, v, want_lse, _tiled_rows(grid, segments))
        out, fused = _vsa_forward(q, k, v, grid, k_vid, gate, scale, backend or None, segments, mode, buffers)
        return (out, *buffers, fused)


@torch.library.custom_op("solattn::video_sparse_attn", mutates_args=())
def _vsa_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: List[int], k_vid: int,
            gate: Optional[torch.Tensor], scale: Optional[float], backend: str,
            segments: List[int], mode: str, want_lse: bool
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See :func:`_vsa_op_forward`."""
    return _vsa_op_forward(q, k, v, grid, k_vid, gate, scale, backend, segments, mode, want_lse)


def _tiled_rows(grid, segments) -> int:
    """Rows of the tiled layout: 64 per prefix tile and per cube."""
    return (num_cubes(tuple(grid), DEFAULT_CUBE) + sum(-(-s // BLOCK) for s in segments)) * BLOCK


@_vsa_op.register_fake
def _(q, k, v, grid, k_vid, gate, scale, backend, segments, mode, want_lse):
    return (torch.empty(q.shape, dtype=v.dtype, device=v.device),
            *backward_buffers(q, v, want_lse, _tiled_rows(grid, segments)), _fake_fused())


def _vsa_setup_context(ctx, inputs, output):
    q, k, v, grid, k_vid, gate, scale, backend, segments, mode, want_lse = inputs
    out, lse, resid, fused = output
    ctx.mark_non_differentiable(lse, resid, fused)
    ctx.save_for_backward(q, k, v, gate, out, lse, resid, fused)
    ctx.args = (grid, k_vid, scale, backend, segments, mode)
    ctx.settings = forward_settings()
    ctx.plan = PLANS.take(fused)


def _vsa_grads(q, k, v, gate, out, lse, resid, fused, grad_out, grid, k_vid, scale, backend, segments, mode,
               gate_grad: bool, settings=None, plan=None):
    """``(dq, dk, dv, dgate)`` of ``video_sparse_attn`` (``dgate`` None when not asked for): the
    own backward of the backend that ran the forward, else a recomputation through a differentiable backend.
    ``settings``, ``plan``: the forward's context and kept plan, when the backward runs eagerly."""
    own = own_backward(lse, fused)
    if own is not None:
        layout = _layout(tuple(grid), DEFAULT_CUBE, tuple(segments), q.device)
        tq, tk, tv = (_to_tiled(x, layout) for x in (q, k, v))
        tg = _tiled_gate(gate, tq, layout)

        def problem_of(qd, kd, vd):
            return _tiled_problem(qd, kd, vd, scale, layout, tg)

        def make_plan(problem):
            return build_vsa_plan(problem, k_vid, layout.num_prefix_blocks, mode)

        gq, gk, gv, gg, _ = fused_grads(own, problem_of, make_plan, (tq, tk, tv), _to_tiled(out, layout), lse,
                                        resid, _to_tiled(grad_out, layout), bias_grad=False, settings=settings,
                                        saved=plan)
        gq, gk, gv = (g.index_select(1, layout.slots) for g in (gq, gk, gv))
        if gg is not None and gate_grad:
            gg = gg.sum() if gate.dim() == 0 else gg.index_select(1, layout.slots)
            gg = gg.to(gate.dtype)
        else:
            gg = None
        return gq, gk, gv, gg

    def forward(leaves, name):
        return _vsa_forward(*leaves[:3], grid, k_vid, leaves[3], scale, name, segments, mode)

    gq, gk, gv, gg = recompute_grads(forward, (q, k, v, gate), grad_out, backend or None, settings=settings)
    return gq, gk, gv, gg if gate_grad else None


@torch.library.custom_op("solattn::video_sparse_attn_backward", mutates_args=())
def _vsa_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: Optional[torch.Tensor],
                     out: torch.Tensor, lse: torch.Tensor, resid: torch.Tensor, fused: torch.Tensor,
                     grad_out: torch.Tensor, grid: List[int], k_vid: int, scale: Optional[float], backend: str,
                     segments: List[int], mode: str, gate_grad: bool
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of ``solattn::video_sparse_attn`` as one op, for a traced backward (compiled
    training, ``fullgraph=True`` included): :func:`_vsa_grads`, no gate gradient as a ``(0,)`` tensor."""
    with autograd_dispatch():
        grads = _vsa_grads(q, k, v, gate, out, lse, resid, fused, grad_out, grid, k_vid, scale, backend,
                           segments, mode, gate_grad)
    return grads_as_outputs(grads, _vsa_grad_like(q, k, v, gate, gate_grad), (q, k, v, gate, out, grad_out))


def _vsa_grad_like(q, k, v, gate, gate_grad: bool):
    """The inputs the backward op returns gradients for (None: an empty result), for it and its fake."""
    return q, k, v, gate if gate_grad else None


@_vsa_backward_op.register_fake
def _(q, k, v, gate, out, lse, resid, fused, grad_out, grid, k_vid, scale, backend, segments, mode, gate_grad):
    return fake_grads(_vsa_grad_like(q, k, v, gate, gate_grad), q)


def _vsa_backward(ctx, grad_out, _grad_lse, _grad_resid, _grad_fused):
    grid, k_vid, scale, backend, segments, mode = ctx.args
    q, k, v, gate, out, lse, resid, fused = ctx.saved_tensors
    saved = (q, k, v, gate, out, lse, resid, fused, grad_out, grid, k_vid, scale, backend, segments, mode,
             bool(ctx.needs_input_grad[5] and gate is not None))
    gq, gk, gv, gg = backward_grads(ctx, _vsa_backward_op, _vsa_grads, saved, grad_out)
    return gq, gk, gv, None, None, gg, None, None, None, None, None


_vsa_op.register_autograd(_vsa_backward, setup_context=_vsa_setup_context)


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
    """None, a 0-dim fp32 tensor (a constant gate) or a tensor of q's shape (prefix rows of a
    video-shaped gate filled with 0)."""
    if gate is None:
        return None
    B, T, H, D = q.shape
    video_shape = (B, n_video_tokens, H, D)
    allowed = (f"None, a real number (a constant gate) or a float tensor (bf16, fp16 or fp32) of q's "
               f"shape {tuple(q.shape)} or of the video part's shape {video_shape}, on {q.device}")
    if isinstance(gate, numbers.Real) and not isinstance(gate, bool):
        if not finite(float(gate)):
            _fail(fn, "gate", repr(gate), allowed)
        return torch.tensor(float(gate), dtype=torch.float32, device=q.device)
    if not isinstance(gate, torch.Tensor):
        _fail(fn, "gate", type(gate).__name__, allowed, TypeError)
    desc = f"a tensor of shape {tuple(gate.shape)}, dtype {gate.dtype}, device {gate.device}"
    if gate.dtype not in SUPPORTED_DTYPES:
        _fail(fn, "gate", desc, allowed, TypeError)
    if gate.device != q.device or tuple(gate.shape) not in (tuple(q.shape), video_shape):
        _fail(fn, "gate", desc, allowed)
    if tuple(gate.shape) == tuple(q.shape) or prefix_len == 0:
        return gate
    return torch.cat([gate.new_zeros(B, prefix_len, H, D), gate], dim=1)
