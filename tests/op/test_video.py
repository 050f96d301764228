"""VSA entry point (solattn.op.video) against an independent, plainly written float64 oracle.

The oracle below (``oracle_*``) implements FastVideo's VSA-H3 semantics as SPEC.md's "VSA entry
point" states them, in float64, with its own tiling loops (prefix segments, then cubes over t,
h, w), its own ranking by sorting Python lists, and a dense softmax per query tile over the
selected tiles' live tokens. It imports nothing from solattn.routing or solattn.op.

Every registered plan-consuming backend that runs on the CPU is tested (solattn.testing.backend_cases:
``sdpa``, and ``triton`` through Triton's interpreter, TRITON_INTERPRET=1).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import solattn
from solattn.validation import validate
from solattn import dispatch
from solattn.testing import TOLERANCE as TOL
from solattn.testing import backend_cases, rel_l2

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- the oracle

def oracle_blocks(grid, segments=(), cube=(4, 4, 4)):
    """Raw token indices of every tile: each prefix segment's 64-token tiles (in packed order),
    then the cubes in t, h, w order, each cube's tokens in raster order.
    Returns ``(tiles, number_of_prefix_tiles)``."""
    t, h, w = grid
    ct, ch, cw = cube
    tiles, start = [], 0
    for length in segments:
        tiles += [list(range(s, min(s + 64, start + length))) for s in range(start, start + length, 64)]
        start += length
    n_prefix = len(tiles)
    for t0 in range(0, t, ct):
        for h0 in range(0, h, ch):
            for w0 in range(0, w, cw):
                tokens = []
                for tt in range(t0, min(t0 + ct, t)):
                    for hh in range(h0, min(h0 + ch, h)):
                        for ww in range(w0, min(w0 + cw, w)):
                            tokens.append(start + (tt * h + hh) * w + ww)
                tiles.append(tokens)
    return tiles, n_prefix


def oracle_tile(x, grid, cube=(4, 4, 4)):
    blocks, _ = oracle_blocks(grid, (), cube)
    out = torch.zeros((x.shape[0], 64 * len(blocks)) + tuple(x.shape[2:]), dtype=x.dtype)
    for j, tokens in enumerate(blocks):
        for r, tok in enumerate(tokens):
            out[:, 64 * j + r] = x[:, tok]
    return out, [len(tokens) for tokens in blocks]


def oracle_k_vid(sparsity, n_video):
    """FastVideo's count, in Python floats."""
    return max(1, min(math.ceil((1 - sparsity) * n_video), n_video))


def oracle_selection(S, n_prefix, k_vid, mode):
    """Per query tile, the list of kept key tiles, and the smallest gap between a row's threshold
    and its best unkept competitor (how unambiguous the selection is). ``S``: (n, n) float64."""
    n = S.shape[0]
    n_video = n - n_prefix
    kept, gap = [], math.inf
    for i in range(n):
        row = S[i].tolist()
        if i < n_prefix or k_vid == n_video:
            kept.append(list(range(n)))
            continue
        if mode == "exempt" or n_prefix == 0:
            pool, kk, always = list(range(n_prefix, n)), k_vid, list(range(n_prefix))
        else:
            pool, kk, always = list(range(n)), min(k_vid + n_prefix, n), []
        threshold = sorted((row[j] for j in pool), reverse=True)[kk - 1]
        chosen = [j for j in pool if row[j] >= threshold]
        others = [row[j] for j in pool if row[j] < threshold]
        if others:
            gap = min(gap, threshold - max(others))
        kept.append(sorted(always + chosen))
    return kept, gap


