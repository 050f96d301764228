"""The experiment kernels of ``benchmarks/kernel_variants_m128.py``, run by Triton's CPU
interpreter against the production kernel on the same plan.

The production kernel (itself tested against the reference in test_triton_backend.py) is the
oracle: a variant must compute the same function of the plan, so it is compared with it on the
plan the variant gets, including plans whose lists were edited to make neighbouring query blocks'
lists coincide (the kernel computes whatever the plan lists, so such plans are valid inputs).
Problems are tiny (T <= 300, H <= 2, D = 64): the module runs in seconds.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import replace

import pytest
import torch

triton = pytest.importorskip("triton")
if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
    pytest.skip(f"interpreter tests need triton >= 3.9 (found {triton.__version__})", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

import kernel_variants_m128 as M  # noqa: E402
from solattn.backends.reference import reference_forward  # noqa: E402
from solattn.backends.triton import KernelConfig, launch  # noqa: E402
from solattn.routing import build_plan  # noqa: E402
from solattn.routing.plan import indices_from_mask  # noqa: E402
from solattn.testing import make_qkv, rel_l2, tolerance  # noqa: E402
from solattn.validation import validate  # noqa: E402


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


def _rand(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def _problem(case):
    """Small problems covering every kernel feature: modes, tail on/off, key_bias, coarse gate,
    ragged T with an even and an odd number of blocks, block_len (pointer loads), B=2."""
    if case == "topk_tail":
        q, k, v = make_qkv(1, 300, 2, 64, dtype=torch.bfloat16, seed=10)        # n = 5 (odd)
        return validate(q, k, v, topk_ratio=0.3, tail=True)
    if case == "tau_notail":
        q, k, v = make_qkv(1, 256, 2, 64, dtype=torch.bfloat16, seed=11)        # n = 4
        return validate(q, k, v, tau=0.5, tail=False)
    if case == "bias_coarse_b2":
        B, T = 2, 200                                                         # ragged, n = 4
        q, k, v = make_qkv(B, T, 2, 64, dtype=torch.bfloat16, seed=12)
        bias = _rand((B, T), torch.float32, 13) * 2.0
        bias[0, 70:100] = -math.inf
        gate = _rand(q.shape, torch.bfloat16, 14)
        return validate(q, k, v, topk_ratio=0.3, tail=True, key_bias=bias, coarse_gate=gate)
    if case == "block_len":
        T = 280                                                               # n = 5, last ragged
        q, k, v = make_qkv(1, T, 1, 64, dtype=torch.bfloat16, seed=15)
        gate = _rand(q.shape, torch.bfloat16, 16)
        block_len = torch.tensor([17, 64, 40, 64, 9], dtype=torch.int32)
        return validate(q, k, v, tau=0.3, tail=True, block_len=block_len, coarse_gate=gate)
    if case == "fp16_T1":
        q, k, v = make_qkv(1, 1, 2, 64, dtype=torch.float16, seed=17)
        return validate(q, k, v, topk_ratio=0.5, tail=True)
    raise AssertionError(case)


CASES = ["topk_tail", "tau_notail", "bias_coarse_b2", "block_len", "fp16_T1"]


def _coinciding(plan, pairs=(0,)):
    """``plan`` with the odd block of each pair in ``pairs`` given its even neighbour's list
    (every (b, h)), so those pairs' lists coincide exactly."""
    exact = plan.dense_mask().clone()
    n = exact.shape[2]
    for p in pairs:
        if 2 * p + 1 < n:
            exact[:, :, 2 * p + 1] = exact[:, :, 2 * p]
    num, idx = indices_from_mask(exact)
    return replace(plan, kv_num_blocks=num, kv_indices=idx)


