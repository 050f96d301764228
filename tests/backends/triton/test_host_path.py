"""The host side of a call on the ``triton`` backend: what is made once and shared (tuning
defaults, launch configs, device capabilities, the fused plan's zero centroid), what a plain eager
call no longer allocates, and the VSA route's problems, built without re-validating, against the
validated ones. Each cache is checked against a freshly built value, keyed by what it depends on,
and safe from in-place use."""

from __future__ import annotations

import collections
import contextlib
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from solattn import config, triton_runtime
from solattn.op import custom, route as oproute
from solattn.op.call import Call
from solattn.backends.triton import KernelConfig, TritonTuning
from solattn.backends.triton.operands import _as
from solattn.routing import fused
from solattn.testing import triton_interpretable
from solattn.validation import validate


class Dispatched(TorchDispatchMode):
    """Every aten op dispatched in the block, as (name, shape, dtype) of its (first) output."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (tuple, list)) else out
        shape = tuple(first.shape) if isinstance(first, torch.Tensor) else None
        self.seen.append((func.overloadpacket.__name__, shape, getattr(first, "dtype", None)))
        return out

    def allocations(self):
        return [s for s in self.seen if s[0] in ("empty", "zeros", "empty_like", "zeros_like", "full",
                                                 "scalar_tensor", "lift_fresh")]


def test_default_tuning_is_made_once_and_equals_a_fresh_one():
    for kind in (TritonTuning, fused.FusedPlanTuning):
        config.reset_tuning(kind)
        first = config.current_tuning(kind)
        assert first == kind() and config.current_tuning(kind) is first
        chosen = kind(**({"tma_min_programs": 7} if kind is TritonTuning else {"block_i": 8}))
        with config.tuning(chosen):
            assert config.current_tuning(kind) is chosen           # scoped and process-wide values win
        config.set_tuning(chosen)
        try:
            assert config.current_tuning(kind) is chosen
        finally:
            config.reset_tuning(kind)
        assert config.current_tuning(kind) is first


def test_pointer_load_config_is_shared_and_equals_a_fresh_one():
    t = TritonTuning()
    small = t.forward_config(programs=8, recording=False, head_dim=64)
    assert small == KernelConfig(4, 3, tma=False) and t.forward_config(8, False, 64) is small
    assert t.forward_config(1 << 20, False, 64).tma and t.forward_config(8, True, 64).tma
    assert t.forward_config(8, False, 48) == KernelConfig(tma=False)          # no default for D=48


def test_cuda_capability_is_asked_once_per_device_and_query(monkeypatch):
    asked = []

    def query(device=None):
        asked.append(device)
        return (9, 0) if device.index == 0 else (8, 6)

    monkeypatch.setattr(torch.cuda, "get_device_capability", query)
    for _ in range(3):
        assert triton_runtime.cuda_capability(torch.device("cuda", 0)) == (9, 0)
        assert triton_runtime.cuda_capability(torch.device("cuda", 1)) == (8, 6)
    assert [d.index for d in asked] == [0, 1]
    assert triton_runtime.cuda_capability(torch.device("cuda")) == (8, 6)   # no index: asked each time
    assert len(asked) == 3
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert triton_runtime.cuda_capability(torch.device("cuda", 0)) == (7, 5)  # another query: asked afresh


def test_shared_zero_centroid_is_zeros_per_shape_and_device():
    a = fused._zeros(3, 16, torch.device("cpu"))
    assert torch.equal(a, torch.zeros(3, 16)) and a.dtype == torch.float32
    assert fused._zeros(3, 16, torch.device("cpu")) is a
    b = fused._zeros(4, 16, torch.device("cpu"))
    assert b is not a and b.shape == (4, 16) and torch.equal(b, torch.zeros(4, 16))


def test_shared_constants_are_fresh_inside_a_graph_capture(monkeypatch):
    """The plan's arange and the zero centroid come from one cache, which a CUDA graph capture
    bypasses (the graph owns what it makes) without entering what it makes into the cache. The
    capture is simulated: its test is what the cache asks."""
    from solattn import triton_runtime
    from solattn.routing import plan as plan_mod
    cpu = torch.device("cpu")
    shared = [plan_mod._arange(7, cpu), fused._zeros(2, 8, cpu)]
    monkeypatch.setattr(triton_runtime, "_capturing", lambda device: True)
    captured = [plan_mod._arange(7, cpu), fused._zeros(2, 8, cpu)]
    assert all(c is not s and torch.equal(c, s) for c, s in zip(captured, shared))
    monkeypatch.setattr(triton_runtime, "_capturing", lambda device: False)
    assert plan_mod._arange(7, cpu) is shared[0] and fused._zeros(2, 8, cpu) is shared[1]


def test_kernel_operand_conversion_copies_only_what_it_must():
    t = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    assert _as(t, torch.int32) is t
    assert _as(t.t(), torch.int32).is_contiguous() and torch.equal(_as(t.t(), torch.int32), t.t())
    f = torch.ones(3, requires_grad=True)
    g = _as(f, torch.float32)
    assert not g.requires_grad and torch.equal(g, f.detach())
    assert _as(t, torch.int64).dtype == torch.int64


def _video_route(q, grid, segments, scale=None):
    return oproute.VideoRoute(Call(q, q, q, scale=scale, grid=list(grid), k_vid=2, segments=list(segments)))


@pytest.mark.parametrize("segments, scale, gate",
                         [((70, 5), None, "tensor"), ((), 0.3, "constant"), ((64,), None, None)])
def test_video_problems_equal_the_validated_ones(segments, scale, gate):
    """The route builds its problems without validate(): field for field what validate() and the
    layout give, on the row table and on tiled copies."""
    grid = (3, 5, 6)
    T = sum(segments) + 90
    q, k, v = (torch.randn(2, T, 2, 16).to(torch.bfloat16) for _ in range(3))
    g = {"tensor": torch.rand(2, T, 2, 16).to(torch.bfloat16), "constant": torch.tensor(0.5).expand(q.shape),
         None: None}[gate]
    route = _video_route(q, grid, segments, scale)
    P = route.layout.num_prefix_blocks
    common = dict(block_len=route.layout.block_len, sink_q=(0, P) if P else None)

    rows = route.row_problem(route.call._replace(q=q, k=k, v=v, gate=g))
    want = dataclasses.replace(validate(q, k, v, scale=scale, tail=False,
                                        coarse_gate=g),
                               rows=route.layout.gather, **common)
    tq, tk, tv = (route.tiled(x) for x in (q, k, v))
    tiled = route.problem(route.call._replace(q=tq, k=tk, v=tv, gate=route.gate(g)))
    want_tiled = dataclasses.replace(validate(tq, tk, tv, scale=scale, tail=False, coarse_gate=route.gate(g)),
                                     dead_rows_zero=True, **common)
    for got, ref in ((rows, want), (tiled, want_tiled)):
        for f in dataclasses.fields(ref):
            a, b = getattr(got, f.name), getattr(ref, f.name)
            if isinstance(b, torch.Tensor):
                assert a is b or torch.equal(a, b), f.name
            else:
                assert a == b, f.name
        assert got.features == ref.features and got.T == ref.T and got.n == ref.n


@pytest.mark.skipif(not triton_interpretable(), reason="needs Triton >= 3.9 for its CPU interpreter")
def test_plain_eager_call_allocates_no_backward_outputs(monkeypatch):
    """A plain eager call runs :func:`solattn.op.route.forward_output`: its output is the op's (bit for
    bit), and neither the op's empty ``(0,)`` backward buffers nor its CPU flag are made; the fused
    plan's shared zero centroid is still zeros after the calls."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    grid, segments = (2, 8, 8), [70]
    T = 70 + 128
    q, k, v, g = (torch.randn(1, T, 2, 16, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
                  for i in range(4))
    call = Call(q, k, v, gate=g, grid=list(grid), k_vid=2, segments=segments, backend="triton")
    oproute.forward_output(call)                 # the layout's tables and the shared centroid: made once
    with Dispatched() as fast:
        out = oproute.forward_output(call)
    with Dispatched() as op:
        full = oproute.forward(call)
    assert torch.equal(out, full[0]) and full[1].shape == (0,) and full[3].shape == (2,)
    extra = collections.Counter(op.allocations())
    extra.subtract(fast.allocations())           # the interpreter's own allocations are the same in both
    assert +extra == collections.Counter([("empty", (0,), torch.float32), ("empty", (0,), torch.bfloat16),
                                          ("zeros", (2,), torch.int64)]) and not -extra
    assert torch.equal(fused._zeros(2, 16, torch.device("cpu")), torch.zeros(2, 16))


def test_coarse_block_grads_in_batched_products_match_float64():
    """The coarse term's block gradients, in one chunk and in many, against float64 autograd of
    ``softmax(scale qm km^T) vm``; the one-chunk path runs batched products only (no broadcasting
    matmul's expand and reshape ops, no staging buffers)."""
    from solattn.routing import BYTES_PER_SCORE
    from solattn.routing.coarse_grad import coarse_block_grads

    B, H, n, D, scale = 2, 3, 7, 16, 0.3
    g = torch.Generator().manual_seed(0)
    qm, km, vm, dco = (torch.randn(B, H, n, D, generator=g) for _ in range(4))
    leaves = [t.double().requires_grad_(True) for t in (qm, km, vm)]
    coarse = torch.softmax(scale * leaves[0] @ leaves[1].transpose(-1, -2), dim=-1) @ leaves[2]
    want = torch.autograd.grad(coarse, leaves, dco.double())
    with Dispatched() as ops:
        whole = coarse_block_grads(qm, km, vm, dco, scale)
    rows = coarse_block_grads(qm, km, vm, dco, scale, nbytes=BYTES_PER_SCORE * n)     # a row per chunk
    for got, chunked, ref in zip(whole, rows, want):
        assert got.shape == (B, H, n, D) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(chunked, got, rtol=1e-5, atol=1e-6)
    names = collections.Counter(s[0] for s in ops.seen)
    assert names["bmm"] == 5 and not {"expand", "_unsafe_view", "zeros_like", "zeros", "add_"} & set(names), names
    rows3 = [t.reshape(B * H, n, D) for t in (qm, km, vm, dco)]        # (B * H, n, D) in, the same out
    with Dispatched() as ops:
        flat = coarse_block_grads(*rows3, scale)
    assert "view" not in {s[0] for s in ops.seen}
    for got, ref in zip(flat, whole):
        assert got.shape == (B * H, n, D) and torch.equal(got, ref.reshape(B * H, n, D))


def test_dense_mask_and_query_lists_equal_a_loop():
    """The selection's dense mask (its padding read through the shared int32 arange) and the
    transposed lists, against a Python loop over the listed blocks."""
    from solattn.routing import Plan
    B, H, n, M = 2, 2, 6, 6
    g = torch.Generator().manual_seed(3)
    counts = torch.randint(0, M + 1, (B, H, n), generator=g, dtype=torch.int32)
    idx = torch.zeros(B, H, n, M, dtype=torch.int32)
    want = torch.zeros(B, H, n, n, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for i in range(n):
                picked = torch.randperm(n, generator=g)[:int(counts[b, h, i])].sort().values
                idx[b, h, i, :len(picked)] = picked.int()
                want[b, h, i, picked] = True
    plan = Plan(kv_num_blocks=counts, kv_indices=idx, block_len=torch.full((n,), 64, dtype=torch.int32),
                touches_dead=torch.zeros(B, H, n, dtype=torch.bool), seq_len=n * 64)
    assert torch.equal(plan.dense_mask(), want)
    q_num, q_idx = plan.query_lists()
    assert torch.equal(q_num, want.transpose(-1, -2).sum(-1, dtype=torch.int32))
    for b, h, j in ((b, h, j) for b in range(B) for h in range(H) for j in range(n)):
        rows = want[b, h, :, j].nonzero().flatten().int()
        assert torch.equal(q_idx[b, h, j, :len(rows)], rows) and not q_idx[b, h, j, len(rows):].any()


@pytest.mark.skipif(not triton_interpretable(), reason="needs Triton >= 3.9 for its CPU interpreter")
def test_plain_training_call_skips_the_custom_op_with_its_gradients(monkeypatch):
    """A plain eager call that records autograd runs the op's autograd without the op
    (:class:`solattn.op.custom._EagerAutograd`); its output and gradients are the op's, bit for bit (the
    op runs under a dispatch mode, here a FLOP counter)."""
    import solattn
    from torch.utils.flop_counter import FlopCounterMode

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    through_op = []
    real = custom.sol_attn_op
    monkeypatch.setattr(custom, "sol_attn_op", lambda *a: through_op.append(1) or real(*a))
    grid, P = (2, 8, 8), 70
    tensors = [torch.randn(1, P + 128, 2, 16, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
               for i in range(5)]
    results = []
    for mode in (None, FlopCounterMode(display=False)):
        leaves = [t.clone().requires_grad_(True) for t in tensors[:4]]
        with mode or contextlib.nullcontext():
            out = solattn.video_sparse_attn(*leaves[:3], grid, topk=2, gate=leaves[3], prefix_len=P, backend="triton")
            out.backward(tensors[4])
        results.append([out] + [x.grad for x in leaves])
        assert through_op == ([] if mode is None else [1])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_problem_rows_and_blocks_are_kept_per_problem():
    """``Problem.T`` and ``Problem.n`` are computed once per problem and kept; a problem made from
    it with another row table has its own."""
    q = torch.randn(1, 130, 2, 16)
    p = validate(q, q, q)
    assert (p.T, p.n) == (130, 3) and {"T", "n"} <= set(vars(p))
    r = dataclasses.replace(p, rows=torch.arange(256))
    assert (r.T, r.n) == (256, 4) and (p.T, p.n) == (130, 3)
