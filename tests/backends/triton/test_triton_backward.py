"""The ``triton`` backend's fused backward against autograd through the reference backend.

On the CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` per test; bf16
inputs reach the interpreter as fp32 copies, see ``backend.launch``); on a CUDA machine the
same tests also run the compiled kernels. The oracle is the reference backend's autograd on
fp32 copies of the inputs. A bf16/fp16 backward rounds more than a forward (its products take
rounded probabilities and gradients), so the level is the forward's tolerance or twice dense
SDPA's own low-precision gradient error on the same inputs, whichever is larger (the level
``test_backends.py`` holds every backend's gradients to).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
#: the interpreter runs these kernels from Triton 3.9 on; compiled CUDA runs need no such floor
INTERPRETER_OK = tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 9)

import solattn  # noqa: E402
import solattn.backends.triton.backward as bw  # noqa: E402
from solattn.routing import build_plan  # noqa: E402
from solattn.testing import dense_gradient_error, live_rows, make_qkv, rel_l2, tolerance  # noqa: E402
from solattn.validation import validate  # noqa: E402

from tests.support.marks import gpu_marked, on_gpu  # noqa: E402

DEVICES = (["cpu"] if INTERPRETER_OK else []) + (["cuda"] if torch.cuda.is_available() else [])
if not DEVICES:
    pytest.skip(f"no CUDA device, and the interpreter needs triton >= 3.9 (found {triton.__version__})",
                allow_module_level=True)


@pytest.fixture(autouse=True)
def _interpret(monkeypatch, request):
    """CPU cases run the kernels in Triton's interpreter; CUDA cases compile them."""
    callspec = getattr(request.node, "callspec", None)
    if (callspec.params.get("device", "cpu") if callspec else "cpu") == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    yield


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts calls of the fused backward, so a test knows the fused path ran (not the recompute)."""
    calls = []
    real = bw.fused_backward

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(bw, "fused_backward", spy)
    return calls


@pytest.fixture
def plan_refs(monkeypatch):
    """Weak references to every plan ``sol_attn`` builds (forward and backward go through
    ``solattn.op.route.build_plan``), in order: a test sees how many were built and which are alive."""
    import weakref
    import solattn.op.route as route
    refs = []
    real = route.build_plan

    def recording(*args, **kwargs):
        plan = real(*args, **kwargs)
        refs.append(weakref.ref(plan))
        return plan

    monkeypatch.setattr(route, "build_plan", recording)
    return refs


def _rand(shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)




def _grads(fn, tensors, w, fp32: bool):
    """Gradients of ``sum(fn(*leaves) * w)`` for every tensor in ``tensors`` (fp32 copies if asked)."""
    leaves = [t.detach().clone().float() if fp32 and t.is_floating_point() else t.detach().clone()
              for t in tensors]
    for t in leaves:
        t.requires_grad_(True)
    (fn(*leaves).float() * w).sum().backward()
    return [t.grad for t in leaves]


def _check(fn_fused, fn_ref, tensors, names, w, dtype, fused_calls):
    got = _grads(fn_fused, tensors, w, fp32=False)
    assert fused_calls, "the fused backward did not run"
    want = _grads(fn_ref, tensors, w, fp32=True)
    level = max(tolerance(dtype), 2 * dense_gradient_error(*tensors[:3], w))
    for name, a, b in zip(names, got, want):
        assert a is not None, f"no gradient for {name}"
        assert a.dtype == tensors[names.index(name)].dtype and a.shape == b.shape
        assert torch.isfinite(a).all(), f"non-finite gradient for {name}"
        err = rel_l2(a, b)
        assert err < level, f"{name}: relative L2 {err:.3e} >= {level:.3e}"
        assert b.abs().sum() > 0                          # a zero oracle would make the check empty


CASES = {
    # name: (T, H, D, dtype, sol_attn kwargs (gate / bias / block_len filled in below))
    "topk-tail-fp16": (200, 2, 32, torch.float16, dict(topk_ratio=0.3)),
    "topk-notail-gate-bias-bf16": (257, 2, 64, torch.bfloat16, dict(topk_ratio=0.25, tail=False, gate=True,
                                                                     bias=True)),
    "tau-tail-deadrows-sinks-bf16": (230, 2, 32, torch.bfloat16, dict(tau=0.5, sink_blocks=[0, 1], sink_q=[3, 4],
                                                                       block_len=[64, 40, 64, 30], gate=True)),
    "topk-tail-bias-deadrows-fp16": (300, 2, 32, torch.float16, dict(topk_ratio=0.4, bias=True,
                                                                      block_len=[64, 64, 17, 64, 44])),
}


@pytest.mark.parametrize("case,device", [
    pytest.param(c, d, id=f"{c}-{d}", marks=pytest.mark.gpu if on_gpu(d)
                 else () if c == "topk-notail-gate-bias-bf16" else pytest.mark.slow)
    for d in DEVICES for c in CASES])
def test_sol_attn_fused_gradients_match_reference(case, device, fused_calls):
    T, H, D, dtype, kw = CASES[case]
    kw = dict(kw)
    q, k, v = make_qkv(1, T, H, D, dtype=dtype, device=device, seed=len(case))
    tensors, names = [q, k, v], ["q", "k", "v"]
    w = _rand((1, T, H, D), 1).to(device)
    if "block_len" in kw:
        bl = torch.tensor(kw["block_len"], dtype=torch.int32, device=device)
        kw["block_len"] = bl
        w = w * live_rows(T, bl).to(device)[None, :, None, None]   # dead rows' outputs are unspecified
    if kw.pop("gate", False):
        tensors.append(_rand((1, T, H, D), 2, dtype).to(device))
        names.append("coarse_gate")
    if kw.pop("bias", False):
        bias = _rand((1, T), 3, torch.float32).to(device)
        bias[0, 5] = float("-inf")                              # a masked key: its gradient is 0
        tensors.append(bias)
        names.append("key_bias")

    def call(backend):
        def fn(q, k, v, *rest):
            extra = dict(zip(names[3:], rest))
            return solattn.sol_attn(q, k, v, backend=backend, **kw, **extra)
        return fn

    _check(call("triton"), call("reference"), tensors, names, w, dtype, fused_calls)


@pytest.mark.parametrize("device", gpu_marked(DEVICES, cpu_slow=True))
@pytest.mark.parametrize("tma", [True, False])
def test_backward_block_loads_match_reference(tma, device, fused_calls, monkeypatch):
    """The inner loops' block loads through TMA descriptors or pointers (``BackwardConfig.tma``;
    the default takes TMA from ``tma_min_programs`` programs on, 0 here): T not a multiple of 64
    (rows past T), VSA's tiled layout with a prefix and partial cubes (dead rows hold zeros)."""
    if device == "cuda" and tma and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA loads need sm_90+")
    from solattn.backends.triton.tuning import BackwardConfig, TritonTuning
    from solattn.config import tuning
    made = []
    real = bw.tma_descriptors
    monkeypatch.setattr(bw, "tma_descriptors", lambda *t: made.append(len(t)) or real(*t))
    cfg = TritonTuning(tma_min_programs=0, backward=BackwardConfig(tma=tma))
    T, H, D = 300, 2, 64
    q, k, v = make_qkv(1, T, H, D, dtype=torch.bfloat16, device=device, seed=5)
    w = _rand((1, T, H, D), 1).to(device)

    def call(backend):
        def fn(q, k, v):
            with tuning(cfg):
                return solattn.sol_attn(q, k, v, topk_ratio=0.4, backend=backend)
        return fn

    _check(call("triton"), call("reference"), [q, k, v], ["q", "k", "v"], w, torch.bfloat16, fused_calls)
    assert made == ([4] if tma else [])
    grid, P = (4, 6, 5), 10
    Tv = P + 4 * 6 * 5
    qv, kv, vv = make_qkv(1, Tv, H, D, dtype=torch.bfloat16, device=device, seed=6)
    gv = _rand((1, Tv, H, D), 3, torch.bfloat16).to(device)
    wv = _rand((1, Tv, H, D), 4).to(device)

    def vsa(backend):
        def fn(q, k, v, gate):
            with tuning(cfg):
                return solattn.video_sparse_attn(q, k, v, grid, topk=3, gate=gate, prefix_len=P, backend=backend)
        return fn

    _check(vsa("triton"), vsa("sdpa"), [qv, kv, vv, gv], ["q", "k", "v", "gate"], wv, torch.bfloat16, fused_calls)
    assert made == ([4, 4] if tma else [])


