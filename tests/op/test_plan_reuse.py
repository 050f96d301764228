"""A plan is a selection: reused with other values (v, q and k, a gate), a call gives the definition
with that selection held, its tail, coarse and centring terms computed from its own tensors.

The expected outputs come from :func:`held_selection`, a float64 computation of SPEC.md's output
with the plan's lists as the exact sets ``E_i`` (independent of the routing package and of every
backend), and from the plan's own lists: ``plan(q, k, v2)`` selects what ``plan(q, k, v1)`` selects.
"""

from __future__ import annotations

import math

import pytest
import torch

import solattn
from solattn import routing
from solattn.testing import make_qkv, rel_l2, triton_interpretable

BLOCK = 64


def held_selection(q, k, v, exact, scale=None, tail=True, gate=None, block_len=None):
    """SPEC.md's output in float64 with the exact sets ``exact`` ``(B, H, n, n)`` bool held:
    centred exact logits over live keys of listed blocks, the pooled term of the others (``tail``),
    then ``+ gate * softmax(scale qm km^T) vm``. Differentiable in q, k, v and gate. ``(B, T, H, D)``."""
    B, T, H, D = q.shape
    n = -(-T // BLOCK)
    scale = D ** -0.5 if scale is None else scale
    f64 = torch.float64
    L = torch.full((n,), BLOCK, dtype=torch.int64) if block_len is None else block_len.long().clamp(1, BLOCK)
    L[-1] = min(int(L[-1]), T - BLOCK * (n - 1))
    tok_block = torch.arange(T) // BLOCK
    live = (torch.arange(T) % BLOCK) < L[tok_block]
    q, k, v = (torch.where(live[None, None, :, None], x.to(f64).transpose(1, 2), 0.0) for x in (q, k, v))

    def means(x):
        padded = torch.nn.functional.pad(x, (0, 0, 0, n * BLOCK - T))
        return padded.view(B, H, n, BLOCK, D).sum(dim=3) / L.to(f64)[:, None]

    qm, km, vm = means(q), means(k), means(v)
    m = km.mean(dim=2, keepdim=True)
    e = scale * (q @ (k - m).transpose(-1, -2))
    listed = exact[:, :, tok_block][:, :, :, tok_block] & live
    e = e.masked_fill(~listed, -math.inf)
    pooled = scale * (qm @ (km - m).transpose(-1, -2)) + torch.log(L.to(f64))
    pooled = pooled.masked_fill(exact if tail else torch.ones_like(exact), -math.inf)[:, :, tok_block]
    logits = torch.cat([e, pooled], dim=-1)
    w = torch.softmax(logits, dim=-1)
    out = (w @ torch.cat([v, vm], dim=2)).transpose(1, 2)
    if gate is not None:
        coarse = torch.softmax(scale * (qm @ km.transpose(-1, -2)), dim=-1) @ vm
        out = out + gate.to(f64) * coarse[:, :, tok_block].transpose(1, 2)
    return out


def _inputs(seed, B=2, T=300, H=2, D=32):
    return make_qkv(B, T, H, D, seed=seed)


CASES = [dict(topk_ratio=0.25), dict(topk_ratio=0.25, tail=False), dict(tau=0.5),
         dict(tau=0.5, tail=False), dict(topk_ratio=0.4, sink_blocks=(0, 1))]


def _reuse_cases():
    """Every case on sdpa; on flex (a compile per shape, 5-170 s) the tau case with a tail in the
    default run, the others slow."""
    for kw in CASES:
        name = ",".join(f"{k}={v}" for k, v in kw.items())
        yield pytest.param(kw, "sdpa", id=f"{name}-sdpa")
        slow = () if kw == dict(tau=0.5) else (pytest.mark.slow,)
        yield pytest.param(kw, "flex", id=f"{name}-flex", marks=slow)


@pytest.mark.parametrize("kw, backend", list(_reuse_cases()))
def test_a_plan_reused_with_other_v_gives_the_definition_with_its_selection(kw, backend):
    q, k, v1 = _inputs(0)
    v2 = make_qkv(2, 300, 2, 32, seed=1)[2] * 3 - 1
    gate = torch.rand(q.shape, generator=torch.Generator().manual_seed(2))
    for g in (None, gate):
        p = solattn.plan(q, k, v1, **kw, coarse_gate=g, backend=backend)
        got = solattn.sol_attn(q, k, v2, **kw, coarse_gate=g, plan=p, backend=backend)
        want = held_selection(q, k, v2, p.dense_mask(), tail=kw.get("tail", True), gate=g)
        assert rel_l2(got.double(), want) < 1e-5, (kw, g is not None)
        # v does not route: the fresh call on v2 selects the same blocks and gives the same output
        assert torch.equal(solattn.plan(q, k, v2, **kw, coarse_gate=g).kv_num_blocks, p.kv_num_blocks)
        fresh = solattn.sol_attn(q, k, v2, **kw, coarse_gate=g, backend=backend)
        assert rel_l2(got, fresh) < 1e-6


@pytest.mark.parametrize("kw", [dict(topk_ratio=0.25), dict(tau=0.5, tail=False)], ids=str)
def test_a_plan_reused_with_other_q_k_and_gate_holds_its_selection(kw):
    """Another layer sharing the layout: other q, k, v and gate; the selection is the plan's (not
    the one q2, k2 would route to), every value term is the call's."""
    q1, k1, v1 = _inputs(3)
    q2, k2, v2 = _inputs(4)
    k2 = k2 + 2.0                                  # another key offset: centring must be the call's
    g1, g2 = (torch.rand(q1.shape, generator=torch.Generator().manual_seed(s)) for s in (5, 6))
    p = solattn.plan(q1, k1, v1, **kw, coarse_gate=g1)
    assert not torch.equal(p.dense_mask(), solattn.plan(q2, k2, v2, **kw).dense_mask())   # a real reuse
    got = solattn.sol_attn(q2, k2, v2, **kw, coarse_gate=g2, plan=p)
    want = held_selection(q2, k2, v2, p.dense_mask(), tail=kw.get("tail", True), gate=g2)
    assert rel_l2(got.double(), want) < 1e-5
    # a plan built without a gate or tail serves a call with them: the selection does not depend on them
    p0 = solattn.plan(q1, k1, v1, topk_ratio=0.25, tail=False)
    got = solattn.sol_attn(q2, k2, v2, topk_ratio=0.25, tail=True, coarse_gate=g2, plan=p0)
    assert rel_l2(got.double(), held_selection(q2, k2, v2, p0.dense_mask(), tail=True, gate=g2)) < 1e-5


def test_a_plan_reused_with_a_block_len_uses_the_calls_live_rows():
    q, k, v1 = _inputs(7)
    v2 = _inputs(8)[2]
    bl = torch.tensor([64, 20, 64, 1, 64], dtype=torch.int32)
    p = solattn.plan(q, k, v1, topk_ratio=0.4, block_len=bl)
    got = solattn.sol_attn(q, k, v2, topk_ratio=0.4, block_len=bl, plan=p)
    want = held_selection(q, k, v2, p.dense_mask(), block_len=bl)
    live = (torch.arange(300) % 64) < bl.long()[torch.arange(300) // 64]
    assert rel_l2(got[:, live].double(), want[:, live]) < 1e-5


@pytest.mark.parametrize("kw", [dict(topk_ratio=0.25), dict(tau=0.5, tail=False)], ids=str)
def test_gradients_on_a_reused_plan_are_those_of_the_definition_with_its_selection(kw):
    q1, k1, v1 = _inputs(9, B=1, T=260)
    q2, k2, v2 = _inputs(10, B=1, T=260)
    gate = torch.rand(q2.shape, generator=torch.Generator().manual_seed(11))
    p = solattn.plan(q1, k1, v1, **kw)
    w = torch.randn(q2.shape, generator=torch.Generator().manual_seed(12))
    leaves = [t.clone().requires_grad_(True) for t in (q2, k2, v2, gate)]
    (solattn.sol_attn(*leaves[:3], **kw, coarse_gate=leaves[3], plan=p) * w).sum().backward()
    ref = [t.detach().double().requires_grad_(True) for t in (q2, k2, v2, gate)]
    (held_selection(*ref[:3], p.dense_mask(), tail=kw.get("tail", True), gate=ref[3]) * w.double()).sum().backward()
    for name, a, b in zip("qkvg", leaves, ref):
        assert rel_l2(a.grad.double(), b.grad) < 1e-5, name


def test_video_sparse_attn_reuses_a_plan_with_other_values():
    grid, P = (4, 8, 8), 70
    q, k, v1 = make_qkv(1, P + 256, 2, 64, seed=13)
    v2 = make_qkv(1, P + 256, 2, 64, seed=14)[2] * 2 + 1
    q2, k2, _ = make_qkv(1, P + 256, 2, 64, seed=15)
    g1, g2 = (torch.rand(q.shape, generator=torch.Generator().manual_seed(s)) for s in (16, 17))
    kw = dict(sparsity=0.75, prefix_len=P)
    p = solattn.video_plan(q, k, v1, grid, **kw, gate=g1)
    assert p.seq_len == 128 + 256                                                          # tiled rows
    # v and the gate do not route: the fresh call selects as p does and gives what p gives on v2
    assert torch.equal(solattn.video_plan(q, k, v2, grid, **kw, gate=g2).kv_num_blocks, p.kv_num_blocks)
    got = solattn.video_sparse_attn(q, k, v2, grid, **kw, gate=g2, plan=p)
    assert rel_l2(got, solattn.video_sparse_attn(q, k, v2, grid, **kw, gate=g2)) < 1e-6
    # other q and k: the plan's selection, in the tiled layout, against the definition
    got = solattn.video_sparse_attn(q2, k2, v2, grid, **kw, gate=g2, plan=p)
    from solattn.tiling import DEFAULT_CUBE, layout, to_tiled
    tiles = layout(grid, DEFAULT_CUBE, (P,), q.device)
    tq, tk, tv, tg = (to_tiled(x, tiles) for x in (q2, k2, v2, g2))
    want = held_selection(tq, tk, tv, p.dense_mask(), tail=False, gate=tg, block_len=tiles.block_len)
    assert rel_l2(got.double(), want.index_select(1, tiles.slots)) < 1e-5      # back to raw token order


@pytest.mark.skipif(not triton_interpretable(), reason="needs Triton >= 3.9 for its CPU interpreter")
@pytest.mark.parametrize("kw", [dict(topk_ratio=0.4), dict(tau=0.5, tail=False)], ids=str)
def test_the_triton_backend_reuses_a_plan_with_other_values(monkeypatch, kw):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v1 = make_qkv(1, 200, 2, 32, dtype=torch.float16, seed=18)
    q2, k2, v2 = make_qkv(1, 200, 2, 32, dtype=torch.float16, seed=19)
    gate = torch.rand(q.shape, generator=torch.Generator().manual_seed(20)).half()
    p = solattn.plan(q, k, v1, **kw, backend="triton")
    for args in ((q, k, v2), (q2, k2, v2)):
        got = solattn.sol_attn(*args, **kw, coarse_gate=gate, backend="triton", plan=p)
        want = held_selection(*args, p.dense_mask(), tail=kw.get("tail", True), gate=gate)
        assert rel_l2(got.double(), want) < 2e-3


# ----------------------------------------------------------------------------- what a plan is

def test_a_plan_holds_a_selection_only():
    q, k, v = _inputs(21)
    p = solattn.plan(q, k, v, topk_ratio=0.25, coarse_gate=q)
    for name in ("tail_lse", "tail_value", "coarse", "key_mean"):
        assert not hasattr(p, name), name
    assert (p.batch, p.heads, p.seq_len, p.block_size, p.n) == (2, 2, 300, 64, 5)
    mask = p.dense_mask()
    assert p.sparsity() == pytest.approx(1 - mask.double().mean().item())
    assert repr(p) == (f"Plan(batch=2, heads=2, seq_len=300, block_size=64, blocks=5, "
                       f"sparsity={100 * p.sparsity():.1f}%)")
    one = p[1, 0:1]
    assert (one.batch, one.heads) == (1, 1) and torch.equal(one.dense_mask(), mask[1:2, 0:1])
    head = p[:, 1]
    assert (head.batch, head.heads) == (2, 1) and torch.equal(head.dense_mask(), mask[:, 1:2])
    # a slice runs a call of its own shape
    got = solattn.sol_attn(q[1:2, :, :1], k[1:2, :, :1], v[1:2, :, :1], topk_ratio=0.25, plan=one)
    assert rel_l2(got.double(), held_selection(q[1:2, :, :1], k[1:2, :, :1], v[1:2, :, :1], mask[1:2, :1])) < 1e-5


def test_a_selection_of_another_shape_heads_device_or_block_size_is_refused():
    import dataclasses
    q, k, v = _inputs(22)
    p = solattn.plan(q, k, v, topk_ratio=0.25)
    cases = [
        ((q[:, :200], k[:, :200], v[:, :200]), r"B=2 H=2 T=300, .*allowed: .*T=200,"),
        ((q[:1], k[:1], v[:1]), r"B=2 .*allowed: .*B=1 "),
        ((q[:, :, :1], k[:, :, :1], v[:, :, :1]), r"B=2 H=2 .*allowed: .*H=1 "),
    ]
    for args, pattern in cases:
        with pytest.raises(ValueError, match=r"sol_attn: argument 'plan' received a selection of " + pattern):
            solattn.sol_attn(*args, topk_ratio=0.25, plan=p)
    with pytest.raises(ValueError, match=r"argument 'plan' received .*32-token blocks.*allowed: .*64-token"):
        solattn.sol_attn(q, k, v, topk_ratio=0.25, plan=dataclasses.replace(p, block_size=32))
    meta = routing.Plan(**{f: getattr(p, f).to("meta") for f in routing.Plan.TENSOR_FIELDS}, seq_len=300)
    with pytest.raises(ValueError, match=r"argument 'plan' received .*on meta.*allowed: .*on cpu"):
        solattn.sol_attn(q, k, v, topk_ratio=0.25, plan=meta)
    with pytest.raises(TypeError, match=r"argument 'plan' received Tensor; allowed: None or a solattn Plan"):
        solattn.sol_attn(q, k, v, topk_ratio=0.25, plan=p.kv_indices)
    grid = (4, 8, 8)
    qv, kv, vv = make_qkv(1, 256, 2, 64, seed=23)
    pv = solattn.video_plan(qv, kv, vv, grid, sparsity=0.5)
    with pytest.raises(ValueError, match=r"video_sparse_attn: argument 'plan' received a selection of .*B=1 H=2"
                                         r".*allowed: .*H=1"):
        solattn.video_sparse_attn(qv[:, :, :1], kv[:, :, :1], vv[:, :, :1], grid, sparsity=0.5, plan=pv)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kw", [dict(topk_ratio=0.25), dict(tau=0.5, tail=False)], ids=str)
def test_cuda_triton_reuses_a_plan_forward_and_backward(kw):
    """On CUDA the triton backend's own plan is the fused one (n-wide lists); held for other
    tensors, forward and gradients are the definition's with that selection."""
    q1, k1, v1 = make_qkv(1, 1000, 4, 64, dtype=torch.float16, device="cuda", seed=25)
    q2, k2, v2 = make_qkv(1, 1000, 4, 64, dtype=torch.float16, device="cuda", seed=26)
    gate = torch.rand(q2.shape, device="cuda").half()
    p = solattn.plan(q1, k1, v1, **kw, backend="triton")
    assert p.kv_indices.shape[-1] == p.n
    leaves = [t.clone().requires_grad_(True) for t in (q2, k2, v2, gate)]
    w = torch.randn(q2.shape, device="cuda")
    out = solattn.sol_attn(*leaves[:3], **kw, coarse_gate=leaves[3], backend="triton", plan=p)
    (out.float() * w).sum().backward()
    ref = [t.detach().cpu().double().requires_grad_(True) for t in (q2, k2, v2, gate)]
    want = held_selection(*ref[:3], p.dense_mask().cpu(), tail=kw.get("tail", True), gate=ref[3])
    (want * w.cpu().double()).sum().backward()
    assert rel_l2(out.detach().cpu().double(), want.detach()) < 1e-2
    for name, a, b in zip("qkvg", leaves, ref):
        assert rel_l2(a.grad.cpu().double(), b.grad) < 2e-2, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replays_of_a_reused_plan_compute_each_calls_own_terms():
    """Inside ``cuda_graphs()`` a call on a given plan is captured once and replayed; each replay
    computes the tail and coarse terms from the inputs' current contents (none are read from the
    plan)."""
    from solattn.graphs import cuda_graphs
    q, k, v = make_qkv(1, 1024, 4, 64, dtype=torch.bfloat16, device="cuda", seed=27)
    gate = torch.rand(q.shape, device="cuda").to(torch.bfloat16)
    kw = dict(topk_ratio=0.25, coarse_gate=gate, backend="triton")
    p = solattn.plan(q, k, v, **kw)
    outs = []
    with torch.no_grad(), cuda_graphs() as cache:
        for _ in range(4):
            v.copy_(torch.randn_like(v) * 2 + 1)
            gate.uniform_()
            outs.append((solattn.sol_attn(q, k, v, **kw, plan=p), v.clone(), gate.clone()))
    assert cache.stats.replays >= 2 and cache.stats.failures == 0, cache.stats
    mask = p.dense_mask().cpu()
    for got, v_then, gate_then in outs:
        want = held_selection(q.cpu(), k.cpu(), v_then.cpu(), mask, gate=gate_then.cpu())
        assert rel_l2(got.cpu().double(), want) < 1e-2


@pytest.mark.parametrize("how", ["aot_function", "compile"])
def test_a_traced_backward_with_a_given_plan_gives_the_eager_gradients(how):
    """A caller's plan under tracing: AOTAutograd traces the backward as the backward op, whose
    operands are the call's and the forward's outputs; its gradients are the eager ones."""
    from functorch.compile import aot_function, nop

    q, k, v = make_qkv(1, 200, 2, 16, seed=4)
    kw = dict(topk_ratio=0.5, tail=True, backend="sdpa")
    p = solattn.plan(q, k, v, **kw)

    def loss(q, k, v, *selection):       # AOTAutograd takes the plan's tensors as inputs
        given = routing.Plan.from_tensors(selection, q.shape[1]) if selection else p
        return solattn.sol_attn(q, k, v, **kw, plan=given).square().sum()

    traced = aot_function(loss, nop, nop) if how == "aot_function" else \
        torch.compile(loss, backend="aot_eager", fullgraph=True)
    grads = {}
    for name, fn in (("eager", loss), ("traced", traced)):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        fn(*leaves, *(p.tensors() if how == "aot_function" and name == "traced" else ())).backward()
        grads[name] = [x.grad for x in leaves]
    for got, want in zip(grads["traced"], grads["eager"]):
        assert got is not None and rel_l2(got, want) < 1e-6


def test_a_gate_with_stride_0_that_requires_grad_gets_per_token_gradients():
    """A tensor gate of q's shape made by ``expand`` (stride 0 on the tokens) that requires grad:
    its gradient per element is that of the same values as a dense tensor (a constant gate's view
    in the tiled rows would put every token's share on token 0)."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 64 + 128, 1, 16, generator=g) for _ in range(3))
    grads = []
    for gate in (torch.tensor(0.5).expand(q.shape), torch.full(q.shape, 0.5)):
        gate = gate.detach().requires_grad_(True) if gate.stride(1) else gate.requires_grad_(True)
        out = solattn.video_sparse_attn(q, k, v, (1, 8, 16), topk=1, gate=gate, prefix_len=64, backend="sdpa")
        grads.append(torch.autograd.grad(out.square().sum(), gate)[0])
    assert grads[1].abs().amin() > 0
    torch.testing.assert_close(grads[0], grads[1])
