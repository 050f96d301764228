"""The Plan as an object: what it knows about itself, what it keeps, and its FlexAttention form."""

from __future__ import annotations

import pytest
import torch

import solattn
from solattn import routing
from solattn.testing import make_qkv, rel_l2, triton_interpretable
from solattn.validation import validate


def _plan(T=300, B=2, H=3, D=16, seed=0, **kw):
    q, k, v = make_qkv(B, T, H, D, seed=seed)
    problem = validate(q, k, v, **kw)
    return problem, routing.build_plan(problem)


def test_plan_knows_its_sizes():
    problem, plan = _plan(T=300, topk_ratio=0.3)
    assert (plan.batch, plan.heads, plan.seq_len, plan.head_dim) == (2, 3, 300, 16)
    assert (plan.selection().batch, plan.selection().heads) == (2, 3)
    assert plan.block_size == solattn.BLOCK == 64 and plan.n == 5 == -(-300 // plan.block_size)
    assert plan.device == problem.device


def test_query_lists_are_derived_once():
    """The transposed lists (the fused backward's key-block walk) cost work worth keeping (a host
    sync for the width of a plan narrower than n; a kernel, or a dozen torch ops, for an n-wide
    one): a plan builds them on the first request and hands out the same tensors afterwards."""
    _, plan = _plan(topk_ratio=0.4)
    q_num, q_idx = plan.query_lists()
    again = plan.query_lists()
    assert again[0] is q_num and again[1] is q_idx
    mask = plan.dense_mask()
    assert torch.equal(q_num, mask.sum(dim=2, dtype=torch.int32))
    for b, h, j in [(0, 0, 0), (1, 2, 3), (1, 1, 4)]:
        c = int(q_num[b, h, j])
        assert q_idx[b, h, j, :c].tolist() == torch.nonzero(mask[b, h, :, j]).squeeze(1).tolist()


@pytest.mark.parametrize("kw", [dict(topk_ratio=0.3), dict(tau=0.5, sink_blocks=(0, 1)),
                                dict(topk_ratio=0.2, sink_q=(1, 2), block_len=True)])
def test_block_mask_matches_create_block_mask(kw):
    """``to_block_mask()`` selects what ``create_block_mask`` makes of the same rule written as a
    ``mask_mod`` (selected block and live key): the same blocks, and the same tokens within them."""
    from torch.nn.attention.flex_attention import create_block_mask
    T = 300
    if kw.pop("block_len", False):
        kw["block_len"] = torch.tensor([64, 40, 64, 17, 44], dtype=torch.int32)
    problem, plan = _plan(T=T, **kw)
    dense, live = plan.dense_mask(), plan.block_len

    def rule(b, h, q_idx, kv_idx):
        return dense[b, h, q_idx // 64, kv_idx // 64] & (kv_idx % 64 < live[kv_idx // 64])

    want = create_block_mask(rule, plan.batch, plan.heads, T, T, device="cpu", BLOCK_SIZE=64)
    got = plan.to_block_mask()
    assert got.BLOCK_SIZE == (64, 64) and got.seq_lengths == (T, T)
    # create_block_mask files each block as full or partial, to_block_mask lists every one as
    # partial (the mask_mod decides): the union is the block-level selection
    assert torch.equal(got.to_dense().bool(), want.to_dense().bool())
    tok = torch.arange(T)
    for bi, hi in [(0, 0), (1, 2)]:
        token_got = got.mask_mod(torch.tensor(bi), torch.tensor(hi), tok[:, None], tok[None, :])
        token_want = rule(torch.tensor(bi), torch.tensor(hi), tok[:, None], tok[None, :])
        assert torch.equal(token_got & dense[bi, hi].repeat_interleave(64, 0)[:T].repeat_interleave(64, 1)[:, :T],
                           token_want)


def test_block_mask_with_tail_slots_adds_one_slot_per_query_block():
    """``to_block_mask(tail_slots=True)``: keys are the n blocks then ``ceil(n / 64)`` blocks of
    slots; query token t sees the exact rule's keys and slot ``n * 64 + t // 64``, nothing else."""
    T = 300
    problem, plan = _plan(T=T, topk_ratio=0.4, block_len=torch.tensor([64, 40, 64, 17, 44], dtype=torch.int32))
    n, keys = plan.n, (plan.n + 1) * 64
    exact, got = plan.to_block_mask(), plan.to_block_mask(tail_slots=True)
    assert got.seq_lengths == (T, keys) and got.BLOCK_SIZE == (64, 64)
    own = torch.zeros(n, 1, dtype=torch.bool)
    own[:, 0] = True                                             # n < 64: every slot in key block n
    blocks = torch.cat([plan.dense_mask(), own.expand(plan.batch, plan.heads, n, 1)], dim=-1)
    assert torch.equal(got.to_dense().bool(), blocks)
    tq, tk = torch.arange(T)[:, None], torch.arange(keys)[None, :]
    slot = tk - n * 64 == tq // 64
    for bi, hi in [(0, 0), (1, 2)]:
        b, h = torch.tensor(bi), torch.tensor(hi)
        token_got = got.mask_mod(b, h, tq, tk)
        assert torch.equal(token_got[:, :T], exact.mask_mod(b, h, tq, tk[:, :T]))
        assert not token_got[:, T:n * 64].any()                  # rows past T are dead
        assert torch.equal(token_got[:, n * 64:], slot[:, n * 64:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_attention_with_the_block_mask_is_sol_attn_without_tail(dtype):
    """``flex_attention`` (eager) with the plan's BlockMask computes ``sol_attn``'s exact branch:
    the reference backend's output with ``tail=False``."""
    from torch.nn.attention.flex_attention import flex_attention
    q, k, v = make_qkv(1, 200, 2, 32, dtype=dtype, seed=4)
    bl = torch.tensor([64, 50, 64, 8], dtype=torch.int32)
    problem = validate(q, k, v, topk_ratio=0.4, tail=False, block_len=bl)
    plan = routing.build_plan(problem)
    want = solattn.sol_attn(q, k, v, topk_ratio=0.4, tail=False, block_len=bl, backend="reference")
    got = flex_attention(*(t.transpose(1, 2) for t in (q, k, v)), block_mask=plan.to_block_mask(),
                         scale=problem.scale).transpose(1, 2)
    live = routing.live_token_mask(plan.block_len).reshape(-1)[:200]  # dead query rows: unspecified
    assert rel_l2(got[:, live].float(), want[:, live].float()) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_a_plan_for_another_call_is_refused():
    """Only the selection's shape, device and block size must fit: a call with or without tail or
    gate takes it (they do not change a selection)."""
    problem, plan = _plan(T=300, topk_ratio=0.3)
    def check(p, plan):
        return routing.check_plan("sol_attn", plan, p.B, p.H, p.T, p.device)

    got = check(problem, plan)
    assert type(got) is routing.Plan and got.kv_indices is plan.kv_indices and not hasattr(got, "tail_lse")
    q, k, v = make_qkv(2, 300, 3, 16, seed=1)
    for fits in (validate(q, k, v, topk_ratio=0.3, tail=False), validate(q, k, v, topk_ratio=0.3, coarse_gate=q)):
        assert check(fits, plan).kv_indices is plan.kv_indices
    cases = [
        (validate(q[:, :200], k[:, :200], v[:, :200], topk_ratio=0.3), r"B=2 H=3 T=300, .*allowed: .*T=200"),
        (validate(q[:1], k[:1], v[:1], topk_ratio=0.3), r"B=2 .*allowed: .*B=1 "),
        (validate(*(t.to("meta") for t in (q, k, v)), topk_ratio=0.3), r".*on cpu.*allowed: .*on meta"),
    ]
    for other, pattern in cases:
        with pytest.raises(ValueError, match=r"sol_attn: argument 'plan' received a selection of " + pattern):
            check(other, plan)
    with pytest.raises(TypeError, match=r"argument 'plan' received Tensor; allowed: None or a solattn Plan"):
        check(problem, plan.kv_indices)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (compiled flex_attention)")
def test_compiled_flex_attention_with_the_block_mask_on_cuda():
    """The full/partial split of ``to_block_mask()`` is what a compiled flex kernel reads (the
    mask_mod runs in partial blocks only): it must give ``sol_attn``'s exact branch too. The
    kernel's tiles divide the 64 x 64 blocks (torch's defaults on recent GPUs are 128 rows)."""
    from torch.nn.attention.flex_attention import flex_attention
    from solattn.backends.flex.kernel import CUDA_KERNEL_OPTIONS
    q, k, v = make_qkv(2, 1000, 4, 64, dtype=torch.bfloat16, device="cuda", seed=5)
    bl = torch.full((16,), 64, dtype=torch.int32, device="cuda")
    bl[3], bl[9] = 20, 1
    problem = validate(q, k, v, topk_ratio=0.3, tail=False, block_len=bl)
    plan = routing.build_plan(problem)
    want = solattn.sol_attn(q, k, v, topk_ratio=0.3, tail=False, block_len=bl, backend="reference")
    flex = torch.compile(flex_attention, dynamic=False)
    got = flex(*(t.transpose(1, 2) for t in (q, k, v)), block_mask=plan.to_block_mask(),
               scale=problem.scale, kernel_options=dict(CUDA_KERNEL_OPTIONS)).transpose(1, 2)
    live = routing.live_token_mask(plan.block_len).reshape(-1)[:1000]
    assert rel_l2(got[:, live].float(), want[:, live].float()) < 1e-2


def test_query_lists_of_an_n_wide_plan_need_no_host_sync():
    """The fused plan's lists are n wide so that no count reaches the host; its transposed lists
    are n wide too, with the same entries as the compact ones."""
    import dataclasses
    _, plan = _plan(topk_ratio=0.4)
    n = plan.n
    wide = dataclasses.replace(plan, kv_indices=torch.nn.functional.pad(plan.kv_indices, (0, n - plan.kv_indices.shape[-1])))
    q_num, q_idx = wide.query_lists()
    c_num, c_idx = plan.query_lists()
    assert q_idx.shape[-1] == n and torch.equal(q_num, c_num)
    assert torch.equal(q_idx[..., :c_idx.shape[-1]], c_idx) and not q_idx[..., c_idx.shape[-1]:].any()


# ----------------------------------------------------------------------------- built once, passed back in

def test_a_call_on_its_own_plan_gives_the_same_output():
    q, k, v = make_qkv(2, 300, 2, 32, seed=6)
    gate = torch.rand(q.shape, generator=torch.Generator().manual_seed(7))
    bias = torch.randn(2, 300, generator=torch.Generator().manual_seed(8))
    for kw in (dict(topk_ratio=0.3), dict(tau=0.5, coarse_gate=gate, key_bias=bias, sink_blocks=(0, 1))):
        p = solattn.plan(q, k, v, **kw)
        assert p.seq_len == 300 and p.block_size == 64
        assert torch.equal(solattn.sol_attn(q, k, v, **kw, plan=p), solattn.sol_attn(q, k, v, **kw))


def test_gradients_on_a_given_plan():
    """A given plan's selection is a constant of the call; the call's own terms are not: with or
    without pooled terms the gradients are those of the call that builds its own plan (whose
    selection is constant too)."""
    q, k, v = make_qkv(1, 200, 2, 32, seed=9)
    gate = torch.rand(q.shape, generator=torch.Generator().manual_seed(14))
    for kw in (dict(topk_ratio=0.4, tail=False), dict(topk_ratio=0.4, coarse_gate=gate)):
        p = solattn.plan(q, k, v, **kw)
        grads = []
        for plan in (p, None):
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
            solattn.sol_attn(*leaves, **kw, plan=plan).square().sum().backward()
            grads.append([t.grad for t in leaves])
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b)


def test_a_plan_that_does_not_fit_the_call_is_refused():
    q, k, v = make_qkv(1, 200, 2, 32, seed=10)
    p = solattn.plan(q, k, v, topk_ratio=0.3)
    with pytest.raises(ValueError, match=r"sol_attn: argument 'plan' received a selection of .*T=200.*allowed: "
                                         r".*T=136"):
        solattn.sol_attn(q[:, :136], k[:, :136], v[:, :136], topk_ratio=0.3, plan=p)
    with pytest.raises(TypeError, match=r"argument 'plan' received dict"):
        solattn.sol_attn(q, k, v, topk_ratio=0.3, plan={})
    # the reference backend routes by itself: it cannot run a given plan
    with pytest.raises(solattn.BackendError, match="does not consume a routing plan"):
        solattn.sol_attn(q, k, v, topk_ratio=0.3, plan=p, backend="reference")


def test_video_sparse_attn_on_its_own_plan():
    grid, P = (4, 8, 8), 70
    q, k, v = make_qkv(1, P + 256, 2, 64, seed=11)
    gate = torch.rand(q.shape, generator=torch.Generator().manual_seed(12))
    kw = dict(sparsity=0.75, gate=gate, prefix_len=P)
    p = solattn.video_plan(q, k, v, grid, **kw)
    assert p.seq_len == 128 + 256 and not hasattr(p, "coarse")   # tiled rows; a selection only
    assert torch.equal(solattn.video_sparse_attn(q, k, v, grid, **kw, plan=p),
                       solattn.video_sparse_attn(q, k, v, grid, **kw))
    # the selection serves a call without a gate too
    assert torch.equal(solattn.video_sparse_attn(q, k, v, grid, sparsity=0.75, prefix_len=P, plan=p),
                       solattn.video_sparse_attn(q, k, v, grid, sparsity=0.75, prefix_len=P))


@pytest.mark.skipif(not triton_interpretable(), reason="needs Triton >= 3.9 for its CPU interpreter")
def test_the_triton_backend_runs_its_own_fused_plan(monkeypatch):
    """On the triton backend the plan is the fused one (n wide); passed back in, the same output."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = make_qkv(1, 200, 2, 32, dtype=torch.float16, seed=13)
    p = solattn.plan(q, k, v, topk_ratio=0.4, backend="triton")
    assert p.kv_indices.shape[-1] == p.n
    assert torch.equal(solattn.sol_attn(q, k, v, topk_ratio=0.4, backend="triton", plan=p),
                       solattn.sol_attn(q, k, v, topk_ratio=0.4, backend="triton"))
