"""The routing plan: its form, the XPU-safe top-k path, and agreement with the definition."""

from __future__ import annotations

import math

import pytest
import torch

import solattn
from solattn.validation import validate
from solattn import routing
from solattn.testing import make_qkv


def _plan(kw, seed=0, T=700, method=None):
    q, k, v = make_qkv(2, T, 3, 16, seed=seed)
    p = validate(q, k, v, **kw)
    return p, routing.build_plan(p, topk_method=method)


@pytest.mark.parametrize("kw", [dict(topk_ratio=0.3), dict(tau=0.4), dict(topk_ratio=0.2, sink_blocks=(0, 2)),
                                dict(tau=0.0, sink_q=(3, 5), tail=False)])
def test_plan_form_matches_its_dense_mask(kw):
    p, plan = _plan(kw)
    B, H, n = p.B, p.H, p.n
    assert plan.kv_num_blocks.shape == (B, H, n) and plan.kv_num_blocks.dtype == torch.int32
    assert plan.kv_indices.dtype == torch.int32 and plan.kv_indices.shape[:3] == (B, H, n)
    assert plan.kv_indices.shape[3] == int(plan.kv_num_blocks.max())
    assert torch.equal(plan.kv_num_blocks, plan.dense_mask().sum(-1).int())
    for b in range(B):
        for h in range(H):
            for i in range(n):
                c = int(plan.kv_num_blocks[b, h, i])
                idx = plan.kv_indices[b, h, i, :c].tolist()
                assert idx == sorted(idx) and len(set(idx)) == c           # ascending, unique
                assert idx == torch.nonzero(plan.dense_mask()[b, h, i]).squeeze(1).tolist()
                assert plan.kv_indices[b, h, i, c:].eq(0).all()              # zero padding
                assert all(abs(i - j) > 1 or j in idx for j in range(n))      # neighbours forced
    assert (plan.tail_lse is None) == (not p.tail)


def test_sort_path_gives_the_same_plan_as_topk():
    for kw in (dict(topk_ratio=0.3), dict(topk_ratio=0.1, sink_blocks=(2, 4))):
        _, a = _plan(kw, method="topk")
        _, b = _plan(kw, method="sort")
        assert torch.equal(a.kv_indices, b.kv_indices) and torch.equal(a.kv_num_blocks, b.kv_num_blocks)


def test_topk_method_defaults_and_env_override(monkeypatch):
    monkeypatch.delenv("SOLATTN_TOPK", raising=False)
    assert routing.default_topk_method(torch.device("xpu"), 100) == "sort"     # XPU: never torch.topk
    assert routing.default_topk_method(torch.device("cpu"), 100) == "topk"
    assert routing.default_topk_method(torch.device("cuda"), 5000) == "sort"   # rows > 4096 elements
    monkeypatch.setenv("SOLATTN_TOPK", "sort")
    assert routing.default_topk_method(torch.device("cpu"), 100) == "sort"
    monkeypatch.setenv("SOLATTN_TOPK", "heap")
    with pytest.raises(ValueError, match="SOLATTN_TOPK"):
        routing.default_topk_method(torch.device("cpu"), 100)


def test_forced_sort_path_end_to_end_matches_reference(monkeypatch):
    monkeypatch.setenv("SOLATTN_TOPK", "sort")
    q, k, v = make_qkv(1, 500, 2, 32, dtype=torch.bfloat16, seed=4)
    got = solattn.sol_attn(q, k, v, topk_ratio=0.25, backend="sdpa")
    want = solattn.sol_attn(q, k, v, topk_ratio=0.25, backend="reference")
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2


def test_kth_largest_methods_agree_and_reject_unknown():
    x = torch.randn(4, 300)
    for kk in (1, 7, 300):
        assert torch.equal(routing.kth_largest(x, kk, "topk"), routing.kth_largest(x, kk, "sort"))
    with pytest.raises(ValueError, match="'method'"):
        routing.kth_largest(x, 1, "heap")


@pytest.mark.parametrize("r,n_eff,kk", [(0.5, 1, 0), (0.5, 0, 0), (0.25, 10, 2), (0.35, 10, 4), (0.45, 10, 4),
                                        (0.01, 10, 1), (0.99, 10, 9), (0.3125, 8, 2), (0.375, 8, 3)])
