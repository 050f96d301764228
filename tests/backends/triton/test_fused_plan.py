"""The fused routing plan (Triton kernels, run here by Triton's CPU interpreter) against
the torch plan, its oracle.

Inputs are solattn.testing.make_qkv (well separated blocks), whose routing scores sit far from
every threshold, so both plans must select exactly the same blocks; ``_assert_clear`` checks that
before comparing. The pooled terms (tail, coarse, centroid) are fp32 sums taken in another order:
they are compared with fp32 tolerances. Shapes are tiny (T <= 600, H <= 2).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from solattn.testing import triton_interpretable

if not triton_interpretable():
    pytest.skip("needs Triton >= 3.9 for its CPU interpreter", allow_module_level=True)

import solattn  # noqa: E402
from solattn import config, triton_runtime  # noqa: E402
from solattn.backends.triton import TritonBackend  # noqa: E402
from solattn.routing import build_plan, fused  # noqa: E402
from solattn.testing import assert_selection_clear, make_qkv  # noqa: E402
from solattn.validation import validate  # noqa: E402


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield




@pytest.fixture
def tma_everywhere():
    """TMA descriptors at the tests' small sizes too (no ``tma_min_programs`` threshold)."""
    from solattn.backends.triton import TritonTuning
    with config.tuning(TritonTuning(tma_min_programs=0)):
        yield


