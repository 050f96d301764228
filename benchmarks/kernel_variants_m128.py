"""Experiment kernels for the 20 % / tau regime: 128-row query tiles and work lists.

The production kernel (``solattn/backends/triton/kernel.py``) runs one 64-row query block per
program in one warpgroup (4 warps): wgmma m64n64 for Q K^T, the online softmax, then m64n128 for
P V, each waiting for the one before. At H3 top-k 20 % it reaches ~450 TFLOP/s of a ~790 TFLOP/s
matmul ceiling, and 4 stages (fewer programs per SM) were slower than 3, so the loop is short of
independent work per SM, not of bandwidth. The variants here give an SM more independent work per
byte of shared memory, or less tail imbalance; they are assembled from the production kernel's
``@jit`` pieces where the shapes allow and time the same arithmetic.

- ``union`` (:func:`m128_fwd`, every pair): one program per PAIR of consecutive query blocks
  (2p, 2p+1), a 128-row tile in two warpgroups (8 warps) that share each K/V block they load. It
  walks the sorted UNION of the two blocks' lists; a key block listed for only one of them has its
  logits set to -inf in the other half's rows, which leaves that half's softmax state bit for bit
  unchanged (alpha = 1, p = 0). Work done: ``128 x |union|`` rows x keys against the useful
  ``64 x (|E_2p| + |E_2p+1|)``, so it wins only where neighbouring lists overlap.
- ``split`` (:func:`m128_fwd` on a work list + :func:`m64_list_fwd`): pairs whose union costs at
  most ``max_overhead`` times their useful work (1.0: lists that coincide exactly) go to the
  128-row kernel, every other query block to a 64-row kernel; two launches.
- ``m64_list`` / ``m64_lpt`` (:func:`m64_list_fwd` alone): the production loop reading its
  (b*h, query block) from a work list, in grid order (measures the indirection itself) or
  longest list first (a tail-effect experiment for tau mode, where list lengths vary).

The union lists are built on the host (:func:`pair_plan`, a few torch ops over the plan) rather
than merged inside the kernel with two pointers: a ``for`` loop whose key block is a plain load of
``step`` is what Triton's software pipeliner can prefetch through TMA; a two-pointer merge makes
every step's address depend on the step before.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Dict, Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton.language as tl  # noqa: E402

from solattn.backends.triton import kernel as K  # noqa: E402
from solattn.backends.triton.backend import KernelConfig, _interpreting, _tma_ok, launch  # noqa: E402
from solattn.backends.triton.kernel import (  # noqa: E402
    gpu_jit, block_logits, query_block, softmax_update, start_state, write_rows)
from solattn.routing.plan import indices_from_mask  # noqa: E402
from solattn.validation import BLOCK  # noqa: E402


# ----------------------------------------------------------------------------- plan side

@dataclass
class PairPlan:
    """The plan's lists regrouped by pairs of query blocks (2p, 2p+1), p < P = ceil(n / 2).

    - ``union_num`` ``(B, H, P)`` int32, ``union_idx`` ``(B, H, P, M2)`` int32: the union of the
      two lists, ascending, 0-padded (a missing block 2p+1 when n is odd has an empty list).
    - ``union_bits`` ``(B, H, P, M2)`` int32: bit 0 set if that key block is in block 2p's list,
      bit 1 if in block 2p+1's.
    - ``n_even``, ``n_odd`` ``(B, H, P)``: the two list lengths; ``real`` ``(P,)`` bool: both
      blocks exist.
    """

    union_num: torch.Tensor
    union_idx: torch.Tensor
    union_bits: torch.Tensor
    n_even: torch.Tensor
    n_odd: torch.Tensor
    real: torch.Tensor

    @property
    def P(self) -> int:
        return self.union_num.shape[-1]

    def overhead(self) -> torch.Tensor:
        """Per pair: ``|union| / ((|E_2p| + |E_2p+1|) / 2)``, the union tile's work over the useful
        work (1 = lists coincide, 2 = disjoint); inf where both lists are empty."""
        useful = (self.n_even + self.n_odd).double() / 2
        return self.union_num.double() / useful

    def stats(self) -> Dict[str, float]:
        """Pair statistics over the real pairs (both blocks exist)."""
        real = self.real.expand_as(self.union_num)
        un = self.union_num[real].double()
        useful = (self.n_even + self.n_odd)[real].double()
        coincide = (self.union_num == self.n_even) & (self.n_even == self.n_odd)
        ov = self.overhead()[real]
        return {
            "pairs": int(real.sum()),
            # the union kernel's rows x keys over the useful ones, summed over all pairs
            "work_ratio": float(2 * un.sum() / useful.sum()) if useful.sum() > 0 else float("nan"),
            "overhead_mean": float(ov[torch.isfinite(ov)].mean()) if torch.isfinite(ov).any() else float("nan"),
            "coincide_frac": float(coincide[real].double().mean()),
            "le_1p25_frac": float((ov <= 1.25).double().mean()),
        }


def pair_plan(plan) -> PairPlan:
    """Group ``plan``'s lists into pairs of consecutive query blocks (see :class:`PairPlan`)."""
    exact = plan.dense_mask()                                   # (B, H, n, n) bool
    B, H, n, _ = exact.shape
    P = (n + 1) // 2
    if n % 2:                                                   # a missing last odd block: empty list
        exact = torch.cat([exact, exact.new_zeros(B, H, 1, n)], dim=2)
    even, odd = exact[:, :, 0::2], exact[:, :, 1::2]
    union = even | odd
    union_num, union_idx = indices_from_mask(union)
    bits = even.to(torch.int32) + 2 * odd.to(torch.int32)
    union_bits = torch.gather(bits, -1, union_idx.long())       # padding entries: ignored by the kernel
    real = torch.arange(P, device=exact.device) * 2 + 1 < n
    return PairPlan(union_num, union_idx.contiguous(), union_bits.contiguous(),
                    even.sum(-1, dtype=torch.int32), odd.sum(-1, dtype=torch.int32), real)