def oracle_vsa(q, k, v, grid, k_vid, gate=None, scale=None, segments=(), mode="exempt"):
    """VSA-H3 in float64 (autograd flows when the inputs require grad). Returns ``(out, gap)``."""
    q, k, v = (x.double() for x in (q, k, v))
    if isinstance(gate, torch.Tensor):
        gate = gate.double()
    B, T, H, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    tiles, n_prefix = oracle_blocks(grid, segments)
    index = [torch.tensor(t) for t in tiles]
    gap = math.inf
    rows = {}
    for b in range(B):
        for h in range(H):
            qm = torch.stack([q[b, t, h].mean(0) for t in index])
            km = torch.stack([k[b, t, h].mean(0) for t in index])
            vm = torch.stack([v[b, t, h].mean(0) for t in index])
            S = scale * qm @ km.T
            kept, g = oracle_selection(S.detach(), n_prefix, k_vid, mode)
            gap = min(gap, g)
            for i, tile in enumerate(index):
                keys = torch.cat([index[j] for j in kept[i]])
                row = torch.softmax(scale * q[b, tile, h] @ k[b, keys, h].T, dim=-1) @ v[b, keys, h]
                if gate is not None:
                    coarse = torch.softmax(S[i], dim=0) @ vm
                    row = row + (gate[b, tile, h] if isinstance(gate, torch.Tensor) else gate) * coarse
                rows[b, h, i] = (tile, row)
    out = torch.zeros(B, T, H, D, dtype=torch.float64)
    for (b, h, _), (tile, row) in rows.items():
        out[b, tile, h] = row
    return out, gap


# --------------------------------------------------------------------------- helpers

#: plan-consuming backends that run on the CPU here, from the registry (Triton through its interpreter)
PLAN_CASES = [c for c in backend_cases(["cpu"]) if c.declared.uses_plan]
PLAN_BACKENDS = [c.backend for c in PLAN_CASES]
#: the same as parameters: the flex backend (a compile per shape) and the Triton kernel in the CPU
#: interpreter are slow
PLAN_BACKEND_PARAMS = [pytest.param(c.backend, marks=pytest.mark.slow) if c.backend == "flex" or c.interpreted
                       else c.backend for c in PLAN_CASES]
needs_backend = pytest.mark.skipif("sdpa" not in PLAN_BACKENDS, reason="the sdpa backend is not registered")


@pytest.fixture
def on_backend(monkeypatch):
    """Prepare the environment a backend needs on the CPU and return its name."""
    def prepare(name):
        if any(c.interpreted for c in PLAN_CASES if c.backend == name):
            monkeypatch.setenv("TRITON_INTERPRET", "1")
        return name
    return prepare


def make_inputs(grid, B=1, H=2, D=16, segments=(), dtype=torch.float32, seed=0, gate=False):
    """Random q, k, v (and gate) with a per-tile offset on q and k so that tile scores are well
    separated (routing is unambiguous in fp32 and bf16)."""
    g = torch.Generator().manual_seed(seed)
    T = sum(segments) + math.prod(grid)
    q, k, v = (torch.randn(B, T, H, D, generator=g) for _ in range(3))
    tiles, _ = oracle_blocks(grid, segments)
    for tokens in tiles:
        q[:, tokens] += 1.5 * torch.randn(B, 1, H, D, generator=g)
        k[:, tokens] += 1.5 * torch.randn(B, 1, H, D, generator=g)
    out = [x.to(dtype) for x in (q, k, v)]
    if gate:
        out.append(torch.randn(B, T, H, D, generator=g).to(dtype))
    return out


# --------------------------------------------------------------------------- tiling

GRIDS = [(1, 1, 1), (3, 2, 1), (2, 3, 3), (4, 4, 4), (5, 6, 7), (8, 4, 12), (2, 9, 5), (4, 8, 8)]


@pytest.mark.parametrize("grid", GRIDS)
def test_tile_matches_oracle_and_round_trips(grid):
    x = torch.randn(2, math.prod(grid), 3, 5)
    tiled, block_len = solattn.tile(x, grid)
    want, want_len = oracle_tile(x, grid)
    assert torch.equal(tiled, want)               # includes: dead slots are exactly zero
    assert block_len.dtype == torch.int32 and block_len.device == x.device
    assert block_len.tolist() == want_len
    assert torch.equal(solattn.untile(tiled, grid), x)