@pytest.mark.parametrize("device", gpu_marked(DEVICES, cpu_slow=True))
def test_dq_with_a_common_key_offset_matches_reference(device, fused_calls):
    """Keys far from the origin (a common offset of 4 in every dim), a tail: the tail key's share
    of dq (through the key mean, about the offset) and the centring of the exact keys' terms are
    both large here, and both must come out of the dq kernel's single correction term."""
    T, H, D = 260, 2, 64
    q, k, v = make_qkv(1, T, H, D, dtype=torch.bfloat16, device=device, seed=11)
    k = (k.float() + 4.0).to(torch.bfloat16)
    w = _rand((1, T, H, D), 1).to(device)

    def call(backend):
        def fn(q, k, v):
            return solattn.sol_attn(q, k, v, topk_ratio=0.3, backend=backend)
        return fn

    _check(call("triton"), call("reference"), [q, k, v], ["q", "k", "v"], w, torch.bfloat16, fused_calls)


@pytest.mark.parametrize("device", gpu_marked(DEVICES, cpu_slow=True))
def test_video_sparse_attn_fused_gradients_match_reference(device, fused_calls):
    """VSA: prefix segments, partial cubes (dead rows in the tiled layout), a tensor gate; the
    oracle is the same call through sdpa in fp32, whose gradients test_video checks against
    the definition."""
    grid, P = (4, 6, 6), 10
    T, H, D = P + 4 * 6 * 6, 2, 32
    q, k, v = make_qkv(1, T, H, D, dtype=torch.float16, device=device, seed=7)
    gate = _rand((1, T, H, D), 2, torch.float16).to(device)
    w = _rand((1, T, H, D), 1).to(device)

    def call(backend):
        def fn(q, k, v, gate):
            return solattn.video_sparse_attn(q, k, v, grid, topk=2, gate=gate, prefix_len=P, backend=backend)
        return fn

    _check(call("triton"), call("sdpa"), [q, k, v, gate], ["q", "k", "v", "gate"], w, torch.float16, fused_calls)


