"""``video_sparse_attn``'s fused backward (the ``triton`` backend; Triton's interpreter on the
CPU) against the float64 VSA-H3 oracle of test_video.py, and what that backward runs: the
forward's plan (no selection again), the coarse branch's gradient from the block terms (no
autograd graph through a rebuilt plan) and no elementwise pass over q-sized tensors beyond the
layout's own gathers."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from solattn.testing import triton_interpretable

if not triton_interpretable():
    pytest.skip("needs Triton >= 3.9 for its CPU interpreter", allow_module_level=True)

import solattn  # noqa: E402
from solattn.op import route as oproute, saved  # noqa: E402
from solattn.op.call import Call  # noqa: E402
from solattn.triton_runtime import jit  # noqa: E402
from solattn.testing import dense_gradient_error, rel_l2, tolerance  # noqa: E402
from tests.op.test_video import make_inputs, oracle_vsa  # noqa: E402


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


CASES = {
    # name: (grid, B, prefix segments, prefix mode, k_vid, gate: "tensor" | "video" | a constant | None,
    #        seed of inputs whose tile scores are well apart at every threshold)
    "B2-partial-cubes-two-segments-tensor-gate": ((5, 6, 7), 2, (70, 5), "exempt", 3, "tensor", 9),
    "constant-gate-compete": ((4, 6, 6), 1, (10,), "compete", 2, 0.7, 11),
    "video-part-gate": ((4, 5, 6), 1, (20,), "exempt", 2, "video", 5),
    "no-gate-no-prefix": ((3, 7, 6), 2, (), "exempt", 2, None, 6),
}
SLOW = {"constant-gate-compete", "video-part-gate", "no-gate-no-prefix"}


def _gate(kind, q, segments, seed):
    if kind is None or isinstance(kind, float):
        return kind
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(q.dtype)
    return g if kind == "tensor" else g[:, sum(segments):].clone()


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CASES])
def test_fused_gradients_match_float64_oracle(case):
    grid, B, segments, mode, k_vid, kind, seed = CASES[case]
    q, k, v = make_inputs(grid, B=B, segments=segments, dtype=torch.float16, seed=seed)
    gate = _gate(kind, q, segments, 4)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    tensors = [q, k, v] + ([gate] if isinstance(gate, torch.Tensor) else [])
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    gate_arg = leaves[3] if len(leaves) == 4 else gate
    out = solattn.video_sparse_attn(*leaves[:3], grid, topk=k_vid, gate=gate_arg, prefix_len=segments,
                                    prefix_mode=mode, backend="triton")
    got = torch.autograd.grad((out.float() * w).sum(), leaves)

    exact = [t.detach().double().requires_grad_(True) for t in tensors]
    want_gate = exact[3] if len(exact) == 4 else gate
    if kind == "video":                           # the prefix rows' gate is 0
        want_gate = torch.cat([want_gate.new_zeros(B, sum(segments), *q.shape[2:]), want_gate], dim=1)
    want, gap = oracle_vsa(*exact[:3], grid, k_vid, gate=want_gate, segments=segments, mode=mode)
    assert gap > 0.02                                  # the selection cannot hinge on rounding
    wanted = torch.autograd.grad((want * w.double()).sum(), exact)
    level = max(tolerance(torch.float16), 2 * dense_gradient_error(q, k, v, w))
    for name, a, b in zip(("q", "k", "v", "gate"), got, wanted):
        assert a.dtype == torch.float16 and a.shape == b.shape, name
        assert torch.isfinite(a).all(), name
        assert b.abs().sum() > 0, name
        err = rel_l2(a, b)
        assert err < level, f"{name}: relative L2 {err:.3e} >= {level:.3e}"


class OpCounts(TorchDispatchMode):
    """Counts the aten ops run under it, and among them those with an output of at least ``big``
    elements; a Triton kernel launch counts as one op (``kernel:<name>``), the interpreter's own
    tensor traffic inside it is not counted."""

    def __init__(self, big: int):
        super().__init__()
        self.big = big
        self.ops = collections.Counter()
        self.large = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        outs = out if isinstance(out, (tuple, list)) else [out]
        if any(isinstance(t, torch.Tensor) and t.numel() >= self.big for t in outs):
            self.large[name] += 1
        return out


@pytest.fixture
def counted_launches(monkeypatch):
    """Interpreted kernel launches run outside any dispatch mode and are counted by the active one."""
    real = jit.Interpreted.__getitem__
    modes = []

    def getitem(self, grid):
        run = real(self, grid)

        def launch(*args, **kwargs):
            if modes:
                modes[-1].ops["kernel:" + self.kernel.fn.__name__] += 1
            with _disable_current_modes():
                return run(*args, **kwargs)
        return launch

    monkeypatch.setattr(jit.Interpreted, "__getitem__", getitem)
    return modes


@pytest.mark.parametrize("gate_kind", ["tensor", "constant", "none"])
def test_backward_reuses_the_plan_and_copies_only_tiles(gate_kind, monkeypatch, counted_launches):
    """The backward takes the forward's plan (no selection ops, no plan built; a gate changes nothing)
    and carries the coarse branch's gradient without autograd (no ``*_backward`` ops); its only
    q-sized work is one tiled copy of each input its kernels' inner loops read or its kernels
    index by tiled row (q, k, v, the output's gradient and a gate tensor, in one launch with the
    dead rows' zeros) and the gradients' buffers: the kernels read the output and write the gradients
    in the caller's token order through the layout's row table, so nothing is gathered back; the
    block means come from the dq kernel; the query lists (the selection transposed) from one
    kernel of their own. A backward
    that rebuilt the plan with autograd ran a top-k, block sums of q, k and v, a softmax backward,
    and per tensor a reshape copy of the expanded mean gradient, its cast and its addition."""
    grid, segments = (4, 6, 6), (40,)
    q, k, v = (t.requires_grad_(True) for t in make_inputs(grid, segments=segments, dtype=torch.float16, seed=7))
    gate = torch.randn(q.shape, generator=torch.Generator().manual_seed(7)).half().requires_grad_(True)
    gate = {"tensor": gate, "constant": 0.5, "none": None}[gate_kind]
    built = []
    real_build = oproute.build_vsa_plan
    monkeypatch.setattr(oproute, "build_vsa_plan", lambda *a, **kw: built.append(1) or real_build(*a, **kw))

    out = solattn.video_sparse_attn(q, k, v, grid, topk=2, gate=gate, prefix_len=segments, backend="triton")
    assert len(built) == 1
    grad_out = torch.randn(q.shape).half()
    with OpCounts(q.numel()) as counts:
        counted_launches.append(counts)
        out.backward(grad_out)
    assert len(built) == 1, "the backward built a plan"
    assert counts.ops["kernel:sol_attn_bwd_dq"] == 1 and counts.ops["kernel:sol_attn_bwd_dkdv"] == 1
    # the plan's n-wide lists are transposed by their own kernel, not through a dense mask
    assert counts.ops["kernel:query_lists_kernel"] == 1, counts.ops
    assert not {"scatter_", "cumsum", "masked_fill_"} & set(counts.ops), counts.ops
    assert not {"topk", "sort", "kthvalue", "argsort"} & set(counts.ops), counts.ops
    assert not [name for name in counts.ops if "backward" in name], counts.ops
    coarse = gate_kind != "none"                  # the coarse branch's block gradients: two kernels, no products
    assert (counts.ops["kernel:coarse_rows_kernel"], counts.ops["kernel:coarse_cols_kernel"], counts.ops["bmm"]) == \
        (coarse, coarse, 0), counts.ops
    # the tiled copies (q, k, v, dO and a gate tensor, one dtype and strides here): one launch into
    # one buffer, no gather and no fill
    assert counts.ops["kernel:tile_rows"] == 1, counts.ops
    assert dict(counts.large) == {"empty": 1 + 3 + (gate_kind != "none")}, counts.large
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.slow
def test_rebuilt_plan_gives_the_kept_plans_gradients(monkeypatch):
    """A backward without the forward's plan (a compiled graph, or none handed over) rebuilds it
    from its tiled copies; the gradients are those of the kept plan, bit for bit."""
    grid, segments = (4, 5, 6), (20,)
    q, k, v = make_inputs(grid, segments=segments, dtype=torch.float16, seed=5)
    gate = torch.randn(q.shape, generator=torch.Generator().manual_seed(8)).half()
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(9))

    def grads():
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, gate)]
        out = solattn.video_sparse_attn(*leaves[:3], grid, topk=2, gate=leaves[3], prefix_len=segments,
                                        backend="triton")
        return torch.autograd.grad((out.float() * w).sum(), leaves)

    kept = grads()
    monkeypatch.setattr(saved.PLANS, "take", lambda fused: None)
    rebuilt = grads()
    for name, a, b in zip(("q", "k", "v", "gate"), kept, rebuilt):
        assert torch.equal(a, b), name


def test_triton_backward_refuses_a_row_table_problem():
    """The backward kernels read the problem's rows as they are; a problem read through a row table
    (the forward's layout) is refused before any work, naming what it received and what it takes."""
    from solattn.backends.triton.backward import fused_backward
    grid, segments = (2, 4, 4), (10,)
    q, k, v = make_inputs(grid, segments=segments, dtype=torch.float32, seed=1)
    route = oproute.VideoRoute(Call(q, k, v, grid=list(grid), k_vid=2, segments=list(segments)))
    problem = route.row_problem(route.call._replace(q=q, k=k, v=v, gate=None))
    with pytest.raises(ValueError, match=r"row table \(Problem.rows\); allowed: a problem whose q, k, v hold"):
        fused_backward(problem, None, q, q, q, q)