@pytest.mark.parametrize("cube", [(1, 8, 8), (2, 4, 8), (8, 8, 1)])
def test_tile_other_cube_shapes(cube):
    grid = (3, 10, 9)
    x = torch.randn(1, math.prod(grid), 2, 4)
    tiled, block_len = solattn.tile(x, grid, cube=cube)
    want, want_len = oracle_tile(x, grid, cube)
    assert torch.equal(tiled, want) and block_len.tolist() == want_len
    assert torch.equal(solattn.untile(tiled, grid, cube=cube), x)


def test_tile_bf16_non_contiguous_and_autograd():
    grid = (5, 6, 7)
    base = torch.randn(2, 4, math.prod(grid), 8, dtype=torch.bfloat16)
    x = base.transpose(1, 2)                       # (B, N, H, D) view with foreign strides
    assert not x.is_contiguous()
    tiled, _ = solattn.tile(x, grid)
    assert tiled.dtype == torch.bfloat16
    assert torch.equal(tiled, oracle_tile(x.contiguous(), grid)[0])
    assert torch.equal(solattn.untile(tiled, grid), x)
    leaf = torch.randn(1, math.prod(grid), 1, 2, requires_grad=True)
    solattn.untile(solattn.tile(leaf, grid)[0] * 3, grid).sum().backward()
    assert torch.equal(leaf.grad, torch.full_like(leaf, 3.0))


@pytest.mark.parametrize("call, exc, pattern", [
    (lambda x: solattn.tile(x, (4, 4)), TypeError, r"'grid' received \(4, 4\).*3 positive ints"),
    (lambda x: solattn.tile(x, (4, 4, 0)), ValueError, r"'grid' received \(4, 4, 0\)"),
    (lambda x: solattn.tile(x, (4, 4.0, 4)), TypeError, r"'grid'"),
    (lambda x: solattn.tile(x, (True, 8, 8)), TypeError, r"'grid'"),
    (lambda x: solattn.tile(x, (4, 4, 4), cube=(4, 4, 2)), ValueError, r"'cube' received \(4, 4, 2\).*64"),
    (lambda x: solattn.tile(x, (4, 4, 5)), ValueError, r"'x' received a tensor of shape \(1, 64, 2, 3\).*80"),
    (lambda x: solattn.tile(x.numpy(), (4, 4, 4)), TypeError, r"'x' received ndarray"),
    (lambda x: solattn.untile(x, (5, 4, 4)), ValueError, r"'y' received .*128"),
    (lambda x: solattn.untile(x, (4, 4, 4), cube=(3, 3, 3)), ValueError, r"'cube'.*volume 27.*64"),
])
def test_tile_bad_arguments(call, exc, pattern):
    x = torch.randn(1, 64, 2, 3)
    with pytest.raises(exc, match=pattern):
        call(x)

# --------------------------------------------------------------------------- sparsity -> k_vid

@pytest.mark.parametrize("sparsity, n, k_vid", [
    # FastVideo's float rounding: 0.7, 0.85, 0.95 on 660 cubes keep one cube more than the decimal
    (0.7, 660, 199), (0.85, 660, 100), (0.95, 660, 34),
    (0.7, 10, 4), (0.9, 10, 1), (0.3, 10, 7), (0.95, 20, 2), (0.85, 20, 4), (0.9, 20, 2),
    (0.5, 7, 4), (0.8, 5, 1), (0.75, 4, 1), (0.0, 13, 13), (1.0, 13, 1), (0.5, 1, 1),
    (0.999, 8, 1), (0.01, 8, 8), (0.125, 8, 7), (0.6, 12, 5),
])
def test_k_vid_from_sparsity_follows_fastvideo_floats(sparsity, n, k_vid):
    from solattn.routing import vsa_topk_from_sparsity
    assert vsa_topk_from_sparsity(sparsity, n) == k_vid == oracle_k_vid(sparsity, n)


