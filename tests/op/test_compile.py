"""``sol_attn`` and ``video_sparse_attn`` are one torch.library custom op (``solattn::sol_attn``, on
two routes): torch.compile(fullgraph=True) traces each call as one node, and its backward as one op."""

from __future__ import annotations

import warnings

import pytest
import torch

import solattn
from solattn.op.call import Call
from solattn.testing import make_qkv, rel_l2

from tests.support.marks import gpu_marked


def test_custom_op_registered_with_fake_impl():
    op = torch.ops.solattn.sol_attn.default
    assert op is not None
    q, k, v = (x.to("meta") for x in make_qkv(1, 100, 2, 8, dtype=torch.bfloat16))
    out = solattn.sol_attn(q, k, v, topk_ratio=0.5)   # runs the fake implementation on meta
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and out.is_contiguous()


def test_compile_fullgraph_no_graph_break():
    torch._dynamo.reset()
    q, k, v = make_qkv(1, 150, 2, 16, seed=1)
    gate = torch.randn_like(q)

    def f(q, k, v, gate):
        return solattn.sol_attn(q * 1.0, k, v, topk_ratio=0.5, coarse_gate=gate) * 2.0

    from torch._dynamo.testing import CompileCounter
    counter = CompileCounter()
    compiled = torch.compile(f, fullgraph=True, backend=counter)
    got = compiled(q, k, v, gate)
    assert counter.frame_count == 1
    assert rel_l2(got, f(q, k, v, gate)) < 1e-6
    explained = torch._dynamo.explain(f)(q, k, v, gate)
    assert explained.graph_break_count == 0 and explained.graph_count == 1

    inductor = torch.compile(f, fullgraph=True)
    out = inductor(q.bfloat16(), k.bfloat16(), v.bfloat16(), gate.bfloat16())
    assert out.dtype == torch.bfloat16 and out.is_contiguous()
    assert rel_l2(out, f(q, k, v, gate)) < 2e-2


def test_export_sees_one_node():
    q, k, v = make_qkv(1, 100, 2, 8)

    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return solattn.sol_attn(q, k, v, topk_ratio=0.5)

    ep = torch.export.export(M(), (q, k, v))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.solattn.sol_attn.default in targets


def test_video_sparse_attn_compiles_fullgraph_as_one_node():
    torch._dynamo.reset()
    grid = (4, 8, 8)
    q, k, v = make_qkv(1, 4 * 8 * 8 + 10, 2, 16, seed=3)
    gate = torch.randn_like(q)

    def f(q, k, v, gate):
        return solattn.video_sparse_attn(q, k, v, grid, topk=2, gate=gate, prefix_len=10) + 1.0

    from torch._dynamo.testing import CompileCounter
    counter = CompileCounter()
    got = torch.compile(f, fullgraph=True, backend=counter)(q, k, v, gate)
    assert counter.frame_count == 1
    assert rel_l2(got, f(q, k, v, gate)) < 1e-6
    explained = torch._dynamo.explain(f)(q, k, v, gate)
    assert explained.graph_break_count == 0

    # gradients flow through the op's autograd (recompute through the portable backend)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, gate)]
    f(*leaves).square().sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in leaves)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _grads(fn, inputs):
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    fn(*leaves).backward()
    return [t.grad for t in leaves]


@pytest.mark.slow
@pytest.mark.parametrize("device", gpu_marked(DEVICES))
@pytest.mark.parametrize("fullgraph", [False, True])
def test_compiled_backward_matches_eager(device, fullgraph):
    """Training through a compiled ``sol_attn``, ``fullgraph=True`` included (the backward is one
    opaque op, ``solattn::sol_attn_backward``, that decides at run time whether the fused backward
    applies): the gradients of q, k, v, the coarse gate and a float key bias are the eager ones.
    On CUDA the forward runs the triton kernel, so the op runs the fused backward."""
    torch._dynamo.reset()
    q, k, v = (x.to(device) for x in make_qkv(1, 300, 2, 32, seed=4))
    gate = torch.randn_like(q) * 0.1
    bias = torch.randn(1, 300, device=device) * 0.5

    def loss(q, k, v, gate, bias):
        return (solattn.sol_attn(q, k, v, topk_ratio=0.3, coarse_gate=gate, key_bias=bias) ** 2).sum()

    want = _grads(loss, (q, k, v, gate, bias))
    got = _grads(torch.compile(loss, backend="aot_eager", fullgraph=fullgraph), (q, k, v, gate, bias))
    for g, w in zip(got, want):
        assert g is not None and g.shape == w.shape and torch.isfinite(g).all()
        assert rel_l2(g, w) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("device", gpu_marked(DEVICES))