def test_topk_count_rounds_half_to_even_and_clamps(r, n_eff, kk):
    assert routing.topk_count(r, n_eff) == kk


def test_block_means_over_live_rows_only():
    x = torch.randn(2, 150, 3, 4)
    L = torch.tensor([10, 64, 22], dtype=torch.int32)
    got = routing.block_means(x, L)
    for j, (start, length) in enumerate([(0, 10), (64, 64), (128, 22)]):
        want = x[:, start:start + length].mean(1)                              # (B, H, D)
        assert torch.allclose(got[:, :, j], want, atol=1e-6)
    full = routing.block_means(x, torch.tensor([64, 64, 22], dtype=torch.int32), all_live=True)
    masked = routing.block_means(x, torch.tensor([64, 64, 22], dtype=torch.int32), all_live=False)
    assert torch.allclose(full, masked, atol=1e-6)


def test_tail_terms_equal_their_definition():
    p, plan = _plan(dict(topk_ratio=0.3), T=300)
    st = routing.block_stats(p)
    kmc = st.km - st.m
    logw = p.scale * st.qm @ kmc.transpose(-1, -2) + torch.log(st.L.float())
    for b in range(p.B):
        for h in range(p.H):
            for i in range(p.n):
                out = ~plan.dense_mask()[b, h, i]
                if not out.any():
                    assert math.isinf(plan.tail_lse[b, h, i].item())
                    continue
                w = logw[b, h, i, out]
                assert torch.allclose(plan.tail_lse[b, h, i], torch.logsumexp(w, 0), atol=1e-5)
                want = (torch.softmax(w, 0)[:, None] * st.vm[b, h, out]).sum(0)
                assert torch.allclose(plan.tail_value[b, h, i], want, atol=1e-5)


def test_plans_share_no_cached_tensor():
    q, k, v = make_qkv(1, 200, 2, 16)
    p = validate(q, k, v, topk_ratio=0.3)
    first = routing.build_plan(p)
    first.block_len[0] = 1                      # a caller scribbling on its plan
    second = routing.build_plan(p)
    assert second.block_len.tolist() == [64, 64, 64, 8]


PLAN_MEMORY_SCRIPT = """
import json, resource, sys, torch, solattn
from solattn import routing
from solattn.validation import validate
def rss():  # peak resident set size of this process, bytes (Linux reports KiB)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
budget = int(sys.argv[1])
B, T, H, D = 1, 131072, 4, 64
g = torch.Generator().manual_seed(0)
q, k, v, gate = (torch.randn(B, T, H, D, generator=g).to(torch.bfloat16) for _ in range(4))
small = validate(q[:, :4096], k[:, :4096], v[:, :4096], topk_ratio=0.01, coarse_gate=gate[:, :4096])
routing.build_plan(small)                                   # warm the libraries
before = rss()
with solattn.memory_budget(budget):
    plan = routing.build_plan(validate(q, k, v, topk_ratio=0.01, coarse_gate=gate))
print(json.dumps({"working": rss() - before, "M": plan.kv_indices.shape[-1],
                  "finite": bool(torch.isfinite(plan.coarse).all() and torch.isfinite(plan.tail_value).all())}))
"""


@pytest.mark.slow
def test_plan_working_memory_stays_within_the_budget():
    # n = 2048 blocks, 4 heads: a (B, H, n, n) fp32 score tensor alone is 64 MiB, and the int64
    # and bool temporaries of an unchunked plan several times that
    import json
    import subprocess
    import sys
    budget = 16 << 20
    res = subprocess.run([sys.executable, "-c", PLAN_MEMORY_SCRIPT, str(budget)], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout.strip().splitlines()[-1])
    assert info["finite"] and info["M"] < 40, info
    # the budget, plus the plan's own outputs and block means (~14 MiB) and allocator slack
    assert info["working"] < budget + (32 << 20), info


