"""The reference backend against SPEC.md: a plain float64 per-row loop, and stated properties."""

from __future__ import annotations

import math

import pytest
import torch

import solattn
from solattn.validation import validate
from solattn.backends.reference import reference_forward
from solattn import BLOCK
from solattn.testing import dense_attention, make_qkv, rel_l2, tolerance


def loop_reference(q, k, v, tau=1.0, scale=None, sink_blocks=None, sink_q=None, key_bias=None,
                   topk_ratio=0.0, tail=True, block_len=None, coarse_gate=None):
    """SPEC.md written as plainly as possible: Python loops, float64, one query row at a time.
    key_bias here is a float64 (B, T) tensor (or None)."""
    q, k, v = q.double(), k.double(), v.double()
    B, T, H, D = q.shape
    n = math.ceil(T / BLOCK)
    scale = D ** -0.5 if scale is None else scale
    c = scale * math.log2(math.e)
    L = []
    for j in range(n):
        Lj = BLOCK if block_len is None else min(max(int(block_len[j]), 1), BLOCK)
        if j == n - 1:
            Lj = min(Lj, T - BLOCK * (n - 1))
        L.append(Lj)
    live = lambda j: range(j * BLOCK, j * BLOCK + L[j])  # noqa: E731
    sinks = set(range(*sink_blocks)) & set(range(n)) if sink_blocks else set()
    sinkq = set(range(*sink_q)) & set(range(n)) if sink_q else set()
    out = torch.zeros(B, T, H, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            mean = lambda x, j: sum(x[b, t, h] for t in live(j)) / L[j]  # noqa: E731
            qm = [mean(q, j) for j in range(n)]
            km = [mean(k, j) for j in range(n)]
            vm = [mean(v, j) for j in range(n)]
            m = sum(km) / n
            R = [[c * float(qm[i] @ (km[j] - m)) for j in range(n)] for i in range(n)]
            E = []
            for i in range(n):
                Ei = set()
                if topk_ratio == 0:
                    var = sum((km[j] - m) ** 2 for j in range(n)) / n
                    thr = tau * math.sqrt(c * c * float((qm[i] ** 2 * var).sum()) + 1e-6)
                    Ei = {j for j in range(n) if R[i][j] > thr}
                else:
                    cand = [j for j in range(n) if j not in sinks]
                    n_eff = len(cand)
                    kk = 0 if n_eff <= 1 else min(max(round(topk_ratio * n_eff), 1), n_eff - 1)
                    if kk > 0:
                        theta = sorted((R[i][j] for j in cand), reverse=True)[kk - 1]
                        Ei = {j for j in cand if R[i][j] >= theta}
                Ei |= {j for j in range(n) if abs(i - j) <= 1} | sinks
                if i in sinkq:
                    Ei = set(range(n))
                E.append(Ei)
            for t in range(T):
                i = t // BLOCK
                logits, values = [], []
                for j in sorted(E[i]):
                    for u in live(j):
                        bias = 0.0 if key_bias is None else float(key_bias[b if key_bias.shape[0] > 1 else 0, u])
                        logits.append(scale * float(q[b, t, h] @ (k[b, u, h] - m)) + bias)
                        values.append(v[b, u, h])
                if tail:
                    for j in range(n):
                        if j not in E[i]:
                            logits.append(scale * float(qm[i] @ (km[j] - m)) + math.log(L[j]))
                            values.append(vm[j])
                mx = max(logits) if logits else -math.inf
                if mx == -math.inf:
                    o = torch.zeros(D, dtype=torch.float64)
                else:
                    w = [math.exp(x - mx) for x in logits]
                    o = sum(wi * vi for wi, vi in zip(w, values)) / sum(w)
                if coarse_gate is not None:
                    s = [scale * float(qm[i] @ km[j]) for j in range(n)]
                    ms = max(s)
                    a = [math.exp(x - ms) for x in s]
                    o = o + coarse_gate[b, t, h].double() * (sum(ai * vj for ai, vj in zip(a, vm)) / sum(a))
                out[b, t, h] = o
    return out


def ref(q, k, v, **kw):
    return solattn.sol_attn(q, k, v, backend="reference", **kw)


LOOP_CASES = [
    dict(topk_ratio=0.5),
    dict(topk_ratio=0.3, tail=False),
    dict(tau=0.3),
    dict(tau=-0.5, tail=False),
    dict(tau=0.0, sink_blocks=(3, 3 + 1), sink_q=(0, 1)),
    dict(topk_ratio=0.4, sink_blocks=(0, 1)),
    dict(topk_ratio=0.4, scale=0.3),
]


@pytest.mark.parametrize("kw", LOOP_CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
@pytest.mark.parametrize("T", [1, 40, 64, 65, pytest.param(260, marks=pytest.mark.slow)])
def test_reference_matches_plain_loop(kw, T):
    q, k, v = make_qkv(1, T, 2, 8, seed=T)
    got = ref(q, k, v, **kw)
    want = loop_reference(q, k, v, **kw)
    assert rel_l2(got, want) < tolerance(torch.float32)


@pytest.mark.slow
def test_reference_loop_block_len_bias_gate():
    T, D = 200, 8
    q, k, v = make_qkv(2, T, 2, D, seed=3)
    g = torch.Generator().manual_seed(5)
    bl = torch.tensor([64, 10, 0, 33], dtype=torch.int32)
    bias = torch.randn(2, T, generator=g)
    gate = torch.randn(2, T, 2, D, generator=g)
    for kw in (dict(topk_ratio=0.4), dict(tau=0.2)):
        got = ref(q, k, v, block_len=bl, key_bias=bias, coarse_gate=gate, **kw)
        want = loop_reference(q, k, v, block_len=bl, key_bias=bias.double(), coarse_gate=gate, **kw)
        live = torch.zeros(T, dtype=torch.bool)
        for j, L in enumerate([64, 10, 1, 8]):   # 0 -> 1, last block capped at T - 192 = 8
            live[j * 64:j * 64 + L] = True
        assert rel_l2(got[:, live], want[:, live]) < tolerance(torch.float32)


@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_blocks_exact_equals_dense_attention(tail, dtype):
    q, k, v = make_qkv(2, 200, 3, 16, dtype=dtype)
    got = ref(q, k, v, tau=-1e9, tail=tail)
    want = dense_attention(q, k, v)
    assert rel_l2(got, want) < tolerance(dtype)
    assert got.dtype == dtype and got.is_contiguous()


def _tied_scores_inputs():
    """q, k whose routing scores tie on purpose: keys of blocks 3..6 share one block mean."""
    T, D = 10 * BLOCK, 4
    q = torch.zeros(1, T, 1, D)
    k = torch.zeros(1, T, 1, D)
    q[..., 0] = 1.0                              # every query points along e0
    levels = [0.0, 0.1, 0.2, 5.0, 5.0, 5.0, 5.0, 0.3, 0.4, 0.5]
    for j, lv in enumerate(levels):
        k[0, j * BLOCK:(j + 1) * BLOCK, 0, 0] = lv
    v = torch.randn(1, T, 1, D, generator=torch.Generator().manual_seed(0))
    return q, k, v


def test_topk_ties_keep_whole_group():
    q, k, v = _tied_scores_inputs()
    p = validate(q, k, v, topk_ratio=0.2, tail=False)   # kk = round(0.2 * 10) = 2
    # the tied group of 4 blocks (3..6) all score highest: kk = 2 must keep all four
    from solattn.backends import reference as refmod
    out = refmod.reference_forward(p)
    # query block 0 attends exactly {0, 1} (neighbours) + {3, 4, 5, 6} (tie group)
    keys = [0, 1, 3, 4, 5, 6]
    tok = torch.cat([torch.arange(j * BLOCK, (j + 1) * BLOCK) for j in keys])
    want = dense_attention(q[:, :BLOCK], k[:, tok], v[:, tok])
    assert rel_l2(out[:, :BLOCK], want) < 1e-6


def test_topk_budget_excludes_sinks_and_rounds_half_to_even():
    q, k, v = _tied_scores_inputs()
    # n = 10; sinks [8, 10) leave n_eff = 8; 0.3125 * 8 = 2.5 -> round half to even = 2
    a = ref(q, k, v, topk_ratio=0.3125, sink_blocks=(8, 10), tail=False)
    # with kk = 2 the tie group 3..6 is kept whole; with kk = 3 (a round-half-up bug) it would be too,
    # so probe with distinct scores instead
    T, D = 10 * BLOCK, 4
    q2 = torch.zeros(1, T, 1, D)
    q2[..., 0] = 1
    k2 = torch.zeros(1, T, 1, D)
    for j, lv in enumerate([0.0, 0.1, 0.2, 9.0, 8.0, 7.0, 6.0, 0.3, 0.4, 0.5]):
        k2[0, j * BLOCK:(j + 1) * BLOCK, 0, 0] = lv
    out = ref(q2, k2, v, topk_ratio=0.3125, sink_blocks=(8, 10), tail=False)
    keys = [0, 1, 3, 4, 8, 9]                       # neighbours, top-2 (3, 4), sinks
    tok = torch.cat([torch.arange(j * BLOCK, (j + 1) * BLOCK) for j in keys])
    assert rel_l2(out[:, :BLOCK], dense_attention(q2[:, :BLOCK], k2[:, tok], v[:, tok])) < 1e-6
    # 0.375 * 8 = 3.0 -> 3 blocks: 3, 4, 5
    out3 = ref(q2, k2, v, topk_ratio=0.375, sink_blocks=(8, 10), tail=False)
    tok3 = torch.cat([torch.arange(j * BLOCK, (j + 1) * BLOCK) for j in [0, 1, 3, 4, 5, 8, 9]])
    assert rel_l2(out3[:, :BLOCK], dense_attention(q2[:, :BLOCK], k2[:, tok3], v[:, tok3])) < 1e-6
    assert torch.isfinite(a).all()


def test_kk_zero_selects_only_forced_blocks():
    # n = 4, sinks [0, 3): n_eff = 1 -> kk = 0 whatever topk_ratio says. Query block 0 then attends
    # exactly its neighbours {0, 1} and the sinks {0, 1, 2}; block 3 is not selected by score.
    q, k, v = make_qkv(1, 4 * BLOCK, 1, 8)
    k[:, 3 * BLOCK:] = q[:, :BLOCK].mean(1, keepdim=True) * 10   # block 3 would win any top-k for row 0
    out = ref(q, k, v, topk_ratio=0.9, sink_blocks=(0, 3), tail=False)
    want = dense_attention(q[:, :BLOCK], k[:, :3 * BLOCK], v[:, :3 * BLOCK])
    assert rel_l2(out[:, :BLOCK], want) < 1e-6
    # query block 3 gets {2, 3} + sinks: everything
    assert rel_l2(out[:, 3 * BLOCK:], dense_attention(q, k, v)[:, 3 * BLOCK:]) < 1e-6
    # n = 1: n_eff = 1 -> kk = 0, the diagonal alone is exact
    q1, k1, v1 = make_qkv(1, 30, 1, 8)
    assert rel_l2(ref(q1, k1, v1, topk_ratio=0.5, tail=True), dense_attention(q1, k1, v1)) < 1e-6


def test_dead_rows_do_not_change_live_outputs_and_nonpositive_block_len_is_one():
    T = 3 * BLOCK
    q, k, v = make_qkv(1, T, 2, 8, seed=7)
    bl = torch.tensor([20, 64, 5], dtype=torch.int32)
    base = ref(q, k, v, topk_ratio=0.5, block_len=bl)
    live = torch.zeros(T, dtype=torch.bool)
    live[:20] = True
    live[64:128] = True
    live[128:133] = True
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for x in (q2, k2, v2):
        x[:, ~live] = torch.randn_like(x[:, ~live]) * 100
    other = ref(q2, k2, v2, topk_ratio=0.5, block_len=bl)
    assert torch.equal(base[:, live], other[:, live])
    assert torch.isfinite(other).all()
    one = ref(q, k, v, tau=0.1, block_len=torch.tensor([1, 64, 64], dtype=torch.int32))
    for bad in (0, -5):
        x = ref(q, k, v, tau=0.1, block_len=torch.tensor([bad, 64, 64], dtype=torch.int32))
        assert torch.equal(x, one)


def test_batch_equals_each_batch_alone():
    q, k, v = make_qkv(3, 150, 2, 8, seed=2)
    bias = torch.randn(3, 150)
    full = ref(q, k, v, topk_ratio=0.5, key_bias=bias)
    for b in range(3):
        alone = ref(q[b:b + 1], k[b:b + 1], v[b:b + 1], topk_ratio=0.5, key_bias=bias[b:b + 1])
        assert rel_l2(full[b:b + 1], alone) < 1e-6


def test_strided_permuted_sliced_inputs():
    q, k, v = make_qkv(2, 130, 3, 8, seed=4)
    want = ref(q, k, v, tau=0.2)
    # BHTD storage transposed to BTHD
    qp, kp, vp = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    assert not qp.is_contiguous()
    assert torch.equal(ref(qp, kp, vp, tau=0.2), want)
    # sliced out of a larger head dim, and every other batch
    big = [torch.cat([x, torch.randn_like(x)], dim=-1)[..., :8] for x in (q, k, v)]
    assert torch.equal(ref(*big, tau=0.2), want)
    wide = [torch.stack([x, torch.randn_like(x)], dim=1).flatten(0, 1)[::2] for x in (q, k, v)]
    assert torch.equal(ref(*wide, tau=0.2), want)


def test_key_bias_forms_agree_and_all_masked_rows_are_zero():
    B, T, H, D = 2, 150, 2, 8
    q, k, v = make_qkv(B, T, H, D, seed=8)
    keep = torch.rand(T, generator=torch.Generator().manual_seed(1)) > 0.3
    f = torch.where(keep, 0.0, -math.inf)
    outs = [ref(q, k, v, topk_ratio=0.5, key_bias=kb) for kb in
            (keep, f, f[None].expand(B, T).clone(), f[None], f.view(1, 1, 1, T),
             f.view(1, 1, 1, T).expand(B, 1, 1, T).clone(), keep.view(1, 1, 1, T))]
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    # all keys of the exact set masked, tail off -> 0 (not NaN)
    none = torch.zeros(T, dtype=torch.bool)
    z = ref(q, k, v, tau=0.0, tail=False, key_bias=none)
    assert torch.equal(z, torch.zeros_like(z))
    # with the tail on, rows keep the pooled terms: finite and non-zero
    zt = ref(q, k, v, topk_ratio=0.3, tail=True, key_bias=none)
    assert torch.isfinite(zt).all()


def test_sink_q_rows_equal_dense():
    q, k, v = make_qkv(1, 5 * BLOCK, 2, 8, seed=9)
    out = ref(q, k, v, topk_ratio=0.2, sink_q=(1, 3))
    want = dense_attention(q, k, v)
    assert rel_l2(out[:, BLOCK:3 * BLOCK], want[:, BLOCK:3 * BLOCK]) < 1e-6
    assert rel_l2(out, want) > 1e-3   # the other rows are sparse


def test_coarse_branch_equals_plain_per_block_loop():
    B, T, H, D = 1, 3 * BLOCK + 10, 2, 8
    q, k, v = make_qkv(B, T, H, D, seed=11)
    gate = torch.randn(B, T, H, D)
    base = ref(q, k, v, topk_ratio=0.5)
    out = ref(q, k, v, topk_ratio=0.5, coarse_gate=gate)
    n = 4
    sizes = [64, 64, 64, 10]
    for b in range(B):
        for h in range(H):
            mean = lambda x, j: x[b, j * 64:j * 64 + sizes[j], h].double().mean(0)  # noqa: E731
            qm = [mean(q, j) for j in range(n)]
            km = [mean(k, j) for j in range(n)]
            vm = [mean(v, j) for j in range(n)]
            for i in range(n):
                s = torch.stack([q.new_tensor(0).double() + (qm[i] @ km[j]) * D ** -0.5 for j in range(n)])
                coarse = (torch.softmax(s, 0)[:, None] * torch.stack(vm)).sum(0)
                rows = slice(i * 64, i * 64 + sizes[i])
                want = base[b, rows, h].double() + gate[b, rows, h].double() * coarse
                assert rel_l2(out[b, rows, h], want) < 1e-5


def test_shift_invariance_of_keys():
    q, k, v = make_qkv(1, 200, 2, 8, seed=12)
    shift = torch.randn(8) * 3
    a = ref(q, k, v, tau=0.3)
    b = ref(q, k + shift, v, tau=0.3)
    assert rel_l2(b, a) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes_and_token_aug_has_no_effect(dtype):
    q, k, v = make_qkv(1, 130, 2, 16, dtype=dtype, seed=13)
    a = ref(q, k, v, topk_ratio=0.5)
    assert a.dtype == dtype and a.shape == q.shape and a.is_contiguous()
    want = loop_reference(q, k, v, topk_ratio=0.5)
    assert rel_l2(a, want) < tolerance(dtype)
    for aug in (64, 128, 192, 256):
        assert torch.equal(ref(q, k, v, topk_ratio=0.5, token_aug=aug), a)


def test_reference_refuses_over_budget_naming_memory_and_alternatives(monkeypatch):
    from solattn.backends import reference as refmod
    monkeypatch.setattr(refmod.budget, "_value", 1 << 20)
    q, k, v = make_qkv(1, 1024, 2, 8)
    with pytest.raises(solattn.BackendError) as ei:
        solattn.sol_attn(q, k, v, backend="reference")
    msg = str(ei.value)
    assert "GiB" in msg and "reference" in msg and "sdpa" in msg
    p = validate(q, k, v)
    assert reference_forward(p).shape == q.shape   # the guard lives in dispatch, not in the math


@pytest.mark.parametrize("kw, spoiled, selection_moves", [
    # with the tail: qm_i is NaN, so row i of R and every pooled logit p_j of query block i are
    # NaN; the block's other rows keep finite exact terms but add NaN pooled ones (the score-based
    # selection compares NaN, which keeps nothing, so non-neighbour blocks stay pooled)
    (dict(topk_ratio=0.3, tail=True), "block", True),
    (dict(tau=0.5, tail=True), "block", True),
    # without the tail only the token's own exact logits carry the NaN; the block's other rows
    # stay finite but lose their score-selected blocks (R[i, .] is NaN), so they may change
    (dict(topk_ratio=0.3, tail=False), "token", True),
    # a coarse gate spreads it over the block through a_i = softmax(qm_i . km_j)
    (dict(topk_ratio=0.3, tail=False, coarse_gate="gate"), "block", True),
    # every block exact for query block i (sink_q): no pooled term, no selection to lose
    (dict(topk_ratio=0.3, tail=True, sink_q=(3, 4)), "token", False),
])
def test_nan_in_one_query_token_spoils_only_what_depends_on_it(kw, spoiled, selection_moves):
    B, n, H, D = 2, 10, 2, 8
    T = n * BLOCK
    q, k, v = make_qkv(B, T, H, D, seed=21)
    if kw.get("coarse_gate") == "gate":
        kw = dict(kw, coarse_gate=torch.randn(B, T, H, D, generator=torch.Generator().manual_seed(3)))
    b, i, t, h = 1, 3, 3 * BLOCK + 17, 0
    clean = ref(q, k, v, **kw)
    q_nan = q.clone()
    q_nan[b, t, h, 2] = float("nan")
    out = ref(q_nan, k, v, **kw)
    block_rows = torch.zeros(B, T, H, dtype=torch.bool)
    block_rows[b, i * BLOCK:(i + 1) * BLOCK, h] = True
    token_row = torch.zeros(B, T, H, dtype=torch.bool)
    token_row[b, t, h] = True
    expect_bad = block_rows if spoiled == "block" else token_row
    bad = ~torch.isfinite(out).all(dim=-1)
    assert torch.equal(bad, expect_bad), f"non-finite rows: {bad.nonzero().tolist()[:8]}..."
    assert (~torch.isfinite(out[expect_bad])).all()        # every element of a spoiled row
    may_change = block_rows if selection_moves else token_row
    assert torch.equal(out[~may_change], clean[~may_change])