@needs_backend
def test_sparsity_count_reaches_the_selection():
    # grid (4, 8, 20) has 1 x 2 x 5 = 10 cubes; (1 - 0.7) * 10 = 3.0000000000000004 keeps 4
    grid = (4, 8, 20)
    q, k, v = make_inputs(grid, D=8, H=1, seed=3)
    by_sparsity = solattn.video_sparse_attn(q, k, v, grid, sparsity=0.7)
    assert torch.equal(by_sparsity, solattn.video_sparse_attn(q, k, v, grid, topk=4))
    assert not torch.equal(by_sparsity, solattn.video_sparse_attn(q, k, v, grid, topk=3))
    want, gap = oracle_vsa(q, k, v, grid, 4)
    assert gap > 1e-4
    assert rel_l2(by_sparsity, want) < TOL[torch.float32]


# --------------------------------------------------------------------------- against the oracle

CASES = [  # grid, B, prefix segments, mode, selection, gate (None, "tensor", or a number)
    ((5, 6, 7), 2, (), "exempt", {"topk": 3}, "tensor"),             # partial cubes in every axis
    ((2, 3, 3), 1, (), "exempt", {"sparsity": 0.5}, "tensor"),       # smaller than one cube
    ((4, 8, 8), 1, (70, 5, 64), "exempt", {"topk": 2}, "tensor"),    # three segments, ragged
    ((4, 8, 8), 1, (70, 5, 64), "compete", {"topk": 2}, "tensor"),
    ((6, 5, 9), 2, (70,), "compete", {"topk": 2}, None),
    ((3, 7, 6), 1, (5, 130), "compete", {"sparsity": 0.6}, 1.0),     # FastVideo's gate-less convention
    ((3, 7, 6), 1, (5, 130), "exempt", {"sparsity": 0.6}, 0.5),
    ((9, 5, 6), 1, (), "exempt", {"sparsity": 0.9}, None),
]