def test_serial_cpu_runs_one_thread_and_restores_the_count():
    from solattn.routing.stats import serial_cpu
    import threading
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with serial_cpu():
            assert torch.get_num_threads() == 1
            with serial_cpu():                                   # re-entry: no-op
                assert torch.get_num_threads() == 1
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError):
            with serial_cpu():
                raise RuntimeError("inside")
        assert torch.get_num_threads() == 2
        with serial_cpu(enabled=False):
            assert torch.get_num_threads() == 2
        seen = []

        def worker():                                            # plans in several Python threads
            for _ in range(20):
                with serial_cpu():
                    seen.append(torch.get_num_threads())
        threads = [threading.Thread(target=worker) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert seen == [1] * 60 and torch.get_num_threads() == 2
        q, k, v = make_qkv(1, 300, 2, 16)
        routing.build_plan(validate(q, k, v, topk_ratio=0.2))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [2, 4])
def test_cpu_block_means_use_every_thread_from_four_and_agree(threads):
    """The CPU block means run their chunk conversions and sums on all the caller's threads from
    four threads on, on one below (a busy 2-core CPU loses in parallel regions); the means are the
    same either way, and equal the fp32 definition."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from solattn.routing.stats import block_stats

    class Threads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            big = args and isinstance(args[0], torch.Tensor) and args[0].numel() >= q.numel()
            name = func.__name__.split(".")[0]
            self.seen.setdefault(name if big else "small", set()).add(torch.get_num_threads())
            return func(*args, **(kwargs or {}))

    q, k, v = (x.to(torch.bfloat16) for x in make_qkv(1, 640, 4, 32, seed=4))
    p = validate(q, k, v, tail=False)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with Threads() as mode:
            stats = block_stats(p)
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
    wide = {threads} if threads >= 4 else {1}
    assert mode.seen["copy_"] == wide and mode.seen["sum"] == wide, mode.seen   # q-sized chunk ops
    want = q.float().unflatten(1, (10, 64)).mean(dim=2).permute(0, 2, 1, 3)
    assert torch.equal(stats.qm, want) or torch.allclose(stats.qm, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kw", [dict(topk_ratio=0.2, sink_blocks=(0, 1)), dict(tau=0.5, sink_q=(2, 3))])
def test_chunked_plan_equals_the_one_chunk_plan(kw):
    q, k, v = make_qkv(2, 600, 3, 16, seed=3)
    gate = torch.rand_like(q)
    L = torch.tensor([64, 40, 64, 64, 7, 64, 64, 64, 64, 24], dtype=torch.int32)
    p = validate(q, k, v, block_len=L, coarse_gate=gate, **kw)
    st = routing.block_stats(p)
    one = routing.assemble_plan(p, st, routing.sol_attn_selector(p, st), tail=True, coarse=True)
    n = p.n
    # whole groups per chunk, then bands of rows of one group
    for nbytes in (2 * n * n * routing.BYTES_PER_SCORE, 3 * n * routing.BYTES_PER_SCORE):
        many = routing.assemble_plan(p, st, routing.sol_attn_selector(p, st), tail=True, coarse=True,
                                     nbytes=nbytes)
        for f in ("kv_num_blocks", "kv_indices", "touches_dead"):
            assert torch.equal(getattr(one, f), getattr(many, f)), f
        assert one.touches_dead.any()
        for f in ("tail_lse", "tail_value", "coarse"):
            assert torch.allclose(getattr(one, f), getattr(many, f), atol=1e-6, rtol=1e-6), f


def test_block_stats_cpu_path_equals_the_generic_path():
    q, k, v = make_qkv(2, 300, 3, 16, seed=4)
    L = torch.tensor([64, 20, 64, 64, 44], dtype=torch.int32)
    q = q.clone()
    q[:, 64 + 20:128] = float("nan")                                          # dead rows hold NaN
    p = validate(q, k, v, block_len=L)
    st = routing.block_stats(p)                                                # CPU inference path
    for got, x in ((st.qm, q), (st.km, k), (st.vm, v)):
        want = routing.block_means(x.detach().requires_grad_(), L)             # the generic path
        assert torch.isfinite(got).all()
        assert torch.allclose(got, want.detach(), atol=1e-6)
    assert torch.equal(st.m, st.km.mean(dim=2, keepdim=True))


def test_tail_rows_empty_tail_and_gradient_match_logsumexp():
    g = torch.Generator().manual_seed(5)
    qm, kmc, vm = (torch.randn(2, 6, 8, generator=g, dtype=torch.float64) for _ in range(3))
    qm = qm[:, :4].clone().requires_grad_()
    logL = torch.log(torch.tensor([64.0, 64, 30, 64, 64, 5], dtype=torch.float64))
    exact = torch.rand(2, 4, 6, generator=g) < 0.4
    exact[0, 1] = True                                                         # an empty tail
    lse, tv = routing.tail_rows(qm, kmc, vm, logL, 0.7, exact)
    assert math.isinf(lse[0, 1].item()) and lse[0, 1] < 0 and torch.equal(tv[0, 1], torch.zeros(8, dtype=torch.float64))
    logw = (0.7 * qm @ kmc.transpose(-1, -2) + logL).masked_fill(exact, -math.inf)
    want_lse = torch.logsumexp(logw, -1)
    want_tv = torch.softmax(logw, -1).nan_to_num(0.0) @ vm
    keep = ~torch.isinf(want_lse)
    assert torch.allclose(lse[keep], want_lse[keep]) and torch.allclose(tv, want_tv)
    (ga,) = torch.autograd.grad(lse[keep].sum() + tv.pow(2).sum(), qm)
    (gb,) = torch.autograd.grad(want_lse[keep].sum() + want_tv.pow(2).sum(), qm)
    assert torch.isfinite(ga).all() and torch.allclose(ga, gb)


@pytest.mark.parametrize("grad", [False, True])
def test_vsa_tiled_problems_sum_their_zero_dead_rows_unmasked(vsa_plan_marks, grad):
    """VSA's tiled layout writes zeros into the dead rows, so its problems (dead_rows_zero) skip
    the dead-row mask in the block sums (2.4x faster torch plan on a 2-core CPU) with the same
    fp32 statistics; video_sparse_attn marks its problems so."""
    import dataclasses
    from solattn.tiling import DEFAULT_CUBE, layout as tiled_layout, to_tiled
    grid, segments = (5, 6, 7), (70, 30)
    T = sum(segments) + 5 * 6 * 7
    q, k, v = make_qkv(1, T, 2, 32, dtype=torch.bfloat16, seed=12)
    layout = tiled_layout(grid, DEFAULT_CUBE, segments, q.device)
    tq, tk, tv = (to_tiled(x, layout) for x in (q, k, v))
    if grad:        # the autograd path of the block means (chunked torch.where when masking)
        tq, tk, tv = (x.requires_grad_(True) for x in (tq, tk, tv))
    problem = validate(tq, tk, tv, tail=False, block_len=layout.block_len)
    dead = ~routing.live_token_mask(problem.block_len).flatten()[:problem.T]
    assert dead.any() and all((x[:, dead] == 0).all() for x in (tq, tk, tv))
    zeroed = dataclasses.replace(problem, dead_rows_zero=True)
    with torch.set_grad_enabled(grad):
        a, b = routing.block_stats(problem), routing.block_stats(zeroed)
    for name in ("qm", "km", "vm", "m", "L"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    solattn.video_sparse_attn(q, k, v, grid, sparsity=0.5, prefix_len=list(segments))
    assert vsa_plan_marks == [True]


@pytest.mark.parametrize("method", routing.TOPK_METHODS)
def test_kth_largest_is_the_kth_of_the_sorted_row(method):
    """kth_largest gives each row's kk-th largest value as a descending sort reads it (ties and
    -inf entries included), also above the size from which it runs on the caller's threads inside
    the plan's one-thread section, which it leaves at one thread."""
    from solattn.routing.stats import serial_cpu
    g = torch.Generator().manual_seed(3)
    for shape, kk in (((3, 5, 40), 7), ((3, 5, 40), 39), ((4, 300, 300), 30)):
        x = torch.randn(shape, generator=g).mul(4).round()               # many ties
        x[..., :3] = -float("inf")
        want = torch.sort(x, dim=-1, descending=True).values[..., kk - 1]
        with serial_cpu():
            got = routing.kth_largest(x, kk, method)
            threads = torch.get_num_threads()
        assert torch.equal(got, want) and threads == 1, (shape, kk)
