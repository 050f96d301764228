"""VSA's forward on the ``triton`` backend without tiled copies: the kernels read q, k, v and the
gate and write the output in the caller's token order through the layout's row table
(``Problem.rows``), against the float64 VSA-H3 oracle of test_video.py: on the CPU through Triton's
interpreter, and compiled on a CUDA GPU when there is one. Layouts with partial cubes, several
prefix segments, B = 2 and a gate; k and v read in each of the kernel's three ways."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from solattn.testing import dense_gradient_error, rel_l2, tolerance, triton_interpretable

pytest.importorskip("triton")
INTERPRETABLE = triton_interpretable()
if not INTERPRETABLE and not torch.cuda.is_available():
    pytest.skip("needs Triton >= 3.9 for its CPU interpreter, or a CUDA GPU", allow_module_level=True)

import solattn  # noqa: E402
from solattn import tiling  # noqa: E402
from solattn.op.call import Call  # noqa: E402
from solattn.op.route import VideoRoute  # noqa: E402
from solattn.backends.triton import KernelConfig, TritonTuning, launch  # noqa: E402
from solattn.backends.triton import backend as tb  # noqa: E402
from solattn.backends.triton import kernel  # noqa: E402
from solattn.triton_runtime import jit  # noqa: E402
from solattn.config import tuning  # noqa: E402
from solattn.routing import build_vsa_plan  # noqa: E402
from solattn.routing.fused import FusedPlanTuning  # noqa: E402
from tests.op.test_video import make_inputs, oracle_vsa  # noqa: E402

#: how the forward reads k and v: through the row table (pointer loads), or from the tiled copy of
#: kernel.tile_rows (TMA loads)
LOADS = {"pointer": TritonTuning(forward=KernelConfig(4, 3, tma=False)),
         "tma-copy": TritonTuning(forward=KernelConfig(4, 3, tma=True))}

#: (grid, B, prefix segments, mode, k_vid): partial cubes on every axis and 1-3 prefix segments with
#: partial tiles, B = 2; whole cubes and tiles; no prefix
CASES = [((3, 7, 6), 2, (5, 130), "exempt", 2),
         ((5, 4, 9), 2, (70, 1, 64), "compete", 3),
         ((4, 4, 8), 1, (64,), "exempt", 1),
         ((5, 6, 7), 1, (), "exempt", 3)]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
#: every case, way of loading and device; on the CPU the first case with pointer loads in the
#: default run
FORWARD_CASES = [pytest.param(*case, load, device, id=f"{case[0]}-P{case[2]}-{case[3]}-{load}-{device}",
                              marks=pytest.mark.gpu if device != "cpu"
                              else () if (i, load) == (0, "pointer") else pytest.mark.slow)
                 for i, case in enumerate(CASES) for load in LOADS for device in DEVICES]


@pytest.fixture(autouse=True)
def _interpret(monkeypatch, request):
    """The kernels of CPU cases run in Triton's interpreter; CUDA cases compile them."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is None or callspec.params.get("device", "cpu") == "cpu":
        if not INTERPRETABLE:
            pytest.skip("a CPU case: needs Triton >= 3.9 for its CPU interpreter (CUDA cases run here)")
        monkeypatch.setenv("TRITON_INTERPRET", "1")


class IndexOps:
    """Within the block, every aten indexing op (index_select, index_fill_, gather, scatter, ...)
    that reads or writes a tensor of at least ``numel`` elements, by name in ``seen``: what tiling
    a q-sized tensor costs. Recorded by the profiler, which sees the ops inside the custom op too
    (a dispatch mode would see the op alone)."""

    PREFIXES = ("aten::index", "aten::gather", "aten::scatter", "aten::take", "aten::masked_scatter")

    def __init__(self, numel: int):
        self.numel, self.seen = numel, []
        self.prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)

    def __enter__(self):
        self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        self.prof.__exit__(*exc)
        self.seen = [e.name for e in self.prof.events() if e.name.startswith(self.PREFIXES)
                     and any(isinstance(s, list) and s and math.prod(s) >= self.numel for s in e.input_shapes)]


