"""``sol_attn`` is a torch.library custom op: torch.compile(fullgraph=True) traces it as one node."""

from __future__ import annotations

import torch

import solattn
from solattn.testing import make_qkv, rel_l2


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


def test_compiled_backward_matches_eager():
    """Training through a compiled ``sol_attn`` (without ``fullgraph=True``: the op's backward
    decides at run time whether the fused backward applies, one graph break): the gradients of
    q, k, v and the coarse gate are the eager ones."""
    torch._dynamo.reset()
    q, k, v = make_qkv(1, 300, 2, 32, seed=4)
    gate = torch.randn_like(q) * 0.1

    def loss(q, k, v, gate):
        return (solattn.sol_attn(q, k, v, topk_ratio=0.3, coarse_gate=gate) ** 2).sum()

    grads = {}
    for name, fn in (("eager", loss), ("compiled", torch.compile(loss, backend="aot_eager"))):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, gate)]
        fn(*leaves).backward()
        grads[name] = [t.grad for t in leaves]
    for got, want in zip(grads["compiled"], grads["eager"]):
        assert got is not None and torch.isfinite(got).all()
        assert rel_l2(got, want) < 1e-6