def _compare(problem, clear=True, tuning=None):
    """Fused plan == torch plan: identical selection, pooled terms within fp32 rounding.
    ``tuning``: launch overrides of the fused plan (``FusedPlanTuning`` fields; default: none)."""
    if clear:
        assert_selection_clear(problem, margin=1e-4)
    assert fused.fused_plan_usable(problem)
    want = build_plan(problem)
    with config.tuning(fused.FusedPlanTuning(**(tuning or {}))):
        got = fused.fused_plan(problem)
    B, H, n = problem.B, problem.H, problem.n
    assert got.kv_indices.shape == (B, H, n, n) and got.kv_indices.dtype == torch.int32
    assert torch.equal(got.kv_num_blocks, want.kv_num_blocks)
    M = want.kv_indices.shape[-1]
    assert torch.equal(got.kv_indices[..., :M], want.kv_indices)
    assert (got.kv_indices[..., M:] == 0).all(), "padding past the count must be 0"
    assert torch.equal(got.touches_dead, want.touches_dead)
    assert torch.equal(got.block_len, want.block_len)
    assert torch.equal(got.dense_mask(), want.dense_mask())
    tol = dict(rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(got.key_mean, want.key_mean, **tol)
    for name in ("tail_lse", "tail_value", "coarse"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if b is not None:
            torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{name}: {m}")
    return got, want


@pytest.mark.parametrize("mode,coarse", [("topk", False), pytest.param("topk", True, marks=pytest.mark.slow),
                                         pytest.param("tau", False, marks=pytest.mark.slow),
                                         pytest.param("tau", True, marks=pytest.mark.slow)])
def test_modes_tail_coarse(mode, coarse):
    q, k, v = make_qkv(2, 600, 2, 64, dtype=torch.bfloat16, seed=1)
    gate = torch.rand(q.shape, generator=torch.Generator().manual_seed(2)).to(q.dtype) if coarse else None
    kw = dict(topk_ratio=0.3) if mode == "topk" else dict(tau=0.5)
    _compare(validate(q, k, v, tail=True, coarse_gate=gate, **kw))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["topk", "tau"])
def test_sinks_and_sink_q_without_tail(mode):
    q, k, v = make_qkv(1, 600, 2, 32, dtype=torch.float16, seed=3)
    kw = dict(topk_ratio=0.2) if mode == "topk" else dict(tau=1.0)
    got, _ = _compare(validate(q, k, v, tail=False, sink_blocks=(0, 2), sink_q=(4, 6), **kw))
    assert (got.kv_num_blocks[:, :, 4:6] == got.n).all()


# the tail switches on the select kernel's pooled sums and the means of v (NEED_V): the top-k tests
# below run with and without it

@pytest.mark.slow
@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("T", [1, 100, 130, 333])
def test_ragged_T_and_tiny_n(T, tail):
    # n = 1 (no top-k pick: forced block only), n = 2 (kk = 1), ragged last blocks
    q, k, v = make_qkv(1, T, 1, 64, dtype=torch.float32, seed=10 + T)
    _compare(validate(q, k, v, topk_ratio=0.4, tail=tail))


@pytest.mark.slow
@pytest.mark.parametrize("topk_tail", [True, False])
def test_block_len_dead_rows_hold_nan(topk_tail):
    q, k, v = make_qkv(2, 520, 2, 64, dtype=torch.bfloat16, seed=5)
    n = 9
    L = torch.tensor([64, 10, 64, 1, 64, 33, 64, 64, 8], dtype=torch.int32)
    for j in range(n):
        for t in (q, k, v):
            t[:, j * 64 + int(L[j]):(j + 1) * 64] = float("nan")
    for kw in (dict(topk_ratio=0.3, tail=topk_tail), dict(tau=0.5, tail=True)):
        got, _ = _compare(validate(q, k, v, block_len=L, **kw))
        assert got.touches_dead.any()
        assert got.tail_value is None or torch.isfinite(got.tail_value).all()


@pytest.mark.slow
@pytest.mark.parametrize("tail", [True, False])
def test_topk_ties_select_more_than_k(tail):
    # identical key blocks: every centred key mean is 0, every score 0, so every block ties at
    # the k-th score and is kept (cand >= theta); counts exceed k, which the n-wide indices hold
    q, k, v = make_qkv(1, 512, 2, 32, dtype=torch.float32, seed=7)
    k = k[:, :64].repeat(1, 8, 1, 1)
    got, _ = _compare(validate(q, k, v, topk_ratio=0.25, tail=tail), clear=False)
    assert (got.kv_num_blocks == 8).all()


@pytest.mark.slow
@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("ratio", [0.25, 0.4])
def test_topk_threshold_with_partial_ties(ratio, tail):
    # scores c * a_i * (s_j - mean s) with repeated s_j: depending on the row's sign the k-th
    # largest score is unique (the bisection may stop as soon as exactly k keys are above it) or
    # tied with others (it must run until lo is the k-th key and keep every tie); a_i = 0 ties
    # every block. Every value is exact in fp32, so both plans see identical scores.
    s = [0, 1, 2, 2, 2, 3, 4, 5, 5, 6, 7, 8, 9, 9, 9, 10]
    a = [1, -1, 0, 2, -0.5, 1, -3, 0.25, -1, 1, 0, -2, 4, -4, 1, -1]
    n, D = len(s), 16
    q = torch.zeros(1, n * 64, 1, D)
    k = torch.zeros(1, n * 64, 1, D)
    for j in range(n):
        q[:, j * 64:(j + 1) * 64, 0, 0] = a[j]
        k[:, j * 64:(j + 1) * 64, 0, 0] = s[j]
    v = torch.randn(1, n * 64, 1, D, generator=torch.Generator().manual_seed(0))
    got, want = _compare(validate(q, k, v, topk_ratio=ratio, tail=tail), clear=False)
    counts = got.kv_num_blocks[0, 0].tolist()
    assert counts[2] == n and counts[10] == n, "a row of equal scores keeps every block"
    kk = solattn.routing.select.topk_count(ratio, n)
    assert min(counts) >= kk and max(c for c, x in zip(counts, a) if x != 0) > kk + 1, \
        "some row keeps more than k + forced blocks: a tie at its threshold"


@pytest.mark.slow
@pytest.mark.parametrize("scores_here", [True, False])
@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("mode", ["topk", "tau"])
def test_scores_from_either_kernel(mode, scores_here, tail):
    # scores come from scores_kernel (split-TF32 GPUs) or from the select kernel itself (IEEE
    # products, the interpreter's default): both must select exactly like the torch plan
    q, k, v = make_qkv(2, 700, 2, 32, dtype=torch.float32, seed=11)
    kw = dict(topk_ratio=0.3) if mode == "topk" else dict(tau=0.5)
    _compare(validate(q, k, v, tail=tail, sink_blocks=(0, 1), **kw), tuning={"scores_here": scores_here})


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["topk", "tau", "forced"])
def test_pooled_terms_in_small_tiles(mode):
    # several row tiles and key chunks of the pooled-terms kernel (n = 21: 16-row tiles, 16-block
    # chunks, the last of each ragged), with sinks, both branches on; "forced": top-k whose
    # sinks leave one block, so only forced blocks are exact
    q, k, v = make_qkv(1, 1300, 2, 32, dtype=torch.float32, seed=12)
    gate = torch.rand(q.shape, generator=torch.Generator().manual_seed(3))
    kw = dict(tau=0.5) if mode == "tau" else dict(topk_ratio=0.3)
    sinks = (2, 4)
    if mode == "forced":                 # one non-sink block left: no pick by score (kk = 0)
        sinks = (0, 20)
        assert solattn.routing.select.topk_count(0.3, 21 - 20) == 0
    _compare(validate(q, k, v, tail=True, coarse_gate=gate, sink_blocks=sinks, sink_q=(7, 8), **kw),
             tuning={"pool_bi": 16, "pool_bj": 16})