def _compare(problem, plan, variant, tma):
    want = launch(problem, plan, config=KernelConfig(1, 4, 3, tma=tma))
    out = torch.full(problem.q.shape, float("nan"), dtype=problem.v.dtype)
    got = variant.prepare(problem, plan)(out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.isfinite(got).all(), "variant left elements unwritten (NaN poison) or produced inf/NaN"
    err = rel_l2(got, want)
    # the same arithmetic per row; only the matmul tile shape differs (fp32 rounding order)
    assert err < 1e-3, f"{variant.name}: relative L2 {err:.2e} against the production kernel"
    return got, want


#: one entry per kernel source (stages and warps do not change what the interpreter runs;
#: the "production ..." entries are the production kernel itself at other launch configs)
KERNELS = ["union w8/s2", "split exact w8/s2", "split <=1.25 w8/s2", "m64 list", "m64 lpt", "pair3d w8/s2"]


def test_kernels_cover_every_variant_source():
    assert set(KERNELS) <= set(M.variants())
    covered = {n.split(" w")[0] for n in KERNELS} | {"production"}
    assert {n.split(" w")[0] for n in M.variants()} <= covered


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", KERNELS)
def test_variant_matches_production(name, case):
    problem = _problem(case)
    plan = build_plan(problem)
    tma = case != "block_len"       # block_len makes the launcher fall back to pointer loads anyway
    _compare(problem, plan, M.variants(tma=tma)[name], tma)


@pytest.mark.parametrize("name", ["split exact w8/s2", "split <=1.25 w8/s2", "union w8/s2"])
def test_variants_on_coinciding_pairs(name):
    # pairs 0 and 1 coincide, pair 2 (block 4, n odd) does not exist as a pair: the split
    # launches both kernels, the 128-row one unmasked for "split exact"
    problem = _problem("topk_tail")
    plan = _coinciding(build_plan(problem), pairs=(0, 1))
    pp = M.pair_plan(plan)
    pairs, singles = M.split_work(pp, problem.n, 1.0)
    assert pairs.numel() == 2 * problem.H and singles.numel() == problem.H    # block 4 of each head
    got, _ = _compare(problem, plan, M.variants()[name], tma=True)
    # the plan is still a valid plan for the reference where its lists are the selection's
    # supersets; the kernel-vs-kernel check above is the test; also sanity against the reference
    # on the untouched query block 4 (rows 256..299)
    ref = reference_forward(problem)
    assert rel_l2(got[:, 256:], ref[:, 256:]) < tolerance(torch.bfloat16)


def test_union_mask_is_needed():
    # without the per-half mask the union kernel attends blocks outside a half's own list, so
    # the output must change on a plan whose neighbouring lists differ (the mask is exercised)
    problem = _problem("topk_tail")
    plan = build_plan(problem)
    pp = M.pair_plan(plan)
    assert pp.stats()["coincide_frac"] < 1.0
    cfg = KernelConfig(1, 8, 2, tma=True)
    masked = M.launch_m128(problem, plan, pp, cfg, masked=True)
    unmasked = M.launch_m128(problem, plan, pp, cfg, masked=False)
    assert rel_l2(unmasked, masked) > 1e-2


def test_pair_plan_against_sets():
    problem = _problem("bias_coarse_b2")
    plan = _coinciding(build_plan(problem), pairs=(1,))
    pp = M.pair_plan(plan)
    B, H, n = plan.kv_num_blocks.shape
    assert pp.P == (n + 1) // 2
    same = 0
    for b in range(B):
        for h in range(H):
            lists = [set(plan.kv_indices[b, h, i, :plan.kv_num_blocks[b, h, i]].tolist()) for i in range(n)] + [set()]
            for p in range(pp.P):
                a, c = lists[2 * p], lists[2 * p + 1]
                u = sorted(a | c)
                assert pp.union_num[b, h, p].item() == len(u)
                assert pp.union_idx[b, h, p, :len(u)].tolist() == u
                bits = [(j in a) + 2 * (j in c) for j in u]
                assert pp.union_bits[b, h, p, :len(u)].tolist() == bits
                same += a == c
    st = pp.stats()
    assert st["pairs"] == B * H * (n // 2)
    assert st["coincide_frac"] == pytest.approx(same / st["pairs"])
    useful = (pp.n_even + pp.n_odd).sum().item()
    assert st["work_ratio"] == pytest.approx(2 * pp.union_num.sum().item() / useful)


@pytest.mark.parametrize("max_overhead", [1.0, 1.25, 2.0])
def test_split_work_covers_every_block_once(max_overhead):
    problem = _problem("topk_tail")
    plan = _coinciding(build_plan(problem), pairs=(0,))
    pp = M.pair_plan(plan)
    n, P = problem.n, pp.P
    pairs, singles = M.split_work(pp, n, max_overhead)
    covered = [int(w) // P * n + 2 * (int(w) % P) + d for w in pairs for d in (0, 1)] + singles.tolist()
    assert sorted(covered) == list(range(plan.kv_num_blocks.numel()))
    ov = pp.overhead().flatten()
    assert all(ov[int(w)] <= max_overhead + 1e-9 for w in pairs)
    assert M.lpt_work(plan).sort().values.tolist() == list(range(plan.kv_num_blocks.numel()))