@pytest.mark.parametrize("device", gpu_marked(DEVICES, cpu_slow=True))
def test_bool_key_bias_has_no_gradient_and_masked_keys_get_none(device, fused_calls):
    T = 150
    q, k, v = make_qkv(1, T, 1, 32, dtype=torch.float16, device=device, seed=4)
    keep = torch.ones(T, dtype=torch.bool, device=device)
    keep[70:80] = False
    w = _rand((1, T, 1, 32), 1).to(device)

    def call(backend):
        # no tail: masked keys still enter the pooled block means, and so the tail's gradient
        return lambda q, k, v: solattn.sol_attn(q, k, v, topk_ratio=0.5, key_bias=keep, tail=False,
                                                backend=backend)

    got = _grads(call("triton"), [q, k, v], w, fp32=False)
    assert fused_calls
    want = _grads(call("reference"), [q, k, v], w, fp32=True)
    for a, b in zip(got, want):
        assert rel_l2(a, b) < max(tolerance(torch.float16), 2 * dense_gradient_error(q, k, v, w))
    assert got[1][0, 70:80].abs().max() == 0 and got[2][0, 70:80].abs().max() == 0


def test_query_lists_transpose_the_selection():
    q, k, v = make_qkv(2, 400, 2, 16, seed=9)
    plan = build_plan(validate(q, k, v, topk_ratio=0.3))
    q_num, q_idx = plan.query_lists()
    mask = plan.dense_mask()                                   # (B, H, n_q, n_k)
    n = plan.n
    assert q_num.shape == (2, 2, n) and q_num.dtype == torch.int32
    assert torch.equal(q_num, mask.sum(dim=2, dtype=torch.int32))
    used = torch.arange(q_idx.shape[-1]) < q_num[..., None]
    rebuilt = torch.zeros(2, 2, n, n + 1, dtype=torch.bool)
    rebuilt.scatter_(-1, torch.where(used, q_idx.long(), n), True)
    assert torch.equal(rebuilt[..., :n], mask.transpose(-1, -2))
    assert (q_idx[..., 1:][used[..., 1:]] > q_idx[..., :-1][used[..., 1:]]).all()   # ascending