@pytest.mark.slow
def test_sol_attn_triton_uses_fused_plan_and_matches_torch_plan(monkeypatch):
    q, k, v = make_qkv(2, 400, 2, 64, dtype=torch.bfloat16, seed=9)
    gate = torch.rand(q.shape, generator=torch.Generator().manual_seed(4)).to(q.dtype)
    calls = []
    real = fused.fused_plan

    def spy(problem, **kwargs):
        calls.append(problem)
        return real(problem, **kwargs)

    monkeypatch.setattr(fused, "fused_plan", spy)
    for kw in (dict(topk_ratio=0.3, sink_blocks=(0, 1)), dict(tau=0.5, coarse_gate=gate)):
        problem = validate(q, k, v, tail=True, **kw)
        assert_selection_clear(problem, margin=1e-4)
        got = solattn.sol_attn(q, k, v, tail=True, backend="triton", **kw)
        want = TritonBackend().forward(problem, build_plan(problem))
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2 ** -7)
        assert (got != want).float().mean() < 0.01
    assert len(calls) == 2


def test_not_used_with_autograd_or_off_the_interpreter(monkeypatch):
    q, k, v = make_qkv(1, 200, 1, 64, dtype=torch.float32, seed=11)
    qg = q.clone().requires_grad_(True)
    assert fused.fused_plan_usable(validate(q, k, v, topk_ratio=0.3))
    assert not fused.fused_plan_usable(validate(qg, k, v, topk_ratio=0.3))
    q48 = torch.randn(1, 200, 1, 48)
    assert not fused.fused_plan_usable(validate(q48, q48, q48, topk_ratio=0.3))
    # past max_fused_blocks key blocks the torch plan takes over (expanded views: no memory)
    most = fused.FusedPlanTuning().max_fused_blocks
    long = torch.zeros(1, 1, 1, 16).expand(1, 64 * most + 1, 1, 16)
    assert validate(long, long, long, topk_ratio=0.3).n == most + 1
    with solattn.memory_budget(1 << 40, backend="sdpa"):     # the indices' size is not what is tested
        assert not fused.fused_plan_usable(validate(long, long, long, topk_ratio=0.3))
        assert fused.fused_plan_usable(validate(long[:, :-1], long[:, :-1], long[:, :-1], topk_ratio=0.3))
        with config.tuning(fused.FusedPlanTuning(max_fused_blocks=most - 1)):     # a scoped limit
            assert not fused.fused_plan_usable(validate(long[:, :-1], long[:, :-1], long[:, :-1], topk_ratio=0.3))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    problem = validate(q, k, v, topk_ratio=0.3)
    assert not fused.fused_plan_usable(problem)
    assert build_plan(problem, fused=True).kv_indices.shape[-1] == int(build_plan(problem).kv_num_blocks.max())


def test_dot_precision_follows_the_device(monkeypatch):
    # exact fp32 products where TF32 tensor cores are missing (and in the interpreter), the split
    # tf32x3 products on compute capability 8.0+; an explicit setting wins
    assert fused.dot_precision(torch.device("cpu")) == "ieee"
    cuda = torch.device("cuda", 0)
    for cap, want in (((7, 5), "ieee"), ((8, 0), "tf32x3"), ((9, 0), "tf32x3")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cap=cap: cap)
        assert fused.dot_precision(cuda) == want
    monkeypatch.setattr(torch.version, "hip", "6.2")      # ROCm: AMD GPUs are "cuda" devices too
    assert fused.dot_precision(cuda) == "ieee"
    monkeypatch.setattr(torch.version, "hip", None)
    with config.tuning(fused.FusedPlanTuning(dot_precision="ieee")):
        assert fused.dot_precision(cuda) == "ieee"
    assert fused.dot_precision(cuda) == "tf32x3"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["topk", "tau"])