def split_work(pp: PairPlan, n: int, max_overhead: float):
    """``(pairs, singles)`` int32 work lists: ``bh * P + p`` for pairs whose union costs at most
    ``max_overhead`` x their useful work (both blocks exist, at least one key block), and
    ``bh * n + i`` for every query block of the other pairs; both in grid order (head by head)."""
    B, H, P = pp.union_num.shape
    useful = (pp.n_even + pp.n_odd).double() / 2
    take = (pp.union_num.double() <= max_overhead * useful + 1e-9) & pp.real & (pp.union_num > 0)
    take = take.reshape(B * H, P)
    pairs = torch.nonzero(take.flatten()).flatten().to(torch.int32)
    blocks = (~take).repeat_interleave(2, dim=1)[:, :n]        # block i belongs to pair i // 2
    singles = torch.nonzero(blocks.flatten()).flatten().to(torch.int32)
    return pairs.contiguous(), singles.contiguous()


# ----------------------------------------------------------------------------- kernels

@gpu_jit
def pair_start(Q, BlockLen, KeyMean, TailLse, TailValue, pair, bh, b, h, sqb, sqt, sqh, sqd, T, n_blocks,
               qk_scale, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, HAS_TAIL: tl.constexpr):
    """The 128 rows of query blocks (2 pair, 2 pair + 1) and their starting state; the second
    half's per-block values (block_len, tail) are read per row. ``(q, tok_q, row_ok, half,
    plan_row, blk_ok, m, l, acc)``, ``plan_row`` and ``blk_ok`` per row."""
    ROWS: tl.constexpr = 2 * BLOCK
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, HEAD_DIM)
    half = rows // BLOCK
    q_blk = 2 * pair + half
    blk_ok = q_blk < n_blocks
    tok_q = 2 * pair * BLOCK + rows
    row_ok = tok_q < T
    blen = tl.load(BlockLen + q_blk, mask=blk_ok, other=0)
    q_live = row_ok & ((rows % BLOCK) < blen)
    q_ptrs = Q + b * sqb + h * sqh + tok_q.to(tl.int64)[:, None] * sqt + dims[None, :] * sqd
    q = tl.load(q_ptrs, mask=q_live[:, None], other=0.0)
    plan_row = bh.to(tl.int64) * n_blocks + q_blk
    if HAS_TAIL:
        # start_state's tail key, with one tail per half instead of one per program
        key_mean = tl.load(KeyMean + bh.to(tl.int64) * HEAD_DIM + dims)
        shift = tl.sum(q.to(tl.float32) * key_mean[None, :], 1) * qk_scale
        tail_lse = tl.load(TailLse + plan_row, mask=blk_ok, other=float("-inf"))
        tail_live = tail_lse > float("-inf")
        m_i = shift + tail_lse * 1.4426950408889634
        l_i = tl.where(tail_live, 1.0, 0.0)
        acc = tl.load(TailValue + plan_row[:, None] * HEAD_DIM + dims[None, :],
                      mask=tail_live[:, None], other=0.0)
    else:
        m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        l_i = tl.full([ROWS], 0.0, tl.float32)
        acc = tl.full([ROWS, HEAD_DIM], 0.0, tl.float32)
    return q, tok_q, row_ok, half, plan_row, blk_ok, m_i, l_i, acc


