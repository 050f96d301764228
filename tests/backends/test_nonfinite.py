"""Extreme and non-finite inputs give the same answer on every backend, the one SPEC.md defines.

- a finite ``key_bias`` entry beyond ±1e30 acts as ±1e30 (an fp64 1e300 included);
- a NaN query token gives NaN exactly in the rows SPEC.md's "Non-finite inputs" names.

Each property runs on every backend that runs on the CPU: ``sdpa``, ``reference``, ``flex``
(which compiles, tens of seconds per shape on a small CPU: in the default run only where the
fix is flex's own) and ``triton`` in Triton's interpreter (slow, out of the default run).
"""

from __future__ import annotations

import pytest
import torch

import solattn
from solattn import testing
from tests.support.cpu_backends import cpu_context

BACKENDS = [pytest.param("sdpa", id="sdpa"), pytest.param("reference", id="reference"),
            pytest.param("flex", id="flex", marks=pytest.mark.slow),
            pytest.param("triton", id="triton-interpreted", marks=pytest.mark.slow)]
#: the same, with flex in the default run (for the properties whose fix is flex's own)
BACKENDS_FLEX_DEFAULT = BACKENDS[:2] + [pytest.param("flex", id="flex")] + BACKENDS[3:]

#: the one shape of this module (flex compiles once per shape, dtype and features)
B, T, H, D = 1, 200, 2, 16


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_huge_finite_key_bias_acts_as_1e30(backend):
    """fp64 entries of ±1e300 give the output of ±1e30 entries (finite), on every backend."""
    scope, dtype = cpu_context(backend)
    q, k, v = testing.make_qkv(B, T, H, D, dtype=dtype, seed=11)
    g = torch.Generator().manual_seed(12)
    base = torch.randn(T, generator=g, dtype=torch.float64)
    big, clamped = base.clone(), base.clone()
    big[[3, 90]], clamped[[3, 90]] = 1e300, 1e30
    big[[7, 150]], clamped[[7, 150]] = -1e300, -1e30
    kw = dict(topk_ratio=0.5)
    with scope:
        got = solattn.sol_attn(q, k, v, key_bias=big, backend=backend, **kw)
        want = solattn.sol_attn(q, k, v, key_bias=clamped.float(), backend=backend, **kw)
    assert torch.isfinite(got).all(), f"{int((~torch.isfinite(got)).sum())} non-finite entries"
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    ref = solattn.sol_attn(q.float(), k.float(), v.float(), key_bias=clamped.float(), backend="reference", **kw)
    assert testing.rel_l2(got, ref) < testing.tolerance(dtype)


#: where the NaN goes: batch 0, token 70 (query block 1, a live row), head 1
NAN_AT = (0, 70, 1)


def _expected(T: int, rows=(), blocks=()) -> torch.Tensor:
    """``(B, T, H)`` bool: NaN exactly in ``rows`` ((b, t, h)) and in every row of ``blocks``
    ((b, first token, last token + 1, h))."""
    want = torch.zeros(B, T, H, dtype=torch.bool)
    for b, t, h in rows:
        want[b, t, h] = True
    for b, t0, t1, h in blocks:
        want[b, t0:t1, h] = True
    return want


_b, _t, _h = NAN_AT
ROW = dict(rows=[NAN_AT])
BLOCK_1 = dict(blocks=[(_b, 64, 128, _h)])
#: SPEC.md "Non-finite inputs": the row alone, or the whole query block when it has a pooled term
NAN_CASES = {
    "no-tail": (dict(topk_ratio=0.4, tail=False), ROW),
    "tail-topk": (dict(topk_ratio=0.4), BLOCK_1),
    "tail-tau": (dict(tau=1.0), BLOCK_1),
    "tail-empty": (dict(topk_ratio=0.4, sink_q=(1, 2)), ROW),      # block 1 attends every block exactly
    "gate": (dict(topk_ratio=0.4, tail=False, coarse_gate=True), BLOCK_1),
}


