"""Experiment: the query tile as the register operand of ``Q K^T`` (sm_90).

Triton keeps the query tile in shared memory, so each of the 8 ``HGMMA.64x64x16`` of a step reads
2 KB of it beside the key block's 2 KB; Triton moves a ``wgmma`` left operand to registers only
when it comes out of another product's accumulator. :func:`qreg_loop` passes the query tile
through one product with the identity once per program, which gives it that layout.

    python benchmarks/diag/loop_variants_h3.py --only qreg
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton.language as tl  # noqa: E402

from solattn.backends.triton.kernel import (  # noqa: E402
    gpu_jit, key_block, logits, program_start, softmax_update, write_rows)


@gpu_jit
def qreg_loop(
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
    dims = tl.arange(0, HEAD_DIM)
    eye = (dims[:, None] == dims[None, :]).to(q.dtype)
    q = tl.dot(q, eye).to(q.dtype)          # exact: one nonzero product per output
    bias_row = KeyBias + b * s_bias_b
    for step in range(0, count):
        k, v, tok_k, live, ragged = key_block(K, V, idx_row, step, bh, b, h, skb, skt, skh, skd,
                                              svb, svt, svh, svd, BlockLen, T, H, HEAD_DIM, BLOCK, KV_TMA,
                                              TMA_LEN)
        s = logits(q, k, tok_k, live, ragged, bias_row, qk_scale, HAS_BIAS, FOLD_SCALE)
        p, alpha, m_i, l_i = softmax_update(s, m_i, l_i, qk_scale, FOLD_SCALE)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    write_rows(Out, Gate, Coarse, acc, l_i, tok_q, row_ok, b, h, plan_row, T, H,
               sgb, sgt, sgh, sgd, HEAD_DIM, HAS_COARSE)
