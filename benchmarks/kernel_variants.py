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
    FOLD_SCALE: tl.constexpr,
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
            if FOLD_SCALE:
                s = tl.where(live0[None, :], tl.dot(q, tl.trans(k)), float("-inf"))
            else:
                s = block_logits(q, k, tok0, live0, KeyBias + b * s_bias_b, qk_scale, HAS_BIAS)
            p, alpha, m_i, l_i = softmax_update(s, m_i, l_i, qk_scale, FOLD_SCALE)
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



# ----------------------------------------------------------------------------- key-loop candidates
#
# Measured at f65d347 (H200, H3 top-k 10 %, kernel only; production then 9.35 ms): the scale
# folded into the softmax's FMA with K and V loaded before the softmax, 8.68 ms (now the
# production loop); the dead-key mask on the last step only (loop peeled), 9.84; a lazy rescale
# (a branch per step), 12.2. Candidates on top of the production loop:
#
# - DOT_ACC: the rescaled accumulator is the P V product's accumulator operand (no separate
#   64 x D add; 4 % faster than the old loop at f65d347).
# - IFMASK: the dead-key mask behind one scalar branch per step, taken only for a ragged block.
# - PREFETCH: the next block's Q K^T is issued before this block's softmax (the logits are carried
#   across the loop step), so the tensor cores can work while the softmax runs; the last step
#   computes one spare product (its own block again).


@gpu_jit
def load_kv(K, V, idx_row, step, bh, b, h, skb, skt, skh, skd, svb, svt, svh, svd, BlockLen, T, H,
            HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, KV_TMA: tl.constexpr, WANT_V: tl.constexpr):
    rows = tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    kv_block = tl.load(idx_row + step)
    tok_k = (kv_block * BLOCK + rows).to(tl.int64)
    if KV_TMA:
        live = tok_k < T
        ragged = kv_block * BLOCK + BLOCK > T
        k = K.load([bh // H, kv_block * BLOCK, bh % H, 0]).reshape(BLOCK, HEAD_DIM)
        v = k
        if WANT_V:
            v = V.load([bh // H, kv_block * BLOCK, bh % H, 0]).reshape(BLOCK, HEAD_DIM)
    else:
        blen = tl.load(BlockLen + kv_block)
        live = rows < blen
        ragged = blen < BLOCK
        k = tl.load(K + b * skb + h * skh + tok_k[:, None] * skt + dims[None, :] * skd, mask=live[:, None], other=0.0)
        v = k
        if WANT_V:
            v = tl.load(V + b * svb + h * svh + tok_k[:, None] * svt + dims[None, :] * svd, mask=live[:, None], other=0.0)
    return k, v, live, ragged


@gpu_jit
def folded_step(s, v, live, ragged, m_i, l_i, acc, qk_scale, DOT_ACC: tl.constexpr, IFMASK: tl.constexpr):
    if IFMASK:
        if ragged:
            s = tl.where(live[None, :], s, float("-inf"))
    else:
        s = tl.where(live[None, :], s, float("-inf"))
    p, alpha, m_i, l_i = softmax_update(s, m_i, l_i, qk_scale, True)
    if DOT_ACC:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_i, l_i, acc


@gpu_jit
def candidate_loop(
    Q, K, V, Out, Gate,
    KvNum, KvIdx, BlockLen, KeyMean, TailLse, TailValue, Coarse, KeyBias, Lse, Resid,
    sqb, sqt, sqh, sqd, skb, skt, skh, skd, svb, svt, svh, svd, sgb, sgt, sgh, sgd,
    s_bias_b, T, H, n_blocks, max_blocks, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
    HAS_TAIL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_COARSE: tl.constexpr, KV_TMA: tl.constexpr,
    FOLD_SCALE: tl.constexpr,
    DOT_ACC: tl.constexpr, IFMASK: tl.constexpr, PREFETCH: tl.constexpr,
):
    tl.static_assert(FOLD_SCALE, "candidate_loop: no key_bias, positive scale")
    bh, b, h, plan_row, q, tok_q, row_ok, m_i, l_i, acc, count, idx_row = program_start(
        Q, KvNum, KvIdx, BlockLen, KeyMean, TailLse, TailValue, sqb, sqt, sqh, sqd,
        T, H, n_blocks, max_blocks, qk_scale, HEAD_DIM, BLOCK, HAS_TAIL)
    if PREFETCH:
        if count > 0:
            k, v, live, ragged = load_kv(K, V, idx_row, 0, bh, b, h, skb, skt, skh, skd, svb, svt, svh, svd,
                                         BlockLen, T, H, HEAD_DIM, BLOCK, KV_TMA, False)
            s = tl.dot(q, tl.trans(k))
            for step in range(0, count):
                nxt = tl.minimum(step + 1, count - 1)
                k_n, v_n, live_n, ragged_n = load_kv(K, V, idx_row, nxt, bh, b, h, skb, skt, skh, skd, svb, svt,
                                                     svh, svd, BlockLen, T, H, HEAD_DIM, BLOCK, KV_TMA, False)
                s_n = tl.dot(q, tl.trans(k_n))
                k_c, v, live_c, ragged_c = load_kv(K, V, idx_row, step, bh, b, h, skb, skt, skh, skd, svb, svt,
                                                   svh, svd, BlockLen, T, H, HEAD_DIM, BLOCK, KV_TMA, True)
                m_i, l_i, acc = folded_step(s, v, live_c, ragged_c, m_i, l_i, acc, qk_scale, DOT_ACC, IFMASK)
                s = s_n
    else:
        for step in range(0, count):
            k, v, live, ragged = load_kv(K, V, idx_row, step, bh, b, h, skb, skt, skh, skd, svb, svt, svh, svd,
                                         BlockLen, T, H, HEAD_DIM, BLOCK, KV_TMA, True)
            m_i, l_i, acc = folded_step(tl.dot(q, tl.trans(k)), v, live, ragged, m_i, l_i, acc, qk_scale,
                                        DOT_ACC, IFMASK)
    write_rows(Out, Gate, Coarse, acc, l_i, tok_q, row_ok, b, h, plan_row, T, H,
               sgb, sgt, sgh, sgd, HEAD_DIM, HAS_COARSE)


#: name -> candidate_loop's switches
CANDIDATES = {
    "loop": dict(DOT_ACC=False, IFMASK=False, PREFETCH=False),
    "dotacc": dict(DOT_ACC=True, IFMASK=False, PREFETCH=False),
    "ifmask": dict(DOT_ACC=False, IFMASK=True, PREFETCH=False),
    "dotacc+ifmask": dict(DOT_ACC=True, IFMASK=True, PREFETCH=False),
    "prefetch": dict(DOT_ACC=False, IFMASK=False, PREFETCH=True),
    "prefetch+dotacc": dict(DOT_ACC=True, IFMASK=False, PREFETCH=True),
    "prefetch+dotacc+ifmask": dict(DOT_ACC=True, IFMASK=True, PREFETCH=True),
}


def run_candidate(name: str, problem, plan, config: KernelConfig):
    """Launch :func:`candidate_loop` with the switches of ``CANDIDATES[name]`` (a correct output;
    no key_bias, positive scale)."""
    if name not in CANDIDATES:
        raise ValueError(f"kernel_variants: argument 'name' received {name!r}; allowed: {', '.join(CANDIDATES)}")
    return run_kernel(candidate_loop, problem, plan, config, constexprs=CANDIDATES[name])