def _k_vid_of(selection, grid):
    n = math.prod(-(-g // 4) for g in grid)
    if "topk" in selection:
        return min(selection["topk"], n)
    return oracle_k_vid(selection["sparsity"], n)


BACKEND_DTYPES = [(name, dtype) for name in PLAN_BACKENDS for dtype in (torch.float32, torch.bfloat16)
                  if dtype in dispatch.get_backend(name).dtypes]


def _oracle_params():
    """Every case on every plan backend and dtype. Slow: the flex and Triton cases but one (the
    (4, 8, 8) prefix case in bf16, which the default run keeps), and on sdpa the B=2 cases and
    that prefix case in bf16 (a second or more each on a 2-core CPU)."""
    out = []
    for case in CASES:
        grid, B, segments, mode, _, gate_kind = case
        case_id = f"{grid}-B{B}-P{segments}-{mode}-{gate_kind}"
        kept = case_id == "(4, 8, 8)-B1-P(70, 5, 64)-exempt-tensor"
        for name, dtype in BACKEND_DTYPES:
            if name == "sdpa":
                slow = B == 2 or (kept and dtype == torch.bfloat16)
            else:
                slow = not (kept and dtype == torch.bfloat16)
            out.append(pytest.param(name, dtype, *case, id=f"{case_id}-{name}-{str(dtype)[6:]}",
                                    marks=pytest.mark.slow if slow else ()))
    return out


def _gate_of(kind, q, seed):
    if kind == "tensor":
        return torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(q.dtype)
    return kind


@pytest.mark.parametrize("backend, dtype, grid, B, segments, mode, selection, gate_kind", _oracle_params())
def test_matches_oracle(on_backend, backend, dtype, grid, B, segments, mode, selection, gate_kind):
    on_backend(backend)
    q, k, v = make_inputs(grid, B=B, segments=segments, dtype=dtype, seed=B + sum(segments))
    gate = _gate_of(gate_kind, q, seed=99)
    out = solattn.video_sparse_attn(q, k, v, grid, gate=gate, backend=backend,
                                    prefix_len=list(segments), prefix_mode=mode, **selection)
    want, gap = oracle_vsa(q, k, v, grid, _k_vid_of(selection, grid), gate=gate, segments=segments, mode=mode)
    assert gap > 1e-3, "test case has nearly tied tile scores; pick another seed"
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    assert rel_l2(out, want) < TOL[dtype]


@pytest.mark.parametrize("backend", PLAN_BACKEND_PARAMS)
def test_prefix_modes_differ_and_match_oracle(on_backend, backend):
    # keys of the prefix made weak: "compete" drops them for video rows, "exempt" keeps them
    on_backend(backend)
    grid, segments = (4, 8, 8), (64, 30)
    q, k, v = make_inputs(grid, segments=segments, dtype=torch.bfloat16, seed=21)
    k = k.clone()
    k[:, :94] = -q[:, 94:].float().mean(1, keepdim=True).to(k.dtype) * 3
    outs = {}
    for mode in ("exempt", "compete"):
        outs[mode] = solattn.video_sparse_attn(q, k, v, grid, topk=1, prefix_len=segments, prefix_mode=mode,
                                               backend=backend)
        want, gap = oracle_vsa(q, k, v, grid, 1, segments=segments, mode=mode)
        assert gap > 1e-3
        assert rel_l2(outs[mode], want) < TOL[torch.bfloat16]
    assert rel_l2(outs["exempt"][:, 94:], outs["compete"][:, 94:]) > 1e-2
    assert torch.equal(outs["exempt"][:, :94], outs["compete"][:, :94])   # prefix rows: dense in both


@pytest.mark.slow
@needs_backend
def test_gate_forms_and_custom_scale():
    grid, segments = (5, 4, 6), (20, 9)
    q, k, v, gate = make_inputs(grid, B=2, segments=segments, gate=True, seed=7)
    P = sum(segments)
    full = solattn.video_sparse_attn(q, k, v, grid, topk=2, gate=gate, prefix_len=segments, scale=0.3)
    want, _ = oracle_vsa(q, k, v, grid, 2, gate=gate, scale=0.3, segments=segments)
    assert rel_l2(full, want) < TOL[torch.float32]
    # a video-shaped gate is the full gate with 0 on the prefix rows
    zero_prefix = gate.clone()
    zero_prefix[:, :P] = 0
    video_only = solattn.video_sparse_attn(q, k, v, grid, topk=2, gate=gate[:, P:].clone(),
                                           prefix_len=segments, scale=0.3)
    assert torch.equal(video_only, solattn.video_sparse_attn(q, k, v, grid, topk=2, gate=zero_prefix,
                                                             prefix_len=segments, scale=0.3))
    # a number is a constant gate (1.0: FastVideo's kernel-level "coarse + fine")
    assert torch.equal(solattn.video_sparse_attn(q, k, v, grid, topk=2, gate=1.0, prefix_len=segments),
                       solattn.video_sparse_attn(q, k, v, grid, topk=2, gate=torch.ones_like(q),
                                                 prefix_len=segments))


@pytest.mark.parametrize("backend", PLAN_BACKEND_PARAMS)
@pytest.mark.parametrize("segments, selection", [((), {"sparsity": 0.0}), ((37,), {"sparsity": 0.01}),
                                                 ((64, 3), {"topk": 50})])
def test_k_vid_equal_to_cube_count_is_dense(on_backend, backend, segments, selection):
    # grid (5, 6, 7) has 8 cubes: sparsity 0, ceil(0.99 * 8) = 8 and topk 50 all keep every tile
    on_backend(backend)
    grid = (5, 6, 7)
    dtype = torch.float32 if torch.float32 in dispatch.get_backend(backend).dtypes else torch.bfloat16
    q, k, v, gate = make_inputs(grid, B=1, H=1, segments=segments, gate=True, seed=11, dtype=dtype)
    dense = F.scaled_dot_product_attention(*(x.double().transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
    plain = solattn.video_sparse_attn(q, k, v, grid, prefix_len=segments, backend=backend, **selection)
    assert rel_l2(plain, dense) < TOL[dtype]
    gated = solattn.video_sparse_attn(q, k, v, grid, gate=gate, prefix_len=segments, backend=backend, **selection)
    want, _ = oracle_vsa(q, k, v, grid, 8, gate=gate, segments=segments)
    assert rel_l2(gated, want) < TOL[dtype]
    assert rel_l2(gated[:, :sum(segments)], plain[:, :sum(segments)]) > 0 or not segments  # prefix rows get coarse


@needs_backend
def test_prefix_rows_are_dense_and_prefix_keys_always_attended():
    grid, P = (6, 8, 8), 100
    q, k, v = make_inputs(grid, B=1, segments=(P,), seed=5)
    out = solattn.video_sparse_attn(q, k, v, grid, topk=1, prefix_len=P)
    dense = F.scaled_dot_product_attention(*(x.double().transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
    assert rel_l2(out[:, :P], dense[:, :P]) < 2e-5
    assert rel_l2(out[:, P:], dense[:, P:]) > 1e-2      # the video rows really are sparse
    # making the prefix keys dominate must pull every video row to the prefix values
    k2 = k.clone()
    k2[:, :P] = q[:, P:].mean(1, keepdim=True) * 50
    out2 = solattn.video_sparse_attn(q, k2, v, grid, topk=1, prefix_len=P)
    want, _ = oracle_vsa(q, k2, v, grid, 1, segments=(P,))
    assert rel_l2(out2, want) < 1e-4


@needs_backend
def test_segments_are_tiled_apart():
    # one segment of 70 (tiles of 64 + 6 rows) vs segments (30, 40): other tiles, other means
    grid = (4, 4, 8)
    q, k, v, gate = make_inputs(grid, segments=(70,), gate=True, seed=13)
    one = solattn.video_sparse_attn(q, k, v, grid, topk=1, gate=gate, prefix_len=70)
    two = solattn.video_sparse_attn(q, k, v, grid, topk=1, gate=gate, prefix_len=[30, 40])
    assert rel_l2(one, two) > 1e-3
    for segments, out in (((70,), one), ((30, 40), two)):
        want, _ = oracle_vsa(q, k, v, grid, 1, gate=gate, segments=segments)
        assert rel_l2(out, want) < TOL[torch.float32]
    # empty segments are dropped
    assert torch.equal(two, solattn.video_sparse_attn(q, k, v, grid, topk=1, gate=gate, prefix_len=(0, 30, 0, 40)))


@needs_backend
def test_ties_keep_the_whole_group():
    grid = (4, 8, 8)                                  # 4 whole cubes
    q, _, v = make_inputs(grid, B=1, seed=2)
    k = torch.full_like(q, 0.5)                       # every cube mean is exactly equal
    out = solattn.video_sparse_attn(q, k, v, grid, topk=1)
    want, _ = oracle_vsa(q, k, v, grid, 1)
    assert rel_l2(out, want) < 2e-5
    # all cubes tie, so all are kept: uniform attention over every token
    assert rel_l2(out, v.mean(dim=1, keepdim=True).expand_as(v)) < 2e-5


@needs_backend
def test_sort_ranking_path_agrees(monkeypatch):
    # the XPU-safe ranking (a full sort instead of torch.topk), forced on the CPU
    grid = (5, 6, 7)
    q, k, v = make_inputs(grid, B=2, segments=(40,), seed=6)
    by_topk = [solattn.video_sparse_attn(q, k, v, grid, topk=3, prefix_len=40, prefix_mode=m)
               for m in ("exempt", "compete")]
    monkeypatch.setenv("SOLATTN_TOPK", "sort")
    for m, want in zip(("exempt", "compete"), by_topk):
        assert torch.equal(solattn.video_sparse_attn(q, k, v, grid, topk=3, prefix_len=40, prefix_mode=m), want)


@needs_backend
@pytest.mark.parametrize("mode", ["exempt", "compete"])
def test_selection_mask_matches_oracle(mode):
    from solattn.routing import block_stats, build_vsa_plan, select_vsa
    grid, segments = (5, 6, 7), (70, 20)
    q, k, v = make_inputs(grid, B=2, segments=segments, seed=9)
    tiles, n_prefix = oracle_blocks(grid, segments)
    rows = torch.cat([torch.tensor(t) for t in tiles])
    slot = torch.cat([torch.arange(len(t)) + 64 * j for j, t in enumerate(tiles)])
    tiled = [torch.zeros(2, 64 * len(tiles), 2, 16).index_copy(1, slot, x[:, rows]) for x in (q, k, v)]
    block_len = torch.tensor([len(t) for t in tiles], dtype=torch.int32)
    problem = validate(*tiled, tail=False, block_len=block_len)
    exact = select_vsa(block_stats(problem), 3, n_prefix, mode, problem.scale)
    plan = build_vsa_plan(problem, 3, n_prefix, mode)
    assert torch.equal(plan.dense_mask(), exact) and plan.coarse is None and plan.tail_lse is None
    for b in range(2):
        for h in range(2):
            qm = torch.stack([q[b, t, h].double().mean(0) for t in tiles])
            km = torch.stack([k[b, t, h].double().mean(0) for t in tiles])
            kept, gap = oracle_selection(problem.scale * qm @ km.T, n_prefix, 3, mode)
            assert gap > 1e-4
            want = torch.zeros(len(tiles), len(tiles), dtype=torch.bool)
            for i, js in enumerate(kept):
                want[i, js] = True
            assert torch.equal(exact[b, h], want)


# --------------------------------------------------------------------------- autograd

@pytest.mark.slow
@needs_backend
@pytest.mark.parametrize("segments, mode", [((5,), "exempt"), ((70, 3), "compete")])
def test_gradients_match_float64_oracle(segments, mode):
    grid = (5, 6, 7)
    q, k, v, gate = (x.requires_grad_(True) for x in make_inputs(grid, B=1, segments=segments, gate=True, seed=8))
    weight = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    out = solattn.video_sparse_attn(q, k, v, grid, topk=3, gate=gate, prefix_len=segments, prefix_mode=mode)
    grads = torch.autograd.grad((out * weight).sum(), (q, k, v, gate))
    leaves = [x.detach().double().requires_grad_(True) for x in (q, k, v, gate)]
    want, _ = oracle_vsa(*leaves[:3], grid, 3, gate=leaves[3], segments=segments, mode=mode)
    want_grads = torch.autograd.grad((want * weight.double()).sum(), leaves)
    for name, g, w in zip("q k v gate".split(), grads, want_grads):
        assert g is not None and torch.isfinite(g).all(), name
        assert rel_l2(g, w) < 1e-4, name


# --------------------------------------------------------------------------- arguments and backends

def test_reference_backend_is_refused():
    grid = (4, 4, 4)
    q, k, v = make_inputs(grid)
    with pytest.raises(solattn.BackendError, match="'reference' cannot serve VSA.*routing plan"):
        solattn.video_sparse_attn(q, k, v, grid, topk=1, backend="reference")
    with solattn.use_backend("reference"):
        with pytest.raises(solattn.BackendError, match="'reference' cannot serve VSA"):
            solattn.video_sparse_attn(q, k, v, grid, topk=1)


@needs_backend
def test_environment_preference_for_reference_is_ignored(monkeypatch):
    # SOLATTN_BACKEND is a preference; the reference cannot serve VSA, so the plan backends do,
    # and the fallback is said out loud (once per reason), as for sol_attn
    grid = (5, 6, 7)
    q, k, v = make_inputs(grid, seed=12)
    monkeypatch.setenv("SOLATTN_BACKEND", "reference")
    monkeypatch.setattr(solattn.dispatch, "_warned_env", set())
    with pytest.warns(RuntimeWarning, match="SOLATTN_BACKEND=reference cannot run.*routing plan"):
        out = solattn.video_sparse_attn(q, k, v, grid, topk=2)
    want, _ = oracle_vsa(q, k, v, grid, 2)
    assert rel_l2(out, want) < TOL[torch.float32]


def _bad(**over):
    grid = (3, 4, 5)
    q, k, v = make_inputs(grid, segments=(2,))
    args = dict(q=q, k=k, v=v, grid=grid, sparsity=0.5, prefix_len=2)
    args.update(over)
    return args


@pytest.mark.parametrize("over, exc, pattern", [
    (dict(k=torch.randn(1, 62, 2, 8)), ValueError, r"video_sparse_attn: argument 'k' received"),
    (dict(q=torch.randn(1, 62, 2, 16, dtype=torch.float64)), TypeError, r"video_sparse_attn: argument 'q'.*dtype"),
    (dict(grid=(3, 4, 6)), ValueError, r"'q' received a tensor of shape \(1, 62, 2, 16\).*2 \+ 72 = 74"),
    (dict(prefix_len=0), ValueError, r"'q' received .*0 \+ 60 = 60"),
    (dict(prefix_len=[1, 2]), ValueError, r"'q' received .*3 \+ 60 = 63.*prefix_len=\[1, 2\]"),
    (dict(prefix_len=-1), ValueError, r"'prefix_len' received -1; allowed: an int >= 0 or a sequence"),
    (dict(prefix_len=[3, -1]), ValueError, r"'prefix_len' received \[3, -1\]"),
    (dict(prefix_len=True), TypeError, r"'prefix_len' received True"),
    (dict(prefix_len=[2.0]), TypeError, r"'prefix_len' received \[2.0\]"),
    (dict(prefix_mode="both"), ValueError, r"'prefix_mode' received 'both'; allowed: one of \('exempt', 'compete'\)"),
    (dict(prefix_mode=None), TypeError, r"'prefix_mode' received None"),
    (dict(gate=float("nan")), ValueError, r"'gate' received nan"),
    (dict(gate=1e39), ValueError, r"'gate' received 1e\+39"),      # finite in float64, inf in fp32
    (dict(scale=1e39), ValueError, r"video_sparse_attn: argument 'scale' received 1e\+39"),
    (dict(gate=True), TypeError, r"'gate' received bool"),
    (dict(grid=(3, 4)), TypeError, r"'grid' received \(3, 4\)"),
    (dict(topk=2), ValueError, r"'sparsity/topk' received sparsity=0.5, topk=2.*exactly one"),
    (dict(sparsity=None), ValueError, r"'sparsity/topk' received sparsity=None, topk=None"),
    (dict(sparsity=1.5), ValueError, r"'sparsity' received 1.5; allowed: a float 0 <= sparsity <= 1"),
    (dict(sparsity=-0.1), ValueError, r"'sparsity' received -0.1"),
    (dict(sparsity=float("nan")), ValueError, r"'sparsity' received nan"),
    (dict(sparsity="0.5"), TypeError, r"'sparsity' received '0.5' of type str"),
    (dict(sparsity=None, topk=0), ValueError, r"'topk' received 0; allowed: an int >= 1"),
    (dict(sparsity=None, topk=2.0), TypeError, r"'topk' received 2.0 of type float"),
    (dict(gate=torch.randn(1, 61, 2, 16)), ValueError, r"'gate' received a tensor of shape \(1, 61, 2, 16\).*\(1, 62, 2, 16\).*\(1, 60, 2, 16\)"),
    (dict(gate=torch.ones(1, 62, 2, 16, dtype=torch.int32)), TypeError, r"'gate' received .*int32"),
    (dict(gate="g"), TypeError, r"'gate' received str"),
    (dict(scale=float("inf")), ValueError, r"video_sparse_attn: argument 'scale' received inf"),
    (dict(backend="nope"), ValueError, r"'backend' received 'nope'"),
])
def test_bad_arguments(over, exc, pattern):
    args = _bad(**over)
    with pytest.raises(exc, match=pattern):
        solattn.video_sparse_attn(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("grid"), **args)


# --------------------------------------------------------------------------- the example

@pytest.mark.slow
@needs_backend
def test_example_runs_and_reports_errors():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "video_sparse_attention.py"),
                          "--repeats", "1"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    rows = {float(m[1]): (float(m[2]), float(m[3]))
            for m in re.finditer(r"^\s*([0-9.]+)\s+\d+/\d+\s+([0-9.e+-]+)\s+[0-9.]+\s+([0-9.]+)x", res.stdout, re.M)}
    assert sorted(rows) == [0.5, 0.8, 0.9], res.stdout
    errors = [rows[s][0] for s in (0.5, 0.8, 0.9)]
    assert all(0 < e < 0.2 for e in errors), res.stdout       # smooth video: sparse stays close to dense
    assert errors[0] < errors[1] < errors[2], res.stdout     # fewer cubes, larger error