def test_compiled_vsa_backward_fullgraph_matches_eager(device):
    """The same for ``video_sparse_attn`` (the same backward op on VSA's route): a gate tensor
    and a prefix, ``fullgraph=True``."""
    torch._dynamo.reset()
    grid = (4, 8, 8)
    q, k, v = (x.to(device) for x in make_qkv(1, 4 * 8 * 8 + 10, 2, 32, seed=5))
    gate = torch.randn_like(q) * 0.1

    def loss(q, k, v, gate):
        return (solattn.video_sparse_attn(q, k, v, grid, topk=2, gate=gate, prefix_len=10) ** 2).sum()

    want = _grads(loss, (q, k, v, gate))
    got = _grads(torch.compile(loss, backend="aot_eager", fullgraph=True), (q, k, v, gate))
    for g, w in zip(got, want):
        assert g is not None and g.shape == w.shape and torch.isfinite(g).all()
        assert rel_l2(g, w) < 1e-6


def test_backward_ops_registered_with_fake_impls():
    """The backward ops trace on meta tensors: gradients of the inputs' shapes and dtypes, and a
    ``(0,)`` tensor for a gradient not asked for."""
    q, k, v = (x.to("meta") for x in make_qkv(1, 100, 2, 8, dtype=torch.bfloat16))
    flag = torch.empty((), dtype=torch.int64, device="meta")
    lse = torch.empty((0,), device="meta")
    call = Call(q, k, v, gate=q, topk_ratio=0.5, tail=True)
    grads = torch.ops.solattn.sol_attn_backward(*call.operands(), q, lse, lse, flag, q, False, True)
    assert [tuple(g.shape) for g in grads] == [tuple(q.shape)] * 4 + [(0,)]
    assert all(g.dtype == torch.bfloat16 for g in grads[:4])
    # video_sparse_attn's backward is the same op on VSA's route (a grid, k_vid, prefix segments)
    call = Call(q, k, v, grid=[1, 8, 8], k_vid=1, segments=[36])
    grads = torch.ops.solattn.sol_attn_backward(*call.operands(), q, lse, lse, flag, q, False, False)
    assert [tuple(g.shape) for g in grads] == [tuple(q.shape)] * 3 + [(0,), (0,)]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sol_attn", "video_sparse_attn"])
def test_compiled_autograd_backward_matches_eager(name):
    """An eager forward whose backward runs under compiled autograd (dynamo traces the backward, so
    the backward op runs inside AOTAutograd's runtime, where the dispatcher also excludes the
    ADInplaceOrView key): the gradients of q, k, v and the coarse gate are the eager ones (the
    local recompute graph lost its in-place writes into views and q, k, v got wrong gradients)."""
    from torch._dynamo import compiled_autograd
    torch._dynamo.reset()
    grid = (2, 8, 8)
    q, k, v = make_qkv(1, 2 * 8 * 8 + 10, 2, 16, seed=12)
    gate = torch.randn_like(q) * 0.1
    if name == "sol_attn":
        def loss(q, k, v, gate):
            return (solattn.sol_attn(q, k, v, topk_ratio=0.3, coarse_gate=gate) ** 2).sum()
    else:
        def loss(q, k, v, gate):
            return (solattn.video_sparse_attn(q, k, v, grid, topk=1, gate=gate, prefix_len=10) ** 2).sum()
    want = _grads(loss, (q, k, v, gate))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, gate)]
    out = loss(*leaves)
    with compiled_autograd._enable(torch.compile(backend="aot_eager")):
        out.backward()
    for g, w in zip((t.grad for t in leaves), want):
        assert g is not None and torch.isfinite(g).all()
        assert rel_l2(g, w) < 1e-6


