"""VSA's forward on the ``triton`` backend without tiled copies: the kernels read q, k, v and the
gate and write the output in the caller's token order through the layout's row table
(``Problem.rows``), run by Triton's CPU interpreter, against the float64 VSA-H3 oracle of
test_video.py. Layouts with partial cubes, several prefix segments, B = 2 and a gate."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from solattn.testing import dense_gradient_error, rel_l2, tolerance, triton_interpretable

if not triton_interpretable():
    pytest.skip("needs Triton >= 3.9 for its CPU interpreter", allow_module_level=True)

import solattn  # noqa: E402
from solattn import pipeline, tiling  # noqa: E402
from solattn.backends.triton import KernelConfig, TritonTuning, launch  # noqa: E402
from solattn.config import tuning  # noqa: E402
from solattn.routing import build_vsa_plan  # noqa: E402
from solattn.routing.fused import FusedPlanTuning  # noqa: E402
from test_video import make_inputs, oracle_vsa  # noqa: E402

POINTER = KernelConfig(4, 3, tma=False)     # k and v through the row table too
TMA = KernelConfig(4, 3, tma=True)          # k and v from the tiled copy of kernel.tile_kv

#: (grid, B, prefix segments, mode, k_vid): partial cubes on every axis, 1-3 prefix segments with
#: partial tiles, B = 2
CASES = [((3, 7, 6), 2, (5, 130), "exempt", 2),
         ((5, 4, 9), 2, (70, 1, 64), "compete", 3)]
#: every case with both ways of reading k and v; the first with pointer loads in the default run
FORWARD_CASES = [pytest.param(*case, config, id=f"{case[0]}-P{case[2]}-{case[3]}-{name}",
                              marks=() if (i, name) == (0, "pointer") else pytest.mark.slow)
                 for i, case in enumerate(CASES) for config, name in ((POINTER, "pointer"), (TMA, "tma"))]


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


class IndexOps(TorchDispatchMode):
    """Records every aten indexing op (gather, scatter, index_select, index_fill, ...) that reads
    or writes a tensor of at least ``numel`` elements: what tiling a q-sized tensor costs."""

    NAMES = {"index_select", "gather", "index", "index_put", "index_fill", "index_copy", "index_add",
             "scatter", "scatter_add", "take", "masked_scatter"}

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.seen = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__.rstrip("_")
        if name in self.NAMES and any(isinstance(t, torch.Tensor) and t.numel() >= self.numel
                                      for t in tree_leaves((args, kwargs))):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def _route(grid, segments, mode, k_vid, device):
    call = pipeline.Call(1.0, None, None, None, 0.0, False, 0, list(grid), k_vid, list(segments), mode)
    return pipeline.VideoRoute(call, device)


@pytest.mark.parametrize("grid, B, segments, mode, k_vid, config", FORWARD_CASES)
def test_forward_matches_oracle_without_tiled_copies(grid, B, segments, mode, k_vid, config):
    q, k, v, gate = make_inputs(grid, B=B, H=2, D=16, segments=segments, dtype=torch.bfloat16, seed=7, gate=True)
    watch = IndexOps(q.numel() // 2)
    with tuning(TritonTuning(forward=config)), watch:
        out = solattn.video_sparse_attn(q, k, v, grid, topk=k_vid, gate=gate, backend="triton",
                                        prefix_len=list(segments), prefix_mode=mode)
    assert watch.seen == [], f"q-sized indexing ops in the forward: {watch.seen}"
    want, gap = oracle_vsa(q, k, v, grid, k_vid, gate=gate, segments=segments, mode=mode)
    assert gap > 1e-3, "test case has nearly tied tile scores; pick another seed"
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert rel_l2(out, want) < tolerance(torch.bfloat16)

    # the same launch into a NaN-poisoned output: every token written (once: the result is the
    # public call's, bit for bit), the long prefix programs first
    route = _route(grid, segments, mode, k_vid, q.device)
    problem, chosen = route.prepare(q, k, v, gate, None, None, "triton", False)
    assert chosen.name == "triton" and problem.rows is not None and problem.T == route.rows()
    assert problem.sink_q == (0, route.layout.num_prefix_blocks)
    poisoned = torch.full(q.shape, float("nan"), dtype=q.dtype)
    launch(problem, route.plan(problem, fused=True), config=config, out=poisoned)
    assert torch.equal(poisoned, out)


def test_fused_plan_reads_the_row_table_like_a_tiled_copy():
    grid, segments, k_vid = (5, 4, 9), (70, 1, 64), 3
    q, k, v, gate = make_inputs(grid, B=2, H=2, D=16, segments=segments, dtype=torch.bfloat16, seed=3, gate=True)
    route = _route(grid, segments, "exempt", k_vid, q.device)
    raw, _ = route.prepare(q, k, v, gate, None, None, "triton", False)
    tq, tk, tv = (route.tiled(x) for x in (q, k, v))
    tiled = route.problem(tq, tk, tv, route.gate(gate, tq), None, None)
    plans = [build_vsa_plan(p, k_vid, route.layout.num_prefix_blocks, "exempt", fused=True) for p in (raw, tiled)]
    for name in ("kv_num_blocks", "kv_indices", "block_len", "coarse", "touches_dead"):
        assert torch.equal(getattr(plans[0], name), getattr(plans[1], name)), name


def test_tiled_copies_only_where_the_backend_or_a_backward_needs_them():
    grid, segments, k_vid = (3, 7, 6), (5, 130), 2
    q, k, v, gate = make_inputs(grid, B=1, H=2, D=16, segments=segments, dtype=torch.bfloat16, seed=1, gate=True)
    route = _route(grid, segments, "exempt", k_vid, q.device)
    # (backend, gate, a backward may follow, fused plan) -> a row table; else tiled copies: a
    # backend that reads no table, or a plan built by torch (here: too many blocks for the fused one)
    for requested, g, want_lse, fused, rows in (("triton", gate, False, True, True), ("triton", None, True, True, True),
                                                ("triton", gate, True, True, True), ("sdpa", gate, False, True, False),
                                                ("triton", gate, False, False, False)):
        with tuning(FusedPlanTuning(max_fused_blocks=8192 if fused else 1)):
            problem, chosen = route.prepare(q, k, v, g, None, None, requested, want_lse)
        assert chosen.name == requested and (problem.rows is not None) == rows
        assert problem.T == route.rows() and problem.sink_q == (0, route.layout.num_prefix_blocks)
        if rows:
            assert problem.q is q and torch.equal(problem.rows, route.layout.gather)
        else:
            assert torch.equal(problem.q, tiling.to_tiled(q, route.layout))


@pytest.mark.parametrize("segments, gate", [pytest.param((5, 130), True, marks=pytest.mark.slow), ((), False)])
def test_training_forward_reads_the_table_and_gradients_match_oracle(segments, gate):
    """A training step's forward reads the row table too (its lse and residual in the tiled rows,
    its plan the fused one, kept for the backward, which tiles what it saved)."""
    grid, k_vid = (3, 7, 6), 2
    tensors = make_inputs(grid, B=2, H=2, D=16, segments=segments, dtype=torch.float16, seed=4, gate=gate)
    leaves = [x.clone().requires_grad_(True) for x in tensors]
    weight = torch.randn(leaves[0].shape, generator=torch.Generator().manual_seed(2))
    watch = IndexOps(leaves[0].numel() // 2)
    with watch:
        out = solattn.video_sparse_attn(*leaves[:3], grid, topk=k_vid, gate=leaves[3] if gate else None,
                                        backend="triton", prefix_len=list(segments))
    assert watch.seen == [], f"q-sized indexing ops in the forward: {watch.seen}"
    grads = torch.autograd.grad((out.float() * weight).sum(), leaves)
    exact = [x.detach().double().requires_grad_(True) for x in tensors]
    want, gap = oracle_vsa(*exact[:3], grid, k_vid, gate=exact[3] if gate else None, segments=segments)
    assert gap > 1e-3
    want_grads = torch.autograd.grad((want * weight.double()).sum(), exact)
    assert rel_l2(out, want) < tolerance(torch.float16)
    level = max(tolerance(torch.float16), 2 * dense_gradient_error(*tensors[:3], weight))
    for name, g, w in zip(("q", "k", "v", "gate"), grads, want_grads):
        assert torch.isfinite(g).all() and rel_l2(g, w) < level, name


def test_torch_plan_refuses_a_row_table():
    grid, segments = (3, 7, 6), (5, 130)
    q, k, v = make_inputs(grid, segments=segments, dtype=torch.bfloat16)
    route = _route(grid, segments, "exempt", 2, q.device)
    raw, _ = route.prepare(q, k, v, None, None, None, "triton", False)
    with pytest.raises(ValueError, match="row table"):
        build_vsa_plan(raw, 2, route.layout.num_prefix_blocks, fused=False)
    assert dataclasses.replace(raw, rows=None).T == q.shape[1]