def test_launch_settings_of_large_problems(mode):
    # at H3 the bisection kernel takes 2 rows per program (4 of a select program's 16 rows at a
    # time where the select kernel writes the scores) and the centroid 32 of 128 dims per program;
    # the tiny problems here default to one tile and one program: force the split
    q, k, v = make_qkv(2, 900, 2, 64, dtype=torch.float32, seed=12)
    kw = dict(topk_ratio=0.3) if mode == "topk" else dict(tau=0.5)
    for tuning in ({"rb": 4, "kth_rb": 4, "kth_warps": 2, "centroid_bd": 16, "scores_bk": 16},
                   {"rb": 1, "kth_rb": 1, "centroid_bd": 64},
                   {"rb": 4, "scores_here": True}):
        _compare(validate(q, k, v, tail=True, sink_blocks=(0, 1), **kw), tuning=tuning)


# VSA's selection through the same kernels (fused.vsa_rule): no neighbours, prefix tiles as sinks


def _vsa_problem(grid, segments, seed, gate=False, D=64, H=2):
    """A VSA call's tiled problem, as video_sparse_attn builds it (prefix tiles, then cubes)."""
    from solattn.tiling import DEFAULT_CUBE, layout as tiled_layout, to_tiled
    T = sum(segments) + grid[0] * grid[1] * grid[2]
    q, k, v = make_qkv(1, T, H, D, dtype=torch.bfloat16, seed=seed)
    layout = tiled_layout(tuple(grid), DEFAULT_CUBE, tuple(segments), q.device)
    tq, tk, tv = (to_tiled(x, layout) for x in (q, k, v))
    g = torch.rand(q.shape, generator=torch.Generator().manual_seed(seed)).to(q.dtype) if gate else None
    tg = None if g is None else to_tiled(g, layout)
    return validate(tq, tk, tv, tail=False, block_len=layout.block_len, coarse_gate=tg), layout


def _assert_vsa_clear(problem, k_vid, P, mode, margin=1e-4):
    """The rows' k-th and next largest competing scores differ by more than ``margin`` (relative),
    so that fp32 rounding in another order cannot change the selection."""
    from solattn.routing import block_stats
    stats = block_stats(problem)
    S = (stats.qm.double() @ stats.km.double().transpose(-1, -2)) * problem.scale
    kk = k_vid if mode == "exempt" or P == 0 else min(k_vid + P, problem.n)
    comp = S[..., P:] if mode == "exempt" else S
    if kk >= comp.shape[-1]:
        return
    top = comp.sort(-1, descending=True).values
    gap = (top[..., kk - 1] - top[..., kk]) / top.abs().amax(-1).clamp_min(1e-30)
    assert float(gap.min()) > margin, float(gap.min())


def _vsa_plan_cases():
    """Every (segments, gate) x mode; the default run keeps one prefix segment with a gate, exempt."""
    for i, (segments, gate) in enumerate([((), False), ((100, 30), False), ((70,), True)]):
        for mode in ("exempt", "compete"):
            slow = () if (segments, mode) == ((70,), "exempt") else (pytest.mark.slow,)
            yield pytest.param(mode, segments, gate, id=f"segments{i}-{gate}-{mode}", marks=slow)