def test_traced_backward_without_dispatch_guards_says_why(monkeypatch):
    """A torch without the private dispatch-key guard the backward op needs: a clear error that
    names it, not a failure inside autograd."""
    torch._dynamo.reset()
    q, k, v = make_qkv(1, 200, 2, 32, seed=8)
    compiled = torch.compile(lambda q: solattn.sol_attn(q, k, v, topk_ratio=0.4).sum(), backend="aot_eager",
                             fullgraph=True)
    leaf = q.clone().requires_grad_(True)
    out = compiled(leaf)
    monkeypatch.delattr(torch._C, "_ForceDispatchKeyGuard")
    with pytest.raises(RuntimeError, match="traced \\(compiled\\) backward needs torch's dispatch-key guards"):
        out.backward()


def _ops():
    grid = (4, 8, 8)
    k0, v0 = make_qkv(1, 4 * 8 * 8 + 10, 2, 16, seed=9)[1:]
    return {"sol_attn": lambda q: solattn.sol_attn(q, k0, v0, topk_ratio=0.4),
            "video_sparse_attn": lambda q: solattn.video_sparse_attn(q, k0, v0, grid, topk=2, prefix_len=10)}


@pytest.mark.parametrize("name", ["sol_attn", "video_sparse_attn"])
@pytest.mark.parametrize("transform", ["jvp", "grad", "vjp", "dual"])
def test_differentiating_transforms_are_refused(name, transform):
    """torch.func's grad / vjp / jvp and forward-mode dual tensors: a clear error naming the function
    before any work (torch.func.jvp used to return a zero tangent, silently)."""
    fn = _ops()[name]
    q = make_qkv(1, 4 * 8 * 8 + 10, 2, 16, seed=9)[0]
    calls = {"jvp": lambda: torch.func.jvp(fn, (q,), (torch.ones_like(q),)),
             "grad": lambda: torch.func.grad(lambda x: fn(x).sum())(q),
             "vjp": lambda: torch.func.vjp(fn, q)}
    with pytest.raises(NotImplementedError, match=f"{name}: .* is not supported.*torch.autograd"):
        if transform == "dual":
            from torch.autograd import forward_ad
            with forward_ad.dual_level():
                fn(forward_ad.make_dual(q, torch.ones_like(q)))
        else:
            calls[transform]()


