"""Diagnostic variants of the triton backend's kernel, for benchmarks only.

They split the key loop's time into its two halves, and are assembled from the
production kernel's own ``@jit`` pieces (``program_start``, ``block_logits``, ``softmax_update``,
``write_rows`` in ``solattn/backends/triton/kernel.py``), so they time the same code, not a copy
of it:

- ``math_only``: the loop without its K/V loads (the first listed key block is loaded
  once, before the loop, and reused at every step): logits, online softmax, P V.
- ``loads_only``: the loop's K/V loads without the math (each block is summed into the
  accumulator so that the loads cannot be dropped).

Both are one kernel, :func:`half_loop`, switched by its ``MATH_ONLY`` constexpr. Their outputs
are wrong by design. It takes the production kernel's arguments (and ``MATH_ONLY``), so
:func:`run_variant` launches it through the backend's own argument preparation.
Measured on the H200 (H3, top-k 10 %): math only 9.58 ms, loads only 7.08 ms, the
production kernel with TMA loads 9.58 ms (see notes_triton.md).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton.language as tl  # noqa: E402

from solattn.backends.triton.backend import KernelConfig, run_kernel  # noqa: E402
from solattn.backends.triton.kernel import (  # noqa: E402
    gpu_jit, block_logits, program_start, softmax_update, write_rows)


@gpu_jit
def half_loop(
    Q, K, V, Out, Gate,
    KvNum, KvIdx, BlockLen, KeyMean, TailLse, TailValue, Coarse, KeyBias, Lse, Resid,
    sqb, sqt, sqh, sqd, skb, skt, skh, skd, svb, svt, svh, svd, sgb, sgt, sgh, sgd,
    s_bias_b, T, H, n_blocks, max_blocks, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
    HAS_TAIL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_COARSE: tl.constexpr, KV_TMA: tl.constexpr,
    MATH_ONLY: tl.constexpr,       # True: math_only, False: loads_only
):
    bh, b, h, plan_row, q, tok_q, row_ok, m_i, l_i, acc, count, idx_row = program_start(
        Q, KvNum, KvIdx, BlockLen, KeyMean, TailLse, TailValue, sqb, sqt, sqh, sqd,
        T, H, n_blocks, max_blocks, qk_scale, HEAD_DIM, BLOCK, HAS_TAIL)
    rows = tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    if MATH_ONLY:
        # the first listed block, loaded once before the loop
        block0 = tl.load(idx_row)
        tok0 = (block0 * BLOCK + rows).to(tl.int64)
        live0 = tok0 < T
        if KV_TMA:
            k = K.load([bh // H, block0 * BLOCK, bh % H, 0]).reshape(BLOCK, HEAD_DIM)
            v = V.load([bh // H, block0 * BLOCK, bh % H, 0]).reshape(BLOCK, HEAD_DIM)
        else:
            k = tl.load(K + b * skb + h * skh + tok0[:, None] * skt + dims[None, :] * skd, mask=live0[:, None], other=0.0)
            v = tl.load(V + b * svb + h * svh + tok0[:, None] * svt + dims[None, :] * svd, mask=live0[:, None], other=0.0)
        for step in range(0, count):
            s = block_logits(q, k, tok0, live0, KeyBias + b * s_bias_b, qk_scale, HAS_BIAS)
            p, alpha, m_i, l_i = softmax_update(s, m_i, l_i)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    else:
        if not KV_TMA:
            k_base = K + b * skb + h * skh
            v_base = V + b * svb + h * svh
        for step in range(0, count):
            kv_block = tl.load(idx_row + step)
            if KV_TMA:
                k = K.load([bh // H, kv_block * BLOCK, bh % H, 0]).reshape(BLOCK, HEAD_DIM)
                v = V.load([bh // H, kv_block * BLOCK, bh % H, 0]).reshape(BLOCK, HEAD_DIM)
            else:
                tok_k = (kv_block * BLOCK + rows).to(tl.int64)
                live = rows < tl.load(BlockLen + kv_block)
                k = tl.load(k_base + tok_k[:, None] * skt + dims[None, :] * skd, mask=live[:, None], other=0.0)
                v = tl.load(v_base + tok_k[:, None] * svt + dims[None, :] * svd, mask=live[:, None], other=0.0)
            acc += k.to(tl.float32) + v.to(tl.float32)
            l_i += 1.0
    write_rows(Out, Gate, Coarse, acc, l_i, tok_q, row_ok, b, h, plan_row, T, H,
               sgb, sgt, sgh, sgd, HEAD_DIM, HAS_COARSE)


#: name -> the constexprs that make :func:`half_loop` that variant (after the production kernel's arguments)
VARIANTS = {"math_only": {"MATH_ONLY": True}, "loads_only": {"MATH_ONLY": False}}


def run_variant(name: str, problem, plan, config: KernelConfig):
    """Launch the diagnostic variant ``name`` on ``problem``/``plan`` (output wrong by design)."""
    if name not in VARIANTS:
        raise ValueError(f"kernel_variants: argument 'name' received {name!r}; allowed: {', '.join(VARIANTS)}")
    return run_kernel(half_loop, problem, plan, config, constexprs=VARIANTS[name])


# ----------------------------------------------------------------------------- softmax-loop candidates
#
# Candidates for a cheaper key loop at 64-row tiles, where the loop is math-bound (tensor cores
# wait for the softmax between QK^T and PV). Each switch removes elementwise work per logit:
#
# - FMA: the row max is taken on the raw logits and scaled once per row (the scale is positive),
#   and ``exp2(s * scale - m)`` is one fused multiply-add per logit instead of a multiply and a
#   subtract.
# - PEEL: the dead-key mask is applied only at the last listed step. Lists are ascending, so a
#   ragged last key block (keys past T) can only be the last step; every earlier block is full.
#   Valid without block_len (TMA loads never have one).
# - DOT_ACC: the rescaled accumulator is the accumulator operand of the P V product (no separate
#   64 x D add).
# - LAZY: the running max only moves when some row's max grows by more than LAZY (base-2 units);
#   until then the old max stays the reference, the rows' terms stay <= 2^LAZY, and the whole
#   rescale (a 64 x D multiply) is skipped by one branch per step. The final normalisation uses
#   the same reference, so the result is the same softmax.


@gpu_jit
def fast_step(q, k, v, live, m_i, l_i, acc, qk_scale,
              MASK: tl.constexpr, FMA: tl.constexpr, DOT_ACC: tl.constexpr, LAZY: tl.constexpr):
    s = tl.dot(q, tl.trans(k))
    if MASK:
        s = tl.where(live[None, :], s, float("-inf"))
    if FMA:
        m_blk = tl.max(s, 1) * qk_scale
    else:
        s = s * qk_scale
        m_blk = tl.max(s, 1)
    m_new = tl.maximum(m_i, m_blk)
    if LAZY > 0:
        grow = tl.max((m_new > m_i + LAZY).to(tl.int32), 0)
        if grow > 0:
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(m_i - m_ref)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_new
        m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
        if FMA:
            p = tl.math.exp2(s * qk_scale - m_use[:, None])
        else:
            p = tl.math.exp2(s - m_use[:, None])
        l_i = l_i + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc) if DOT_ACC else acc + tl.dot(p.to(v.dtype), v)
        return m_i, l_i, acc
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_ref)
    if FMA:
        p = tl.math.exp2(s * qk_scale - m_ref[:, None])
    else:
        p = tl.math.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_ACC:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@gpu_jit
def fast_kv(K, V, idx_row, step, bh, b, h, skb, skt, skh, skd, svb, svt, svh, svd, BlockLen, T, H,
            HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, KV_TMA: tl.constexpr):
    rows = tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    kv_block = tl.load(idx_row + step)
    tok_k = (kv_block * BLOCK + rows).to(tl.int64)
    if KV_TMA:
        live = tok_k < T
        k = K.load([bh // H, kv_block * BLOCK, bh % H, 0]).reshape(BLOCK, HEAD_DIM)
        v = V.load([bh // H, kv_block * BLOCK, bh % H, 0]).reshape(BLOCK, HEAD_DIM)
    else:
        live = rows < tl.load(BlockLen + kv_block)
        k = tl.load(K + b * skb + h * skh + tok_k[:, None] * skt + dims[None, :] * skd, mask=live[:, None], other=0.0)
        v = tl.load(V + b * svb + h * svh + tok_k[:, None] * svt + dims[None, :] * svd, mask=live[:, None], other=0.0)
    return k, v, live


@gpu_jit
def fast_loop(
    Q, K, V, Out, Gate,
    KvNum, KvIdx, BlockLen, KeyMean, TailLse, TailValue, Coarse, KeyBias, Lse, Resid,
    sqb, sqt, sqh, sqd, skb, skt, skh, skd, svb, svt, svh, svd, sgb, sgt, sgh, sgd,
    s_bias_b, T, H, n_blocks, max_blocks, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
    HAS_TAIL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_COARSE: tl.constexpr, KV_TMA: tl.constexpr,
    FMA: tl.constexpr, PEEL: tl.constexpr, DOT_ACC: tl.constexpr, LAZY: tl.constexpr,
):
    tl.static_assert(not HAS_BIAS, "fast_loop: no key_bias")
    bh, b, h, plan_row, q, tok_q, row_ok, m_i, l_i, acc, count, idx_row = program_start(
        Q, KvNum, KvIdx, BlockLen, KeyMean, TailLse, TailValue, sqb, sqt, sqh, sqd,
        T, H, n_blocks, max_blocks, qk_scale, HEAD_DIM, BLOCK, HAS_TAIL)
    if PEEL:
        for step in range(0, count - 1):
            k, v, live = fast_kv(K, V, idx_row, step, bh, b, h, skb, skt, skh, skd, svb, svt, svh, svd,
                                 BlockLen, T, H, HEAD_DIM, BLOCK, KV_TMA)
            m_i, l_i, acc = fast_step(q, k, v, live, m_i, l_i, acc, qk_scale, False, FMA, DOT_ACC, LAZY)
        if count > 0:
            k, v, live = fast_kv(K, V, idx_row, count - 1, bh, b, h, skb, skt, skh, skd, svb, svt, svh, svd,
                                 BlockLen, T, H, HEAD_DIM, BLOCK, KV_TMA)
            m_i, l_i, acc = fast_step(q, k, v, live, m_i, l_i, acc, qk_scale, True, FMA, DOT_ACC, LAZY)
    else:
        for step in range(0, count):
            k, v, live = fast_kv(K, V, idx_row, step, bh, b, h, skb, skt, skh, skd, svb, svt, svh, svd,
                                 BlockLen, T, H, HEAD_DIM, BLOCK, KV_TMA)
            m_i, l_i, acc = fast_step(q, k, v, live, m_i, l_i, acc, qk_scale, True, FMA, DOT_ACC, LAZY)
    write_rows(Out, Gate, Coarse, acc, l_i, tok_q, row_ok, b, h, plan_row, T, H,
               sgb, sgt, sgh, sgd, HEAD_DIM, HAS_COARSE)


#: name -> fast_loop's switches
FAST = {
    "fma": dict(FMA=True, PEEL=False, DOT_ACC=False, LAZY=0),
    "peel": dict(FMA=False, PEEL=True, DOT_ACC=False, LAZY=0),
    "dotacc": dict(FMA=False, PEEL=False, DOT_ACC=True, LAZY=0),
    "fma+peel": dict(FMA=True, PEEL=True, DOT_ACC=False, LAZY=0),
    "fma+peel+dotacc": dict(FMA=True, PEEL=True, DOT_ACC=True, LAZY=0),
    "fma+peel+dotacc+lazy8": dict(FMA=True, PEEL=True, DOT_ACC=True, LAZY=8),
    "fma+peel+lazy8": dict(FMA=True, PEEL=True, DOT_ACC=False, LAZY=8),
    "none": dict(FMA=False, PEEL=False, DOT_ACC=False, LAZY=0),
}


def run_fast(name: str, problem, plan, config: KernelConfig):
    """Launch :func:`fast_loop` with the switches of ``FAST[name]`` (a correct output)."""
    if name not in FAST:
        raise ValueError(f"kernel_variants: argument 'name' received {name!r}; allowed: {', '.join(FAST)}")
    return run_kernel(fast_loop, problem, plan, config, constexprs=FAST[name])
