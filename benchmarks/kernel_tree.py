"""Experiment: the softmax's row max and row sum with shorter in-thread chains (sm_90, Triton 3.6).

Nsight Compute (session 18) put 13.6 % of the production kernel's stall samples on ``FMNMX``: under
Triton 3.6 each thread folds its 16 logits of a row into the max one after another. :func:`tree_loop`
first combines adjacent columns (which one thread holds, so ``tl.split`` moves nothing), leaving
chains of 8 for the max and for the sum.

    python benchmarks/diag/loop_variants_h3.py --only tree
"""


from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton.language as tl  # noqa: E402

from solattn.backends.triton.kernel import (  # noqa: E402
    gpu_jit, key_block, logits, program_start, write_rows)


@gpu_jit
def tree_loop(
    Q, K, V, Out, Gate,
    KvNum, KvIdx, BlockLen, KeyMean, TailLse, TailValue, Coarse, KeyBias, Lse, Resid,
    sqb, sqt, sqh, sqd, skb, skt, skh, skd, svb, svt, svh, svd, sgb, sgt, sgh, sgd,
    s_bias_b, T, H, n_blocks, max_blocks, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
    HAS_TAIL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_COARSE: tl.constexpr, KV_TMA: tl.constexpr,
    FOLD_SCALE: tl.constexpr, TMA_LEN: tl.constexpr = False, WRITE_LSE: tl.constexpr = False,
):
    bh, b, h, plan_row, q, tok_q, row_ok, m_i, l_i, acc, count, idx_row = program_start(
        Q, KvNum, KvIdx, BlockLen, KeyMean, TailLse, TailValue, sqb, sqt, sqh, sqd,
        T, H, n_blocks, max_blocks, qk_scale, HEAD_DIM, BLOCK, HAS_TAIL)
    bias_row = KeyBias + b * s_bias_b
    for step in range(0, count):
        k, v, tok_k, live, ragged = key_block(K, V, idx_row, step, bh, b, h, skb, skt, skh, skd,
                                              svb, svt, svh, svd, BlockLen, T, H, HEAD_DIM, BLOCK, KV_TMA,
                                              TMA_LEN)
        s = logits(q, k, tok_k, live, ragged, bias_row, qk_scale, HAS_BIAS, FOLD_SCALE)
        # softmax_update with the row max and row sum halved first (adjacent columns, which
        # one thread holds) so that the in-thread chains are 8 deep, not 16
        sa, sb = tl.split(tl.reshape(s, [BLOCK, BLOCK // 2, 2]))
        if FOLD_SCALE:
            m_new = tl.maximum(m_i, tl.max(tl.maximum(sa, sb), 1) * qk_scale)
        else:
            m_new = tl.maximum(m_i, tl.max(tl.maximum(sa, sb), 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_ref)
        if FOLD_SCALE:
            p = tl.math.exp2(s * qk_scale - m_ref[:, None])
        else:
            p = tl.math.exp2(s - m_ref[:, None])
        pa, pb = tl.split(tl.reshape(p, [BLOCK, BLOCK // 2, 2]))
        l_i = l_i * alpha + tl.sum(pa + pb, 1)
        m_i = m_new
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    write_rows(Out, Gate, Coarse, acc, l_i, tok_q, row_ok, b, h, plan_row, T, H,
               sgb, sgt, sgh, sgd, HEAD_DIM, HAS_COARSE)