@pytest.mark.parametrize("name", ["sol_attn", "video_sparse_attn"])
def test_vmap_runs_per_entry(name):
    """torch.vmap is not refused: over a batch of queries it equals one call per entry."""
    fn = _ops()[name]
    qs = torch.stack([make_qkv(1, 4 * 8 * 8 + 10, 2, 16, seed=s)[0] for s in (10, 11)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                 # torch's "no batching rule" performance note
        got = torch.vmap(fn)(qs)
    for i in range(2):
        assert torch.equal(got[i], fn(qs[i]))


@pytest.mark.parametrize("name", ["sol_attn", "video_sparse_attn"])
def test_transform_whose_derivative_skips_the_op_runs(name):
    """torch.func.grad of a function that only closes over the operator's inputs (frozen attention
    inputs): nothing is differentiated through the op, so it runs and the gradient is right."""
    fn = _ops()[name]
    q = make_qkv(1, 4 * 8 * 8 + 10, 2, 16, seed=9)[0]
    out = fn(q)
    got = torch.func.grad(lambda w: (w * fn(q)).sum())(torch.tensor(2.0))
    assert torch.allclose(got, out.sum())
    with pytest.raises(NotImplementedError, match="torch.func transform"):
        torch.func.grad(lambda x: fn(x).sum())(q)          # and through the op it is refused


@pytest.mark.slow
def test_compiled_vmap_fullgraph():
    """torch.compile(torch.vmap(f), fullgraph=True) traces the operator (the transform check steps
    aside while Dynamo traces) and equals one call per entry."""
    torch._dynamo.reset()
    fn = _ops()["sol_attn"]
    qs = torch.stack([make_qkv(1, 4 * 8 * 8 + 10, 2, 16, seed=s)[0] for s in (12, 13)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = torch.compile(torch.vmap(fn), fullgraph=True, backend="aot_eager")(qs)
    for i in range(2):
        assert torch.equal(got[i], fn(qs[i]))


@pytest.mark.slow
@pytest.mark.parametrize("call", ["sol_attn", "vsa_sparsity", "vsa_float_gate", "sol_attn_train"])
def test_compile_dynamic_shapes_and_floats(call):
    """torch.compile(dynamic=True) makes shapes and Python floats (tau, sparsity, a float gate)
    symbolic: the argument checks trace, the results equal eager at two sequence lengths, and a
    non-finite float is still refused."""
    torch._dynamo.reset()
    grid = (4, 8, 8)

    def fn(q, k, v):
        if call.startswith("sol_attn"):
            return solattn.sol_attn(q, k, v, topk_ratio=0.4, tau=1.5)
        return solattn.video_sparse_attn(q, k, v, grid, sparsity=0.5, prefix_len=q.shape[1] - 256,
                                         gate=0.5 if call == "vsa_float_gate" else None)

    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    for T in (266, 300):
        q, k, v = make_qkv(1, T, 2, 16, seed=T)
        if call == "sol_attn_train":
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
            compiled(*leaves).square().sum().backward()
            want = _grads(lambda *x: fn(*x).square().sum(), (q, k, v))
            for leaf, w in zip(leaves, want):
                assert rel_l2(leaf.grad, w) < 1e-6
        else:
            assert rel_l2(compiled(q, k, v), fn(q, k, v)) < 1e-6
    with pytest.raises(ValueError, match="tau"):
        solattn.sol_attn(q, k, v, tau=float("nan"))


@pytest.mark.slow
@pytest.mark.parametrize("wrt", ["q", "k", "v"])
@pytest.mark.parametrize("case", ["tail", "gate", "key_bias", "block_len"])
def test_vectorized_jacobian_equals_vector_jacobian_products(case, wrt):
    """torch.autograd.functional.jacobian(vectorize=True), which vmaps the backward over the
    output's cotangents, through the portable backend: contracted with a cotangent, the Jacobian
    equals that cotangent's vector-Jacobian product. Query and value are laid out as (B, H, T, D)
    tensors transposed (a viewed layout) and the key as a slice of a packed qkv tensor (a copied
    one). The backward used to fail here on ``as_strided``, which has no batching rule."""
    T, H, D = 200, 2, 8        # (at 130 tokens, D = 8, the backward did not reach as_strided)
    q, k, v = make_qkv(1, T, H, D, seed=31)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)
    v = v.transpose(1, 2).contiguous().transpose(1, 2)
    k = torch.stack([k, k], dim=3)[:, :, :, 0]
    kw = {"tail": dict(tau=0.5),
          "gate": dict(tau=0.5, coarse_gate=torch.rand(q.shape, generator=torch.Generator().manual_seed(1))),
          "key_bias": dict(topk_ratio=0.4, key_bias=torch.randn(T, generator=torch.Generator().manual_seed(2))),
          "block_len": dict(topk_ratio=0.4, block_len=torch.tensor([64, 30, 64, 2], dtype=torch.int32))}[case]
    inputs = dict(q=q, k=k, v=v)

    def f(x):
        return solattn.sol_attn(**dict(inputs, **{wrt: x}), backend="sdpa", **kw)

    x = inputs[wrt]
    J = torch.autograd.functional.jacobian(f, x, vectorize=True)          # out.shape + x.shape
    cot = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    xl = x.detach().requires_grad_(True)
    want, = torch.autograd.grad(f(xl), xl, cot)
    got = torch.tensordot(cot, J, dims=4)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert want.abs().sum() > 0