@pytest.mark.parametrize("device", gpu_marked(DEVICES, cpu_slow=True))
def test_forward_lse_is_the_rows_log_sum_exp(device):
    """The forward's LSE (base 2, uncentred logits, tail key included) equals the log-sum-exp of
    the definition's logits plus the row's centring shift scale q.m."""
    from solattn.backends.triton.backend import launch
    T, H, D = 140, 1, 32
    q, k, v = make_qkv(1, T, H, D, dtype=torch.float16, device=device, seed=11)
    problem = validate(q, k, v, topk_ratio=0.5)
    plan = build_plan(problem)
    lse = torch.full(bw.lse_shape(1, T, H), float("nan"), device=device)
    resid = torch.full_like(q, float("nan"))
    out = launch(problem, plan, lse=lse, resid=resid)
    qf, kf = q.float().cpu()[0, :, 0], k.float().cpu()[0, :, 0]
    m = plan.key_mean.cpu()[0, 0, 0]
    e = problem.scale * qf @ (kf - m).T                                    # (T, T) centred logits
    blk = torch.arange(T) // 64
    exact = plan.dense_mask().cpu()[0, 0][blk][:, blk]
    e = e.masked_fill(~exact, float("-inf"))
    tail = plan.tail_lse.cpu()[0, 0][blk]                                  # (T,) pooled term
    want = torch.logaddexp(torch.logsumexp(e, dim=1), tail) + problem.scale * qf @ m
    got = lse.cpu()[0, 0, :T] / torch.log2(torch.tensor(torch.e))
    assert rel_l2(got, want) < 1e-3
    # the rounding residual: within half a unit of the stored output's last place (the output is
    # the residual-corrected value rounded), not all zero, and the sum is nearer the fp32 definition
    assert torch.isfinite(resid).all()
    inf = torch.tensor(float("inf"), dtype=out.dtype, device=out.device)
    ulp = torch.nextafter(out.abs(), inf).float() - out.abs().float()
    assert (resid.float().abs() <= 0.5 * ulp).all()
    assert resid.abs().max() > 0
    fine = out.float() + resid.float()
    ref = solattn.sol_attn(q.float(), k.float(), v.float(), topk_ratio=0.5, backend="reference")
    assert rel_l2(fine, ref) < rel_l2(out.float(), ref)