@pytest.mark.parametrize("mode, segments, gate", list(_vsa_plan_cases()))
def test_vsa_plan_matches_torch_plan(mode, segments, gate):
    from solattn.routing import build_vsa_plan
    problem, layout = _vsa_problem((5, 6, 7), segments, seed=21, gate=gate)
    P = layout.num_prefix_blocks
    assert P == sum(-(-s // 64) for s in segments)
    n_video = problem.n - P
    for k_vid in (1, 3, n_video // 2, n_video):
        _assert_vsa_clear(problem, k_vid, P, mode)
        want = build_vsa_plan(problem, k_vid, P, mode)
        got = build_vsa_plan(problem, k_vid, P, mode, fused=True)
        n = problem.n
        assert got.kv_indices.shape[-1] == n, "the fused plan's kv_indices are n wide"
        assert torch.equal(got.kv_num_blocks, want.kv_num_blocks), k_vid
        M = want.kv_indices.shape[-1]
        assert torch.equal(got.kv_indices[..., :M], want.kv_indices)
        assert (got.kv_indices[..., M:] == 0).all()
        assert torch.equal(got.touches_dead, want.touches_dead)
        assert torch.equal(got.block_len, want.block_len)
        mask = got.dense_mask()
        assert torch.equal(mask, want.dense_mask())
        # the definition, on the fused plan alone: prefix query tiles attend every tile, a video
        # query tile keeps k_vid video tiles (ties none: clear margins) plus every prefix tile
        # ("exempt") or k_vid + P tiles in all ("compete"); no forced neighbours
        assert mask[:, :, :P].all()
        if mode == "exempt" or P == 0:
            assert (mask[:, :, P:, :P]).all()
            assert (mask[:, :, P:, P:].sum(-1) == k_vid).all()
        else:
            assert (mask[:, :, P:].sum(-1) == min(k_vid + P, n)).all()
        assert (got.coarse is None) == (not gate)
        if gate:
            torch.testing.assert_close(got.coarse, want.coarse, rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="k_vid"):
        build_vsa_plan(problem, n_video + 1, P, mode, fused=True)


@pytest.mark.slow
def test_video_sparse_attn_triton_uses_fused_vsa_plan(monkeypatch, tma_everywhere):
    grid, segments = (4, 8, 8), (70,)
    T = sum(segments) + 4 * 8 * 8
    q, k, v = make_qkv(1, T, 2, 64, dtype=torch.bfloat16, seed=5)
    gate = torch.rand(q.shape, generator=torch.Generator().manual_seed(6)).to(q.dtype)
    calls, tables = [], []
    real = fused.fused_plan

    def spy(problem, rule=None, extras=frozenset()):
        calls.append(rule)
        tables.append(problem.rows is not None)
        return real(problem, rule, extras)

    monkeypatch.setattr(fused, "fused_plan", spy)
    from solattn.backends.triton import backend as tb
    tma_calls = []
    real_tma_ok = tb.tma_ok

    def tma_spy(problem, interpret):
        tma_calls.append(real_tma_ok(problem, interpret))
        return tma_calls[-1]

    monkeypatch.setattr(tb, "tma_ok", tma_spy)
    for mode in ("exempt", "compete"):
        kw = dict(sparsity=0.75, gate=gate, prefix_len=list(segments), prefix_mode=mode)
        got = solattn.video_sparse_attn(q, k, v, grid, backend="triton", **kw)
        want = solattn.video_sparse_attn(q.float(), k.float(), v.float(), grid, backend="sdpa", **kw)
        rel = ((got.float() - want).norm() / want.norm()).item()
        assert rel < 1e-2, rel
    assert [r.near for r in calls] == [False, False] and [r.q1 for r in calls] == [2, 2]
    assert [r.s1 for r in calls] == [2, 0]
    # the plan and the kernel read the caller's q, k, v through the layout's row table; the kernel
    # takes TMA loads from its tiled copy of k and v (zeros in the dead rows), which the fused plan
    # made on the way (asked twice per call: for the plan's extras, then by the launch)
    assert tables == [True, True] and tma_calls == [True] * 4
    # a backward follows: it keeps the forward's plan (the coarse term's gradient needs no
    # rebuild), so the forward takes the fused plan too, from the row table as well
    calls.clear()
    tables.clear()
    qg = q.clone().requires_grad_(True)
    solattn.video_sparse_attn(qg, k, v, grid, backend="triton", sparsity=0.75, gate=gate,
                              prefix_len=list(segments)).float().sum().backward()
    assert len(calls) == 1 and qg.grad is not None and torch.isfinite(qg.grad).all()
    assert tables == [True]


@pytest.mark.slow
def test_tma_with_block_len_only_where_dead_rows_are_zeros(tma_everywhere):
    """A caller's block_len promises nothing about its dead rows (they may hold NaN): the triton
    backend keeps pointer loads there; VSA's tiled problems (dead_rows_zero) take TMA loads."""
    import dataclasses
    from solattn.backends.triton import backend as tb
    q, k, v = make_qkv(1, 256, 1, 64, dtype=torch.bfloat16, seed=8)
    block_len = torch.tensor([64, 40, 64, 10], dtype=torch.int32)
    k, v = k.clone(), v.clone()
    for j, L in enumerate(block_len.tolist()):
        k[:, j * 64 + L:(j + 1) * 64] = float("nan")
        v[:, j * 64 + L:(j + 1) * 64] = float("nan")
    problem = validate(q, k, v, topk_ratio=0.5, tail=False, block_len=block_len)
    assert not tb.tma_ok(problem, True)
    out = TritonBackend().forward(problem, build_plan(problem, fused=True))
    assert torch.isfinite(out[:, :64 + 40]).all()
    zeroed = dataclasses.replace(problem, dead_rows_zero=True)
    assert tb.tma_ok(zeroed, True)
    kz, vz = torch.nan_to_num(k, nan=0.0), torch.nan_to_num(v, nan=0.0)
    pz = dataclasses.replace(validate(q, kz, vz, topk_ratio=0.5, tail=False, block_len=block_len),
                             dead_rows_zero=True)
    plan = build_plan(pz, fused=True)
    got = TritonBackend().forward(pz, plan)               # TMA loads, dead keys masked by block_len
    pointer = TritonBackend().forward(dataclasses.replace(pz, dead_rows_zero=False), plan)
    assert torch.equal(got, pointer), "the same keys and arithmetic as the pointer loads"
    want = solattn.sol_attn(q, kz, vz, topk_ratio=0.5, tail=False, block_len=block_len, backend="sdpa")
    live = torch.cat([torch.arange(j * 64, j * 64 + L) for j, L in enumerate(block_len.tolist())])
    torch.testing.assert_close(got[:, live].float(), want[:, live].float(), rtol=2 ** -7, atol=2 ** -7)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["exempt", "compete"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf")])
def test_vsa_plan_with_an_infinite_key_matches_torch_plan(mode, value):
    """VSA ranks tiles by the uncentred S = qm . km (vsa_rule(centre=False)): an infinite key in one
    tile moves that tile's column only. Centred by the key centroid, it made m infinite and every
    row's scores meaningless (8 of 10 rows selected differently)."""
    from solattn.routing import build_vsa_plan
    problem, layout = _vsa_problem((8, 8, 8), (70,), seed=0, H=1, D=32)
    tk = problem.k.clone()
    tk[0, layout.slots[75], 0, 3] = value                  # one element of a live row of cube 0
    problem = dataclasses.replace(problem, k=tk)
    P = layout.num_prefix_blocks
    for k_vid in (2, 5):
        want = build_vsa_plan(problem, k_vid, P, mode)
        got = build_vsa_plan(problem, k_vid, P, mode, fused=True)
        assert torch.equal(got.dense_mask(), want.dense_mask()), k_vid


def _kth_scores(kind, rows, n, gen):
    if kind == "normal":
        return torch.randn(rows, n, generator=gen)
    if kind == "spread":      # magnitudes 1e-30 .. 1e30, both signs: bisection over values alone stalls
        mag = 10.0 ** (torch.rand(rows, n, generator=gen) * 60 - 30)
        return mag * torch.where(torch.rand(rows, n, generator=gen) < 0.5, -1.0, 1.0)
    if kind == "ties":        # few distinct values, so thresholds fall inside runs of ties
        return torch.randint(-3, 4, (rows, n), generator=gen).float()
    s = torch.randn(rows, n, generator=gen)   # "inf": infinities of both signs among finite scores
    s[:, ::7] = float("inf")
    s[:, 3::11] = float("-inf")
    return s


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["normal", "spread", "ties", "inf"])
@pytest.mark.parametrize("n", [64, 70, 583])
def test_kth_kernel_finds_the_kth_largest_key(kind, n):
    """kth_kernel against the definition on hand-made score rows: theta = the order key of the kk-th
    largest non-sink score, or a key between it and the next (count(key >= theta) == kk, the same
    set); n a power of two (one piece) and not (two), sinks excluded, rows of 1 and 2 per program."""
    from solattn.triton_runtime.jit import compiled
    from solattn.routing import fused_kernels as fk
    gen = torch.Generator().manual_seed(n)
    G, R = 2, 8                          # the first R rows of each batch * head: the interpreter is slow
    scores = _kth_scores(kind, G * n, n, gen).view(G, n, n).contiguous()
    s0, s1 = 1, 3
    key = scores.view(torch.int32).clone()
    key = torch.where(scores == 0, torch.zeros_like(key), key)
    key = key ^ ((key >> 31) & 0x7FFFFFFF)                     # order keys, as order_key makes them
    cand = torch.ones(n, dtype=torch.bool)
    cand[s0:s1] = False
    ck = key[:, :R][..., cand]
    NA = 1 << (n.bit_length() - 1)
    NB = 0 if n == NA else max(16, triton_runtime.pow2(n - NA))
    for kk in (1, n // 5, n - 3):
        kth = ck.sort(-1, descending=True).values[..., kk - 1]
        for rb in (1, 2):
            theta = torch.empty(G, n, dtype=torch.int32)
            compiled(True, fk.kth_kernel)[(R // rb, G)](scores, theta, n, kk, s0, s1, NA=NA, NB=NB, RB=rb)
            theta = theta[:, :R]
            count = (ck >= theta[..., None]).sum(-1)
            assert (count >= kk).all(), (kind, kk, rb)
            assert ((theta == kth) | (count == kk)).all(), (kind, kk, rb)