@gpu_jit
def pair_write(Out, Gate, Coarse, acc, l_i, tok_q, row_ok, b, h, plan_row, blk_ok, T, H,
               sgb, sgt, sgh, sgd, HEAD_DIM: tl.constexpr, HAS_COARSE: tl.constexpr):
    """``write_rows`` with the coarse term read per row (each half has its own); same rounding order."""
    dims = tl.arange(0, HEAD_DIM)
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    out = out.to(Out.dtype.element_ty)
    if HAS_COARSE:
        g_ptrs = Gate + b * sgb + h * sgh + tok_q.to(tl.int64)[:, None] * sgt + dims[None, :] * sgd
        gate = tl.load(g_ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
        coarse = tl.load(Coarse + plan_row[:, None] * HEAD_DIM + dims[None, :], mask=blk_ok[:, None], other=0.0)
        coarse_term = (gate * coarse).to(Out.dtype.element_ty)
        out = (out.to(tl.float32) + coarse_term.to(tl.float32)).to(Out.dtype.element_ty)
    o_ptrs = Out + ((b * T + tok_q.to(tl.int64)[:, None]) * H + h) * HEAD_DIM + dims[None, :]
    tl.store(o_ptrs, out, mask=row_ok[:, None])


@gpu_jit
def m128_fwd(
    Q, K, V, Out, Gate,
    UNum, UIdx, UBits, Work, BlockLen, KeyMean, TailLse, TailValue, Coarse, KeyBias,
    sqb, sqt, sqh, sqd, skb, skt, skh, skd, svb, svt, svh, svd, sgb, sgt, sgh, sgd,
    s_bias_b, T, H, n_blocks, n_pairs, max_u, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
    HAS_TAIL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_COARSE: tl.constexpr, KV_TMA: tl.constexpr,
    USE_WORK: tl.constexpr,        # program -> pair from Work (split), else grid (pair, b*H + h)
    MASKED: tl.constexpr,          # False only when every pair launched has coinciding lists
):
    if USE_WORK:
        w = tl.load(Work + tl.program_id(0))
        bh = w // n_pairs
        pair = w % n_pairs
    else:
        pair = tl.program_id(0)
        bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    q, tok_q, row_ok, half, plan_row, blk_ok, m_i, l_i, acc = pair_start(
        Q, BlockLen, KeyMean, TailLse, TailValue, pair, bh, b, h, sqb, sqt, sqh, sqd, T, n_blocks,
        qk_scale, HEAD_DIM, BLOCK, HAS_TAIL)
    pair_row = bh.to(tl.int64) * n_pairs + pair
    count = tl.load(UNum + pair_row)
    idx_row = UIdx + pair_row * max_u
    bits_row = UBits + pair_row * max_u
    row_bit = 1 + half                       # bit 0 for the first block's rows, bit 1 for the second's
    rows = tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    bias_row = KeyBias + b * s_bias_b
    if not KV_TMA:
        k_base = K + b * skb + h * skh
        v_base = V + b * svb + h * svh
    for step in range(0, count):
        kv_block = tl.load(idx_row + step)
        tok_k = (kv_block * BLOCK + rows).to(tl.int64)
        if KV_TMA:
            live = tok_k < T
            k = K.load([bh // H, kv_block * BLOCK, bh % H, 0]).reshape(BLOCK, HEAD_DIM)
        else:
            live = rows < tl.load(BlockLen + kv_block)
            k = tl.load(k_base + tok_k[:, None] * skt + dims[None, :] * skd, mask=live[:, None], other=0.0)
        s = block_logits(q, k, tok_k, live, bias_row, qk_scale, HAS_BIAS)
        if MASKED:
            # a key block listed for one half only: -inf for the other half's rows
            listed = (tl.load(bits_row + step) & row_bit) != 0
            s = tl.where(listed[:, None], s, float("-inf"))
        p, alpha, m_i, l_i = softmax_update(s, m_i, l_i)
        if KV_TMA:
            v = V.load([bh // H, kv_block * BLOCK, bh % H, 0]).reshape(BLOCK, HEAD_DIM)
        else:
            v = tl.load(v_base + tok_k[:, None] * svt + dims[None, :] * svd, mask=live[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    pair_write(Out, Gate, Coarse, acc, l_i, tok_q, row_ok, b, h, plan_row, blk_ok, T, H,
               sgb, sgt, sgh, sgd, HEAD_DIM, HAS_COARSE)


@gpu_jit
def m64_list_fwd(
    Q, K, V, Out, Gate,
    KvNum, KvIdx, Work, BlockLen, KeyMean, TailLse, TailValue, Coarse, KeyBias,
    sqb, sqt, sqh, sqd, skb, skt, skh, skd, svb, svt, svh, svd, sgb, sgt, sgh, sgd,
    s_bias_b, T, H, n_blocks, max_blocks, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
    HAS_TAIL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_COARSE: tl.constexpr, KV_TMA: tl.constexpr,
):
    """The production kernel with its (b*h, query block) read from ``Work`` (``bh * n + i``)
    instead of the grid: the prologue is ``program_start``'s, the loop the production loop."""
    w = tl.load(Work + tl.program_id(0))
    bh = w // n_blocks
    q_block = w % n_blocks
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    plan_row = bh.to(tl.int64) * n_blocks + q_block
    q, tok_q, row_ok = query_block(Q, BlockLen, q_block, b, h, sqb, sqt, sqh, sqd, T, HEAD_DIM, BLOCK)
    m_i, l_i, acc = start_state(q, KeyMean, TailLse, TailValue, bh, plan_row, qk_scale,
                                HEAD_DIM, BLOCK, HAS_TAIL)
    count = tl.load(KvNum + plan_row)
    idx_row = KvIdx + plan_row * max_blocks
    rows = tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    bias_row = KeyBias + b * s_bias_b
    if not KV_TMA:
        k_base = K + b * skb + h * skh
        v_base = V + b * svb + h * svh
    for step in range(0, count):
        kv_block = tl.load(idx_row + step)
        tok_k = (kv_block * BLOCK + rows).to(tl.int64)
        if KV_TMA:
            live = tok_k < T
            k = K.load([bh // H, kv_block * BLOCK, bh % H, 0]).reshape(BLOCK, HEAD_DIM)
        else:
            live = rows < tl.load(BlockLen + kv_block)
            k = tl.load(k_base + tok_k[:, None] * skt + dims[None, :] * skd, mask=live[:, None], other=0.0)
        s = block_logits(q, k, tok_k, live, bias_row, qk_scale, HAS_BIAS)
        p, alpha, m_i, l_i = softmax_update(s, m_i, l_i)
        if KV_TMA:
            v = V.load([bh // H, kv_block * BLOCK, bh % H, 0]).reshape(BLOCK, HEAD_DIM)
        else:
            v = tl.load(v_base + tok_k[:, None] * svt + dims[None, :] * svd, mask=live[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    write_rows(Out, Gate, Coarse, acc, l_i, tok_q, row_ok, b, h, plan_row, T, H,
               sgb, sgt, sgh, sgd, HEAD_DIM, HAS_COARSE)


@gpu_jit
def pair3d_fwd(
    Q, K, V, Out, Gate,
    KvNum, KvIdx, BlockLen, KeyMean, TailLse, TailValue, Coarse, KeyBias,
    sqb, sqt, sqh, sqd, skb, skt, skh, skd, svb, svt, svh, svd, sgb, sgt, sgh, sgd,
    s_bias_b, T, H, n_blocks, max_blocks, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
    HAS_TAIL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_COARSE: tl.constexpr, KV_TMA: tl.constexpr,
):
    """Two query blocks per program, each walking ITS OWN list, as one batched (2, 64, ...) problem:
    step s takes key block E_2p[s] for the first half and E_2p+1[s] for the second, and both
    matmuls are one 3-D ``tl.dot``. Nothing is wasted on lists that differ (random selections);
    a half whose list is shorter masks its extra steps to -inf. Whether Triton's 3-D dot keeps up
    with the 2-D wgmma path is the question this variant asks."""
    pair = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    q2, tok_q, row_ok, half, plan_row, blk_ok, m2, l2, acc2 = pair_start(
        Q, BlockLen, KeyMean, TailLse, TailValue, pair, bh, b, h, sqb, sqt, sqh, sqd, T, n_blocks,
        qk_scale, HEAD_DIM, BLOCK, HAS_TAIL)
    q = q2.reshape(2, BLOCK, HEAD_DIM)
    m_i = m2.reshape(2, BLOCK)
    l_i = l2.reshape(2, BLOCK)
    acc = acc2.reshape(2, BLOCK, HEAD_DIM)
    halves = tl.arange(0, 2)
    row0 = bh.to(tl.int64) * n_blocks + 2 * pair
    blk = 2 * pair + halves
    has = blk < n_blocks
    counts = tl.load(KvNum + row0 + halves, mask=has, other=0)           # (2,)
    steps = tl.max(counts, 0)
    rows = tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    bias_row = KeyBias + b * s_bias_b
    if not KV_TMA:
        k_base = K + b * skb + h * skh
        v_base = V + b * svb + h * svh
    for step in range(0, steps):
        valid = step < counts                                             # (2,): this half still has blocks
        kv = tl.load(KvIdx + (row0 + halves) * max_blocks + step, mask=valid, other=0)
        tok_k = (kv[:, None] * BLOCK + rows[None, :]).to(tl.int64)         # (2, BLOCK)
        if KV_TMA:
            live = (tok_k < T) & valid[:, None]
            ka = K.load([bh // H, tl.sum(tl.where(halves == 0, kv, 0)) * BLOCK, bh % H, 0]).reshape(BLOCK, HEAD_DIM)
            kb = K.load([bh // H, tl.sum(tl.where(halves == 1, kv, 0)) * BLOCK, bh % H, 0]).reshape(BLOCK, HEAD_DIM)
            k = tl.permute(tl.join(ka, kb), (2, 0, 1))                    # (2, BLOCK, D)
        else:
            live = (rows[None, :] < tl.load(BlockLen + kv[:, None])) & valid[:, None]
            k = tl.load(k_base + tok_k[:, :, None] * skt + dims[None, None, :] * skd,
                        mask=live[:, :, None], other=0.0)
        s = tl.dot(q, tl.permute(k, (0, 2, 1))) * qk_scale                 # (2, BLOCK, BLOCK)
        if HAS_BIAS:
            bias = tl.load(bias_row + tok_k, mask=live, other=0.0)
            bias = tl.where(bias == float("-inf"), bias, tl.minimum(tl.maximum(bias, -1e30), 1e30))
            s = s + bias[:, None, :] * 1.4426950408889634
        s = tl.where(live[:, None, :], s, float("-inf"))
        # softmax_update, one axis further in
        m_new = tl.maximum(m_i, tl.max(s, 2))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_ref)
        p = tl.math.exp2(s - m_ref[:, :, None])
        l_i = l_i * alpha + tl.sum(p, 2)
        m_i = m_new
        if KV_TMA:
            va = V.load([bh // H, tl.sum(tl.where(halves == 0, kv, 0)) * BLOCK, bh % H, 0]).reshape(BLOCK, HEAD_DIM)
            vb = V.load([bh // H, tl.sum(tl.where(halves == 1, kv, 0)) * BLOCK, bh % H, 0]).reshape(BLOCK, HEAD_DIM)
            v = tl.permute(tl.join(va, vb), (2, 0, 1))
        else:
            v = tl.load(v_base + tok_k[:, :, None] * svt + dims[None, None, :] * svd,
                        mask=live[:, :, None], other=0.0)
        acc = acc * alpha[:, :, None] + tl.dot(p.to(v.dtype), v)
    pair_write(Out, Gate, Coarse, acc.reshape(2 * BLOCK, HEAD_DIM), l_i.reshape(2 * BLOCK), tok_q, row_ok,
               b, h, plan_row, blk_ok, T, H, sgb, sgt, sgh, sgd, HEAD_DIM, HAS_COARSE)


# ----------------------------------------------------------------------------- launchers

def _common(problem, plan, cfg: KernelConfig, out):
    """The arguments every kernel here shares, prepared as the backend's ``run_kernel`` does."""
    q, k, v = problem.q, problem.k, problem.v
    B, T, H, D = problem.B, problem.T, problem.H, problem.D
    if out is None:
        out = torch.empty((B, T, H, D), dtype=v.dtype, device=v.device)
    f32 = torch.float32
    key_mean = plan.key_mean.detach().to(f32).contiguous()
    has_tail = problem.tail and plan.tail_lse is not None
    has_coarse = problem.coarse_gate is not None
    has_bias = problem.key_bias is not None

    def field(t, on):
        return t.detach().to(f32).contiguous() if on else key_mean

    gate = problem.coarse_gate if has_coarse else q
    if has_bias:
        key_bias = problem.key_bias.to(f32).contiguous()
        bias_stride_b = key_bias.stride(0) if key_bias.shape[0] > 1 else 0
    else:
        key_bias, bias_stride_b = key_mean, 0
    interpret = _interpreting() or q.device.type == "cpu"
    use_tma = cfg.tma and _tma_ok(problem, interpret)
    if interpret and q.dtype == torch.bfloat16:       # the interpreter's tl.dot cannot take bf16
        q, k, v = (t.to(f32) for t in (q, k, v))
    k_arg, v_arg = k, v
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        k_arg, v_arg = (TensorDescriptor(t, list(t.shape), list(t.stride()), [1, BLOCK, 1, D]) for t in (k, v))
    return dict(
        interpret=interpret, out=out,
        head=(q, k_arg, v_arg, out, gate),
        plan_tensors=(plan.block_len.to(torch.int32).contiguous(), key_mean,
                      field(plan.tail_lse, has_tail), field(plan.tail_value, has_tail),
                      field(plan.coarse, has_coarse), key_bias),
        strides=(*q.stride(), *k.stride(), *v.stride(), *gate.stride(), bias_stride_b),
        flags=dict(HEAD_DIM=D, BLOCK=BLOCK, HAS_TAIL=has_tail, HAS_BIAS=has_bias,
                   HAS_COARSE=has_coarse, KV_TMA=use_tma),
        launch=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    )


def launch_m128(problem, plan, pp: PairPlan, cfg: KernelConfig, work: Optional[torch.Tensor] = None,
                masked: bool = True, out=None):
    """The 128-row kernel over every pair (``work`` None) or over the pairs in ``work``.
    ``masked=False`` is only correct when every launched pair's two lists coincide."""
    c = _common(problem, plan, cfg, out)
    n, P, H = problem.n, pp.P, problem.H
    if work is None:
        grid, work_arg = (P, problem.B * H), pp.union_num
    else:
        if work.numel() == 0:
            return c["out"]
        grid, work_arg = (work.numel(),), work
    K.compiled(c["interpret"], m128_fwd)[grid](
        *c["head"], pp.union_num, pp.union_idx, pp.union_bits, work_arg, *c["plan_tensors"],
        *c["strides"], problem.T, H, n, P, pp.union_idx.shape[-1], problem.scale * K.LOG2E,
        USE_WORK=work is not None, MASKED=masked, **c["flags"], **c["launch"])
    return c["out"]


def launch_m64_list(problem, plan, work: torch.Tensor, cfg: KernelConfig, out=None):
    """The 64-row kernel over the query blocks in ``work`` (``bh * n + i``)."""
    c = _common(problem, plan, cfg, out)
    if work.numel() == 0:
        return c["out"]
    kv_num = plan.kv_num_blocks.to(torch.int32).contiguous()
    kv_idx = plan.kv_indices.to(torch.int32).contiguous()
    K.compiled(c["interpret"], m64_list_fwd)[(work.numel(),)](
        *c["head"], kv_num, kv_idx, work, *c["plan_tensors"],
        *c["strides"], problem.T, problem.H, problem.n, kv_idx.shape[-1], problem.scale * K.LOG2E,
        **c["flags"], **c["launch"])
    return c["out"]


def launch_pair3d(problem, plan, cfg: KernelConfig, out=None):
    """The batched two-list kernel, one program per pair of query blocks."""
    c = _common(problem, plan, cfg, out)
    kv_num = plan.kv_num_blocks.to(torch.int32).contiguous()
    kv_idx = plan.kv_indices.to(torch.int32).contiguous()
    K.compiled(c["interpret"], pair3d_fwd)[((problem.n + 1) // 2, problem.B * problem.H)](
        *c["head"], kv_num, kv_idx, *c["plan_tensors"],
        *c["strides"], problem.T, problem.H, problem.n, kv_idx.shape[-1], problem.scale * K.LOG2E,
        **c["flags"], **c["launch"])
    return c["out"]


def grid_order_work(plan) -> torch.Tensor:
    """Every (b*h, query block) as ``bh * n + i``, in the production grid's order."""
    return torch.arange(plan.kv_num_blocks.numel(), device=plan.kv_num_blocks.device, dtype=torch.int32)


def lpt_work(plan) -> torch.Tensor:
    """Every (b*h, query block), longest list first (ties in grid order)."""
    counts = plan.kv_num_blocks.flatten()
    return torch.sort(counts, descending=True, stable=True).indices.to(torch.int32).contiguous()


@dataclass
class Variant:
    """One experiment: ``prepare(problem, plan)`` (host side, untimed: pair lists, work lists)
    returns ``run(out)``, the timed launch(es) writing into ``out``."""
    name: str
    prepare: object
    what: str


def _union(cfg):
    def prepare(problem, plan):
        pp = pair_plan(plan)
        return lambda out=None: launch_m128(problem, plan, pp, cfg, out=out)
    return prepare


def _split(cfg128, cfg64, max_overhead):
    def prepare(problem, plan):
        pp = pair_plan(plan)
        pairs, singles = split_work(pp, problem.n, max_overhead)

        def run(out=None):
            out = launch_m128(problem, plan, pp, cfg128, work=pairs, masked=max_overhead > 1.0, out=out)
            return launch_m64_list(problem, plan, singles, cfg64, out=out)
        return run
    return prepare


def _list(cfg, order):
    def prepare(problem, plan):
        work = order(plan)
        return lambda out=None: launch_m64_list(problem, plan, work, cfg, out=out)
    return prepare


def _pair3d(cfg):
    def prepare(problem, plan):
        return lambda out=None: launch_pair3d(problem, plan, cfg, out=out)
    return prepare


def _production(cfg):
    def prepare(problem, plan):
        return lambda out=None: launch(problem, plan, config=cfg, out=out)
    return prepare


def variants(tma: bool = True) -> Dict[str, Variant]:
    """The experiments, by name (TMA loads on or off for all of them)."""
    c8s2, c8s3 = KernelConfig(1, 8, 2, tma=tma), KernelConfig(1, 8, 3, tma=tma)
    c4s3 = KernelConfig(1, 4, 3, tma=tma)
    vs = [
        Variant("union w8/s2", _union(c8s2), "128-row tile over the union of each pair's lists, 2 stages (2 programs/SM)"),
        Variant("union w8/s3", _union(c8s3), "same, 3 stages (1 program/SM)"),
        Variant("split exact w8/s2", _split(c8s2, c4s3, 1.0),
                "128-row tile for pairs whose lists coincide, 64-row production loop for the rest"),
        Variant("split <=1.25 w8/s2", _split(c8s2, c4s3, 1.25),
                "128-row union tile for pairs with union <= 1.25 x useful work, 64-row for the rest"),
        Variant("m64 list", _list(c4s3, grid_order_work), "production loop fed from a work list, grid order (cost of the indirection)"),
        Variant("m64 lpt", _list(c4s3, lpt_work), "production loop, longest list first (tail imbalance)"),
        Variant("pair3d w8/s2", _pair3d(c8s2), "two query blocks, each its own list, as one batched 3-D dot; 2 stages"),
        Variant("pair3d w8/s3", _pair3d(c8s3), "same, 3 stages"),
        Variant("production w4/s2", _production(KernelConfig(1, 4, 2, tma=tma)),
                "the production kernel at 2 stages (not recorded with TMA loads)"),
        Variant("production w8/s3", _production(c8s3), "the production kernel at 8 warps (recorded only with pointer loads)"),
    ]
    return {v.name: v for v in vs}
