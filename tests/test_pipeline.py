"""The triton backend's pipeline (solattn/backends/triton/pipeline.py): the fused plan and the
kernel launched one group of batch * head rows at a time must give exactly the output and the
plan of the same kernels launched on all rows at once.

Under Triton's CPU interpreter (the groups run one after the other) and, with a GPU, through
``sol_attn`` on two streams and inside a captured CUDA graph (``-k cuda``).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

import solattn  # noqa: E402
from solattn.backends.triton import backend as tb  # noqa: E402
from solattn.backends.triton import pipeline  # noqa: E402
from solattn.routing import fused  # noqa: E402
from solattn.testing import make_qkv, rel_l2  # noqa: E402
from solattn.validation import validate  # noqa: E402

INTERPRETER_OK = tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 9)
needs_interpreter = pytest.mark.skipif(not INTERPRETER_OK, reason="interpreter tests need triton >= 3.9")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PLAN_FIELDS = ("kv_num_blocks", "kv_indices", "block_len", "key_mean", "tail_lse", "tail_value",
               "coarse", "touches_dead")


def _assert_same(got_out, got_plan, want_out, want_plan):
    assert torch.equal(got_out, want_out)
    for name in PLAN_FIELDS:
        a, b = getattr(got_plan, name), getattr(want_plan, name)
        assert (a is None) == (b is None), name
        if b is not None:
            assert torch.equal(a.nan_to_num(), b.nan_to_num()), name


def test_group_bounds_cover_every_row_once():
    for rows in (1, 2, 7, 56):
        for groups in range(1, rows + 1):
            bounds = pipeline.group_bounds(rows, groups)
            assert len(bounds) == groups and bounds[0][0] == 0 and bounds[-1][1] == rows
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            sizes = [g1 - g0 for g0, g1 in bounds]
            assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="'groups' received 5; allowed: 1 to rows = 4"):
        pipeline.group_bounds(4, 5)


def test_rows_argument_checked_before_launch():
    q, k, v = make_qkv(1, 200, 2, 32, dtype=torch.float16, seed=0)
    problem = validate(q, k, v, topk_ratio=0.3)
    out = torch.empty_like(q)
    for rows in ((0, 3), (1, 1), (-1, 2)):
        with pytest.raises(ValueError, match=r"argument 'rows' received .*allowed: None or \(g0, g1\)"):
            tb.launch(problem, None, out=out, rows=rows)


@needs_interpreter
@pytest.mark.parametrize("case", ["topk", "tau_tail_coarse", "block_len_sinks"])
def test_groups_give_the_unpipelined_output_and_plan(case, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    B, H = (1, 3) if case == "topk" else (2, 3)
    q, k, v = make_qkv(B, 300, H, 32, dtype=torch.bfloat16, seed=4)
    kw = dict(topk_ratio=0.3, tail=False)
    if case == "tau_tail_coarse":
        gate = torch.rand(q.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)
        kw = dict(tau=0.5, tail=True, coarse_gate=gate)
    elif case == "block_len_sinks":
        blen = torch.tensor([64, 40, 64, 1, 44], dtype=torch.int32)
        kw = dict(topk_ratio=0.4, tail=True, block_len=blen, sink_blocks=(0, 1), sink_q=(3, 4))
    problem = validate(q, k, v, **kw)
    want_plan = fused.fused_plan(problem)
    want_out = tb.launch(problem, want_plan)
    for groups in range(2, B * H + 1):
        got_out, got_plan = pipeline.pipelined_forward(problem, groups)
        _assert_same(got_out, got_plan, want_out, want_plan)


@needs_interpreter
def test_sol_attn_goes_through_the_pipeline_when_it_applies(monkeypatch):
    # on the CPU pipeline_groups is 1; forced to 3 here, sol_attn must take the pipeline and give
    # the same output as without it
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = make_qkv(1, 256, 3, 32, dtype=torch.float16, seed=2)
    kw = dict(topk_ratio=0.3, tail=True, backend="triton")
    assert pipeline.pipeline_groups(validate(q, k, v, topk_ratio=0.3)) == 1
    want = solattn.sol_attn(q, k, v, **kw)
    calls = []
    real = pipeline.pipelined_forward

    def spy(problem, groups, config=None):
        calls.append(groups)
        return real(problem, groups, config)

    monkeypatch.setattr(pipeline, "pipeline_groups", lambda problem: 3)
    monkeypatch.setattr(pipeline, "pipelined_forward", spy)
    got = solattn.sol_attn(q, k, v, **kw)
    assert calls == [3] and torch.equal(got, want)
    qg = q.clone().requires_grad_(True)                  # a backward follows: never pipelined
    solattn.sol_attn(qg, k, v, **kw)
    assert calls == [3]


def test_pipeline_groups_only_for_large_cuda_problems(monkeypatch):
    q, k, v = make_qkv(1, 256, 2, 32, dtype=torch.float16, seed=2)
    cpu = validate(q, k, v, topk_ratio=0.3)
    assert pipeline.pipeline_groups(cpu) == 1                     # not a CUDA device
    monkeypatch.setattr(pipeline, "fused_plan_usable", lambda problem: True)

    class OnCuda:                                                 # the size rule, as on a GPU
        device, B, H, n = torch.device("cuda"), 1, 56, 583
    assert pipeline.pipeline_groups(OnCuda) == pipeline.DEFAULT_GROUPS
    OnCuda.H = 2
    assert pipeline.pipeline_groups(OnCuda) == 1                  # 2 * 583 programs: too small
    monkeypatch.setattr(pipeline, "MIN_PROGRAMS", 0)
    assert pipeline.pipeline_groups(OnCuda) == 2                  # at most one group per row
    monkeypatch.setattr(pipeline, "GROUPS", 1)
    assert pipeline.pipeline_groups(OnCuda) == 1


@needs_cuda
@pytest.mark.parametrize("kernel_streams", [1, 2])
@pytest.mark.parametrize("mode", ["topk", "tau_tail"])
def test_cuda_sol_attn_pipelined_equals_unpipelined(mode, kernel_streams, monkeypatch):
    q, k, v = make_qkv(2, 2000, 5, 64, dtype=torch.bfloat16, device="cuda", seed=3)
    kw = dict(topk_ratio=0.2, tail=False) if mode == "topk" else dict(tau=1.0, tail=True)
    with torch.no_grad():
        monkeypatch.setattr(pipeline, "GROUPS", 1)
        want = solattn.sol_attn(q, k, v, backend="triton", **kw)
        monkeypatch.setattr(pipeline, "GROUPS", 4)
        monkeypatch.setattr(pipeline, "MIN_PROGRAMS", 0)
        monkeypatch.setattr(pipeline, "KERNEL_STREAMS", kernel_streams)
        assert pipeline.pipeline_groups(validate(q, k, v, **kw)) == 4
        for _ in range(3):
            got = solattn.sol_attn(q, k, v, backend="triton", **kw)
            assert torch.equal(got, want)
        ref = solattn.sol_attn(q.float(), k.float(), v.float(), backend="sdpa", **kw)
    assert rel_l2(got.float(), ref) < 5e-3


@needs_cuda
def test_cuda_pipelined_call_captured_in_a_graph(monkeypatch):
    from solattn.graphs import cuda_graphs

    monkeypatch.setattr(pipeline, "GROUPS", 3)
    monkeypatch.setattr(pipeline, "MIN_PROGRAMS", 0)
    q, k, v = make_qkv(1, 1500, 3, 64, dtype=torch.bfloat16, device="cuda", seed=5)
    kw = dict(tau=1.0, tail=True, backend="triton")
    with torch.no_grad():
        with cuda_graphs() as cache:
            outs = []
            for _ in range(4):
                q.normal_()
                outs.append((solattn.sol_attn(q, k, v, **kw), q.clone()))
        for got, q_then in outs:
            assert torch.equal(got, solattn.sol_attn(q_then, k, v, **kw))
    s = cache.stats
    assert (s.captures, s.replays, s.failures) == (1, 2, 0)
