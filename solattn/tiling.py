"""The tiled token layout of video sparse attention: prefix segments, then a video grid in cubes.

A ``(t, h, w)`` latent grid in raster order (t slowest, w fastest) is cut into cubes
(4x4x4 by default, 64 tokens = one routing block). Cubes are numbered in t, then h, then w
order; inside a cube the tokens keep raster order. Edge cubes of grids not divisible by the
cube are partial: their tokens occupy the front of the cube's 64-slot block, the remaining
slots are dead (zero), and the live counts are the ``block_len`` table of SPEC.md. Prefix
segments (text, audio, ...) packed before the video each get their own 64-row tiles.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import NamedTuple, Optional, Sequence, Tuple

import torch

from .validation import BLOCK
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


def check_grid_cube(fn: str, grid, cube) -> Tuple[Grid, Grid]:
    grid = _check_triple(fn, "grid", grid, "(t, h, w), the latent grid")
    if cube is DEFAULT_CUBE:                     # the module's (4, 4, 4): nothing to check per call
        return grid, cube
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


class Layout(NamedTuple):
    """Index tables of one tiled layout (all on the target device)."""

    slots: torch.Tensor          # (tokens,) int64: row of the tiled sequence of every raw token
    gather: torch.Tensor         # (rows,) int64: raw token of every tiled row (0 for dead rows)
    dead: Optional[torch.Tensor]  # (dead rows,) int64, or None when every row is live
    block_len: torch.Tensor      # (n,) int32 live rows per block
    num_prefix_blocks: int


@functools.lru_cache(maxsize=64)
def layout(grid: Grid, cube: Grid, segments: Tuple[int, ...], device: torch.device) -> Layout:
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
    return Layout(slots=slots.to(device), gather=gather.to(device),
                   dead=dead.to(device) if dead.numel() else None, block_len=block_len.to(device),
                   num_prefix_blocks=tile)


def to_tiled(x: torch.Tensor, layout: Layout) -> torch.Tensor:
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
    grid, cube = check_grid_cube("tile", grid, cube)
    _check_tokens("tile", "x", x, math.prod(grid), f"t*h*w for grid={grid}")
    tiles = layout(grid, cube, (), x.device)
    return to_tiled(x, tiles), tiles.block_len


def untile(y: torch.Tensor, grid, cube=DEFAULT_CUBE) -> torch.Tensor:
    """Inverse of :func:`tile`: ``(B, 64 n, ...)`` cube blocks -> ``(B, t*h*w, ...)`` raw order.

    Dead rows of partial cubes are dropped; ``untile(tile(x, grid)[0], grid)`` equals ``x`` exactly.
    """
    grid, cube = check_grid_cube("untile", grid, cube)
    rows = num_cubes(grid, cube) * BLOCK
    _check_tokens("untile", "y", y, rows, f"64 x {rows // BLOCK} cubes for grid={grid}, cube={cube}")
    return y.index_select(1, layout(grid, cube, (), y.device).slots)


def tiled_view(x: Optional[torch.Tensor], rows: int) -> Optional[torch.Tensor]:
    """``x``, one value for every token (stride 0 on dim 1, e.g. a constant gate), as a view with
    ``rows`` rows: the tiled layout of such a tensor, without a copy. None stays None."""
    if x is None:
        return None
    if x.stride(1) != 0:
        raise ValueError(f"tiled_view: a tensor with stride 0 on dim 1 is needed; got strides {x.stride()}")
    B, _, *rest = x.shape
    return x[:, :1].expand(B, rows, *rest)


def tiled_rows(grid: Sequence[int], segments: Sequence[int], cube: Grid = DEFAULT_CUBE) -> int:
    """Rows of the tiled layout: 64 per prefix tile and per cube."""
    return (num_cubes(tuple(grid), cube) + sum(-(-s // BLOCK) for s in segments)) * BLOCK