@pytest.mark.parametrize("case", list(NAN_CASES))
@pytest.mark.parametrize("backend", BACKENDS_FLEX_DEFAULT)
def test_a_nan_query_token_gives_nan_exactly_where_spec_says(backend, case):
    """One NaN in a live query row: NaN in that row, and in every row of its query block when the
    block has a pooled term (its block mean is NaN, so are its pooled logits and coarse weights);
    every other row finite and equal to the reference's. flex returned 0.0 for the row without
    the tail and made every row of the (batch, head) NaN with it."""
    scope, dtype = cpu_context(backend)
    kw, where = NAN_CASES[case]
    q, k, v = testing.make_qkv(B, T, H, D, dtype=dtype, seed=13)
    q[NAN_AT[0], NAN_AT[1], NAN_AT[2], 5] = float("nan")
    if kw.get("coarse_gate"):
        kw = dict(kw, coarse_gate=torch.randn(q.shape, generator=torch.Generator().manual_seed(14)).to(dtype))
    with scope:
        got = solattn.sol_attn(q, k, v, backend=backend, **kw)
    want_nan = _expected(T, **where)
    nan = torch.isnan(got).any(-1)
    assert torch.equal(nan, want_nan), (f"NaN rows {nan.nonzero().tolist()[:8]}... ({int(nan.sum())}), "
                                        f"expected {int(want_nan.sum())}")
    ref = solattn.sol_attn(q.float(), k.float(), v.float(), backend="reference",
                           **{a: (x.float() if isinstance(x, torch.Tensor) else x) for a, x in kw.items()})
    assert torch.isfinite(got[~want_nan]).all()
    assert testing.rel_l2(got[~want_nan], ref[~want_nan]) < testing.tolerance(dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nan_in_a_dead_query_row_changes_nothing(backend):
    """Dead rows never enter a mean (SPEC.md): a NaN there leaves every output finite and the
    live rows equal to those without it."""
    scope, dtype = cpu_context(backend)
    q, k, v = testing.make_qkv(B, T, H, D, dtype=dtype, seed=15)
    bl = torch.tensor([64, 5, 64, 8], dtype=torch.int32)
    poisoned = q.clone()
    poisoned[0, 64 + 20, 1, 3] = float("nan")
    with scope:
        got = solattn.sol_attn(poisoned, k, v, block_len=bl, topk_ratio=0.4, backend=backend)
        clean = solattn.sol_attn(q, k, v, block_len=bl, topk_ratio=0.4, backend=backend)
    live = testing.live_rows(T, bl)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[:, live], clean[:, live], rtol=0, atol=0)


VSA_BACKENDS = [pytest.param("sdpa", id="sdpa"), pytest.param("flex", id="flex", marks=pytest.mark.slow),
                pytest.param("triton", id="triton-interpreted", marks=pytest.mark.slow)]


@pytest.mark.parametrize("gate", [False, True], ids=["no-gate", "gate"])
@pytest.mark.parametrize("backend", VSA_BACKENDS)
def test_video_sparse_attn_nan_query_token(backend, gate):
    """The same rule in ``video_sparse_attn``: the row alone without a gate; with one, every row of
    its tile (token 70 is in the prefix's second tile, tokens 64..119), through the coarse term."""
    scope, dtype = cpu_context(backend)
    q, k, v = testing.make_qkv(B, T, H, D, dtype=dtype, seed=16)
    q[NAN_AT[0], NAN_AT[1], NAN_AT[2], 5] = float("nan")
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(17)).to(dtype) if gate else None
    with scope:
        got = solattn.video_sparse_attn(q, k, v, (1, 8, 10), topk=2, gate=g, prefix_len=120, backend=backend)
    want_nan = _expected(T, blocks=[(_b, 64, 120, _h)]) if gate else _expected(T, **ROW)
    nan = torch.isnan(got).any(-1)
    assert torch.equal(nan, want_nan), (f"NaN rows {nan.nonzero().tolist()[:8]}... ({int(nan.sum())}), "
                                        f"expected {int(want_nan.sum())}")