@pytest.mark.parametrize("device", gpu_marked(DEVICES, cpu_slow=True))
def test_backward_takes_the_forwards_plan(device, monkeypatch, fused_calls, plan_refs):
    """Without tail or gate the backward reuses the plan the forward built (handed to the autograd
    node) instead of rebuilding it, also in a second backward of a retained graph, and its
    gradients equal those of a rebuilt plan; the plan is freed with the graph."""
    import gc
    from solattn.op import saved
    q, k, v = make_qkv(1, 192, 2, 32, dtype=torch.float16, device=device, seed=5)
    w = _rand(q.shape, 6).to(device)
    built = plan_refs

    def forward():
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out = solattn.sol_attn(*leaves, topk_ratio=0.5, tail=False, backend="triton")
        assert len(built) == 1
        return leaves, out

    leaves, out = forward()
    loss = (out.float() * w).sum()
    loss.backward(retain_graph=True)
    kept = [t.grad.clone() for t in leaves]
    assert fused_calls and len(built) == 1                   # the backward built no plan
    for t in leaves:
        t.grad = None
    loss.backward()                                          # the retained graph still holds it
    assert len(built) == 1 and all(torch.equal(t.grad, g) for t, g in zip(leaves, kept))
    assert built[0]() is not None
    del loss, out
    gc.collect()
    assert built[0]() is None                                # freed with the graph

    built.clear()
    monkeypatch.setattr(saved.PLANS, "take", lambda fused: None)   # nothing handed over: rebuild
    leaves, out = forward()
    (out.float() * w).sum().backward()
    assert len(built) == 2
    for a, b in zip(kept, (t.grad for t in leaves)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", gpu_marked(DEVICES, cpu_slow=True))
def test_training_forward_selects_what_the_backward_rebuilds(device, monkeypatch, fused_calls):
    """With a tail (or gate) the backward rebuilds the plan through the torch path, so a forward
    that may be differentiated builds it that way too (the fused plan's products round otherwise:
    a near-tie could select other blocks in the two passes). Without those terms, and without
    gradients, the forward may take the fused plan."""
    from solattn.routing import fused
    kinds = []
    real = fused.fused_plan
    monkeypatch.setattr(fused, "fused_plan", lambda problem, **kw: kinds.append("fused") or real(problem, **kw))
    q, k, v = make_qkv(1, 192, 2, 32, dtype=torch.float16, device=device, seed=7)
    for tail, grad, want in ((True, True, []), (False, True, ["fused"]), (True, False, ["fused"])):
        kinds.clear()
        leaves = [t.detach().clone().requires_grad_(grad) for t in (q, k, v)]
        out = solattn.sol_attn(*leaves, topk_ratio=0.5, tail=tail, backend="triton")
        if grad:
            out.float().sum().backward()
            assert fused_calls, "the fused backward ran"
        assert kinds == want, (tail, grad)


def test_forward_without_backward_keeps_no_plan(monkeypatch, plan_refs):
    """A grad-enabled forward whose graph is dropped without a backward (activation checkpointing,
    an evaluation pass) leaves no plan behind."""
    import gc
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if not INTERPRETER_OK:
        pytest.skip("the interpreter needs triton >= 3.9")
    q, k, v = make_qkv(1, 192, 2, 32, dtype=torch.float16, seed=8)
    refs = plan_refs
    for _ in range(3):
        out = solattn.sol_attn(q.clone().requires_grad_(True), k, v, topk_ratio=0.5, tail=False, backend="triton")
        del out
    gc.collect()
    assert len(refs) == 3 and all(r() is None for r in refs)


def test_plain_eager_calls_skip_the_custom_op(monkeypatch):
    """A call that needs no autograd, tracing or dispatch mode runs the op's computation directly
    (no custom-op dispatch), with the same result; under a dispatch mode it goes through the op."""
    import solattn.op.custom as custom
    from torch.utils.flop_counter import FlopCounterMode
    q, k, v = make_qkv(1, 150, 2, 32, seed=7)
    through_op = []
    real = custom.sol_attn_op

    def spy(*args):
        through_op.append(1)
        return real(*args)

    monkeypatch.setattr(custom, "sol_attn_op", spy)
    with torch.no_grad():
        direct = solattn.sol_attn(q, k, v, topk_ratio=0.4, backend="sdpa")
    assert through_op == []
    with torch.no_grad(), FlopCounterMode(display=False):
        via_op = solattn.sol_attn(q, k, v, topk_ratio=0.4, backend="sdpa")
    assert through_op == [1]
    assert torch.equal(direct, via_op)


def test_traced_and_transformed_calls_go_through_the_op():
    """torch.jit.trace records the op (one node, right on new inputs) and vmap batches it, as they
    did before plain calls skipped the op."""
    q, k, v = make_qkv(2, 150, 2, 32, seed=9)

    def f(q, k, v):
        return solattn.sol_attn(q, k, v, topk_ratio=0.4, backend="sdpa")

    with torch.no_grad():
        traced = torch.jit.trace(f, (q, k, v), check_trace=False)
        assert "solattn::sol_attn" in str(traced.graph)
        q2, k2, v2 = make_qkv(2, 150, 2, 32, seed=10)
        assert torch.equal(traced(q2, k2, v2), f(q2, k2, v2))
        batched = torch.func.vmap(f)(q[:, None], k[:, None], v[:, None])
        assert rel_l2(batched[:, 0], f(q, k, v)) < 1e-6


@pytest.mark.parametrize("device", gpu_marked(DEVICES, cpu_slow=True))
def test_fused_backward_under_compile_fullgraph(device, fused_calls):
    """A compiled training step with ``fullgraph=True``: the traced backward is one op
    (``solattn::sol_attn_backward``, for both functions) that runs the fused backward at
    run time, with the eager gradients of q, k, v and the coarse gate."""
    torch._dynamo.reset()
    q, k, v = make_qkv(1, 4 * 8 * 8 + 10, 2, 32, dtype=torch.bfloat16, device=device, seed=6)
    gate = (torch.randn_like(q.float()) * 0.1).to(q.dtype)

    def sol(q, k, v, gate):
        return (solattn.sol_attn(q, k, v, topk_ratio=0.3, coarse_gate=gate, backend="triton") ** 2).sum()

    def vsa(q, k, v, gate):
        return (solattn.video_sparse_attn(q, k, v, (4, 8, 8), topk=2, gate=gate, prefix_len=10,
                                          backend="triton") ** 2).sum()

    for loss in (sol, vsa):
        grads = {}
        for name, fn in (("eager", loss), ("compiled", torch.compile(loss, backend="aot_eager", fullgraph=True))):
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v, gate)]
            before = len(fused_calls)
            fn(*leaves).backward()
            assert len(fused_calls) == before + 1, f"{loss.__name__} {name}: the fused backward did not run"
            grads[name] = [t.grad for t in leaves]
        for got, want in zip(grads["compiled"], grads["eager"]):
            assert got is not None and torch.isfinite(got).all()
            assert rel_l2(got, want) < 1e-6, loss.__name__