def _route(grid, segments, mode, k_vid, q):
    """VSA's route of a call on ``q`` (as q, k and v; a test gives its own with ``route.call._replace``)."""
    return VideoRoute(Call(q, q, q, grid=list(grid), k_vid=k_vid, segments=list(segments), prefix_mode=mode))


@pytest.mark.parametrize("grid, B, segments, mode, k_vid, load, device", FORWARD_CASES)
def test_forward_matches_oracle_without_tiled_copies(grid, B, segments, mode, k_vid, load, device, monkeypatch):
    tensors = make_inputs(grid, B=B, H=2, D=16, segments=segments, dtype=torch.bfloat16, seed=7, gate=True)
    q, k, v, gate = (t.to(device) for t in tensors)
    launched = []           # the kernels launched, by name
    real = jit.compiled
    monkeypatch.setattr(jit, "compiled", lambda interpret, fn: launched.append(fn.fn.__name__) or real(interpret, fn))
    watch = IndexOps(q.numel() // 2)
    with tuning(LOADS[load]), watch:
        out = solattn.video_sparse_attn(q, k, v, grid, topk=k_vid, gate=gate, backend="triton",
                                        prefix_len=list(segments), prefix_mode=mode)
    assert watch.seen == [], f"q-sized indexing ops in the forward: {watch.seen}"
    want, gap = oracle_vsa(*tensors[:3], grid, k_vid, gate=tensors[3], segments=segments, mode=mode)
    assert gap > 1e-3, "test case has nearly tied tile scores; pick another seed"
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert rel_l2(out.cpu(), want) < tolerance(torch.bfloat16)
    # the call: TMA loads read tiled copies of k and v and block_len's lengths carried with the
    # listed indices, both made by the fused plan's own kernels (means, select) on the way
    public, launched[:] = list(launched), []
    assert "tile_rows" not in public and "len_codes" not in public and public.count("sol_attn_fwd") == 1

    # the same launch into a NaN-poisoned output: every token written (once: the result is the
    # public call's, bit for bit), the long prefix programs first
    route = _route(grid, segments, mode, k_vid, q)
    problem, chosen = route.prepare(route.call._replace(q=q, k=k, v=v, gate=gate), "triton", False)
    assert chosen.name == "triton" and problem.rows is not None and problem.T == route.rows()
    assert problem.sink_q == ((0, route.layout.num_prefix_blocks) if segments else None)
    poisoned = torch.full(q.shape, float("nan"), dtype=q.dtype, device=device)
    with tuning(LOADS[load]):
        launch(problem, route.plan(problem, fused=True), out=poisoned)
    assert torch.equal(poisoned, out)
    # from a plan built without them, the forward makes both itself (tile_rows, len_codes), with
    # the same output bit for bit
    made = {"pointer": 0, "tma-copy": 1}[load]
    assert launched.count("tile_rows") == made and launched.count("len_codes") == made
    assert launched.count("sol_attn_fwd") == 1


def test_len_codes_carry_each_listed_block_with_its_dead_rows():
    grid, segments = (3, 7, 6), (5, 130)
    q, k, v = make_inputs(grid, B=2, H=2, D=16, segments=segments, dtype=torch.bfloat16, seed=7)
    route = _route(grid, segments, "compete", 2, q)
    problem, _ = route.prepare(route.call._replace(q=q, k=k, v=v, gate=None), "triton", False)
    plan = route.plan(problem, fused=True)
    ops = tb.kernel_operands(problem, plan)
    codes = torch.full_like(ops.kv_idx, -1)
    jit.compiled(True, kernel.len_codes)[(ops.kv_num.numel(),)](
        ops.kv_num, ops.kv_idx, ops.block_len, codes, codes.shape[-1], W=4, BLOCK=64)
    listed = torch.arange(codes.shape[-1]) < ops.kv_num[..., None]
    idx = ops.kv_idx.long()
    assert (ops.block_len < 64).any() and listed.any() and not listed.all()
    assert torch.equal(codes[listed], (idx | ((64 - ops.block_len[idx]) << 16))[listed].int())
    assert (codes[~listed] == -1).all()             # nothing written past a row's count


def test_fused_plan_reads_the_row_table_like_a_tiled_copy():
    grid, segments, k_vid = (5, 4, 9), (70, 1, 64), 3
    q, k, v, gate = make_inputs(grid, B=2, H=2, D=16, segments=segments, dtype=torch.bfloat16, seed=3, gate=True)
    route = _route(grid, segments, "exempt", k_vid, q)
    raw, _ = route.prepare(route.call._replace(q=q, k=k, v=v, gate=gate), "triton", False)
    tq, tk, tv = (route.tiled(x) for x in (q, k, v))
    tiled = route.problem(route.call._replace(q=tq, k=tk, v=tv, gate=route.gate(gate)))
    plans = [build_vsa_plan(p, k_vid, route.layout.num_prefix_blocks, "exempt", fused=True) for p in (raw, tiled)]
    for name in ("kv_num_blocks", "kv_indices", "block_len", "coarse", "touches_dead"):
        assert torch.equal(getattr(plans[0], name), getattr(plans[1], name)), name


def test_tiled_copies_only_where_the_backend_or_a_backward_needs_them():
    grid, segments, k_vid = (3, 7, 6), (5, 130), 2
    q, k, v, gate = make_inputs(grid, B=1, H=2, D=16, segments=segments, dtype=torch.bfloat16, seed=1, gate=True)
    route = _route(grid, segments, "exempt", k_vid, q)
    # (backend, gate, a backward may follow, fused plan) -> a row table; else tiled copies: a
    # backend that reads no table, or a plan built by torch (here: too many blocks for the fused one)
    for requested, g, want_lse, fused, rows in (("triton", gate, False, True, True), ("triton", None, True, True, True),
                                                ("triton", gate, True, True, True), ("sdpa", gate, False, True, False),
                                                ("triton", gate, False, False, False)):
        with tuning(FusedPlanTuning(max_fused_blocks=8192 if fused else 1)):
            problem, chosen = route.prepare(route.call._replace(q=q, k=k, v=v, gate=g), requested, want_lse)
        assert chosen.name == requested and (problem.rows is not None) == rows
        assert problem.T == route.rows() and problem.sink_q == (0, route.layout.num_prefix_blocks)
        if rows:
            assert problem.q is q and torch.equal(problem.rows, route.layout.gather)
        else:
            assert torch.equal(problem.q, tiling.to_tiled(q, route.layout))
    # the instrument of the tests above sees the tiled copies a backend without a table gets
    watch = IndexOps(q.numel() // 2)
    with watch:
        solattn.video_sparse_attn(q, k, v, grid, topk=k_vid, gate=gate, backend="sdpa", prefix_len=list(segments))
    assert watch.seen.count("aten::index_select") >= 4, watch.seen      # q, k, v, gate (and out back)


@pytest.mark.parametrize("segments, gate", [pytest.param((5, 130), True, marks=pytest.mark.slow), ((), False)])
def test_training_forward_reads_the_table_and_gradients_match_oracle(segments, gate):
    """A training step's forward reads the row table too (its lse and residual in the tiled rows,
    its plan the fused one, kept for the backward, which reads the table as well: its ops are
    counted in tests/backends/triton/test_vsa_backward.py)."""
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


def test_video_plan_reads_the_row_table_and_runs_as_the_call_does():
    grid, segments, k_vid = (3, 7, 6), (5, 130), 2
    q, k, v, gate = make_inputs(grid, B=1, H=2, D=16, segments=segments, dtype=torch.bfloat16, seed=7, gate=True)
    kw = dict(topk=k_vid, gate=gate, prefix_len=list(segments), backend="triton")
    watch = IndexOps(q.numel() // 2)
    with watch:
        p = solattn.video_plan(q, k, v, grid, **kw)
    assert watch.seen == [] and p.seq_len == 8 * 64 and p.kv_indices.shape[-1] == p.n   # the fused plan
    assert torch.equal(solattn.video_sparse_attn(q, k, v, grid, **kw, plan=p), solattn.video_sparse_attn(q, k, v, grid, **kw))


def test_torch_plan_refuses_a_row_table():
    grid, segments = (3, 7, 6), (5, 130)
    q, k, v = make_inputs(grid, segments=segments, dtype=torch.bfloat16)
    route = _route(grid, segments, "exempt", 2, q)
    raw, _ = route.prepare(route.call._replace(q=q, k=k, v=v, gate=None), "triton", False)
    with pytest.raises(ValueError, match="row table"):
        build_vsa_plan(raw, 2, route.layout.num_prefix_blocks, fused=False)
    assert dataclasses.replace(raw, rows=None).T == q.shape[1]


def test_fused_plan_makes_the_forward_kernels_copies_and_codes_on_the_way():
    """With ``extras``, the means kernel writes the tiled copies of k and v that ``tile_rows`` makes
    (zeros in the dead rows), and the select kernel the codes that ``len_codes`` makes; the plan
    hands each out once (:meth:`Plan.take`)."""
    grid, segments = (3, 7, 6), (5, 130)
    q, k, v = make_inputs(grid, B=2, H=2, D=16, segments=segments, dtype=torch.bfloat16, seed=7)
    route = _route(grid, segments, "compete", 2, q)
    problem, _ = route.prepare(route.call._replace(q=q, k=k, v=v, gate=None), "triton", False)
    plan = route.plan(problem, True, frozenset({"tiled_kv", "len_codes"}))
    ops = tb.kernel_operands(problem, plan)
    kt, vt = plan.take("tiled_kv")
    want_k, want_v = tb.tiled_kv(ops, problem.T)
    assert torch.equal(kt, want_k) and torch.equal(vt, want_v)
    assert torch.equal(want_k.float(), tiling.to_tiled(k, route.layout).float())    # zeros in the dead rows
    codes = plan.take("len_codes")
    listed = torch.arange(codes.shape[-1]) < ops.kv_num[..., None]
    idx = ops.kv_idx.long()
    assert (ops.block_len < 64).any() and listed.any() and not listed.all()
    assert torch.equal(codes[listed], (idx | ((64 - ops.block_len[idx]) << 16))[listed].int())
    assert plan.take("tiled_kv") is None and plan.take("len_codes") is None
    with pytest.raises(ValueError, match=r"'extras' received \['tiles'\]"):
        route.plan(problem, True, frozenset({"tiles"}))


def test_tiled_copies_are_the_tiled_layout_in_as_few_launches_as_dtypes_and_strides_allow(monkeypatch):
    """``tiled_copies`` (the backward's q, k, v, dO and gate; the forward's k and v): each tensor as
    ``tiling.to_tiled`` lays it out, dead rows zero; one launch per run of up to five tensors of
    one dtype and strides; an fp32 gate, a transposed view and a sixth tensor start new runs, a
    tensor of another dtype or strides between two of one run makes one launch per tensor. Views
    of one buffer in any order, one tensor given three times and broadcast (stride-0) views are
    read where they lie."""
    lay = tiling.layout((3, 7, 6), tiling.DEFAULT_CUBE, (5, 130), torch.device("cpu"))
    T_in, T = 5 + 130 + 3 * 7 * 6, lay.block_len.shape[0] * 64
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(2, T_in, 3, 16, generator=g).to(torch.bfloat16) for _ in range(5)]
    gate32 = torch.rand(2, T_in, 3, 16, generator=g)
    view = torch.randn(2, 3, T_in, 16, generator=g).to(torch.bfloat16).transpose(1, 2)
    launched = []
    real = jit.compiled
    monkeypatch.setattr(jit, "compiled", lambda interpret, fn: launched.append(fn.fn.__name__) or real(interpret, fn))
    q, k, v = torch.randn(2, T_in, 3, 3, 16, generator=g).to(torch.bfloat16).unbind(2)
    row = torch.randn(1, 1, 3, 16, generator=g).to(torch.bfloat16)
    broadcast = [row.expand(2, T_in, 3, 16), row[:, :, :1].expand(2, T_in, 3, 16)]
    for group, launches in ((xs, 1), (xs[:3] + [gate32], 2), ([view] + xs[:2], 2), (xs + xs[:1], 2), (xs[:1], 1),
                            (xs[:2] + [gate32] + xs[2:3], 4), ([v, k, q], 1), (xs[1:2] * 3, 1), (broadcast, 2)):
        launched.clear()
        got = tb.tiled_copies(group, lay.gather, lay.block_len, T)
        assert launched == ["tile_rows"] * launches
        assert len(got) == len(group)
        for a, x in zip(got, group):
            want = tiling.to_tiled(x, lay)
            assert a.dtype == x.dtype and a.is_contiguous() and torch.equal(a, want)
        assert (lay.block_len < 64).any()          # dead rows, zero in both


def test_tiled_copies_of_tensors_an_odd_number_of_bytes_apart_are_exact():
    """Two bf16 tensors of one dtype and strides whose addresses differ by an odd number of bytes
    (foreign memory, e.g. ``torch.frombuffer`` at an odd offset): no element offset reaches the
    second from the first, so each is copied from its own address, exactly."""
    lay = tiling.layout((2, 4, 4), tiling.DEFAULT_CUBE, (), torch.device("cpu"))
    T_in, T = 32, lay.block_len.shape[0] * 64
    count = 2 * T_in * 2 * 16
    buf = bytearray(4 * count + 16)
    a, b = (torch.frombuffer(buf, dtype=torch.bfloat16, offset=at, count=count).view(2, T_in, 2, 16)
            for at in (0, 2 * count + 1))
    assert (b.data_ptr() - a.data_ptr()) % 2 == 1
    g = torch.Generator().manual_seed(8)
    for x in (a, b):
        x.copy_(torch.randn(x.shape, generator=g))
    got = tb.tiled_copies([a, b], lay.gather, lay.block_len, T)
    for copy, x in zip(got, (a, b)):
        assert torch.equal(copy, tiling.to_tiled(x, lay))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the interpreter's copies of GPU tensors")
def test_tiled_copies_of_gpu_tensors_under_the_interpreter(monkeypatch):
    """Under ``TRITON_INTERPRET=1`` GPU tensors reach a kernel as host copies of their storages, so
    tensors of two storages are copied one launch each (from its own copy), and views of one
    storage still in one launch: each as ``tiling.to_tiled`` lays it out."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    lay = tiling.layout((3, 7, 6), tiling.DEFAULT_CUBE, (5,), torch.device("cuda"))
    T_in, T = 5 + 3 * 7 * 6, lay.block_len.shape[0] * 64
    qkv = torch.randn(2, T_in, 3, 2, 16, device="cuda").to(torch.bfloat16)
    other = torch.randn(2, T_in, 3, 2, 16, device="cuda").to(torch.bfloat16)[:, :, 0]
    xs = list(qkv.unbind(2)) + [other]
    launched = []
    real = jit.compiled
    monkeypatch.setattr(jit, "compiled", lambda interpret, fn: launched.append(fn.fn.__name__) or real(interpret, fn))
    got = tb.tiled_copies(xs, lay.gather, lay.block_len, T)
    assert launched == ["tile_rows"] * 2
    for copy, x in zip(got, xs):
        assert torch.equal(copy, tiling.to_tiled(x, lay))
