"""Experiment: part of the softmax's exponentials on the FMA pipe instead of the MUFU (sm_90).

The production loop takes 34 ``MUFU.EX2`` per thread and key block (32 terms, 2 rescale
factors); at 8 cycles a warp each that is 272 of the ~1000 cycles a program spends on one block at
H3 (Nsight Compute, session 15: MUFU 32 % busy). This kernel, :func:`offload_loop`, is the
production loop with one change: of every ``EXP_PACK`` consecutive terms a thread holds, one is
computed as ``2^x = 2^round(x) * p(x - round(x))`` with a degree-4 polynomial (relative error
3.1e-6, far below bf16's 3.9e-3 rounding of ``p``) in FMA-pipe instructions, the others on the MUFU.
``EXP_PACK = 0`` is the production exponential, ``-1`` drops the exponential altogether (a
diagnostic: how much of the loop's time the MUFU's latency is; its output is wrong by design).

Inline PTX (``tl.inline_asm_elementwise``), so CUDA only and not in the interpreter. Edge cases of
the polynomial path: ``x <= -127`` (and ``-inf``, dead keys) gives exactly ``+0`` (the 2^round(x)
factor is built as the bits ``(round(x) + 127) << 23``, zero at -127), NaN stays NaN (``max.NaN``
keeps it and the final multiply propagates it).

    python benchmarks/diag/loop_variants_h3.py --only exp-control exp-1of8 exp-1of4 exp-1of2 exp-none
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
import triton.language as tl  # noqa: E402

from solattn.backends.triton.kernel import (  # noqa: E402
    gpu_jit, key_block, logits, program_start, write_rows)

#: 2^f ~ 1 + f * (C1 + f * (C2 + f * (C3 + f * C4))) on [-0.5, 0.5], fitted for relative error
#: (iteratively reweighted least squares towards minimax; max relative error 3.07e-6)
POLY = (0.693122, 0.24023716, 0.055916663, 0.009600541)


def f32_hex(x: float) -> str:
    return "0f%08X" % np.float32(x).view(np.uint32)


def poly_ptx(out: str, x: str) -> str:
    """PTX computing ``out = 2^x`` on the FMA pipe (``out``, ``x`` are asm operands like ``$0``)."""
    c1, c2, c3, c4 = (f32_hex(c) for c in POLY)
    return ("{ .reg .b32 x, j, r, f, p, e;\n"
            f"max.NaN.f32 x, {x}, 0fC2FE0000;\n"        # clamp at -127 (NaN kept)
            "add.rn.f32 j, x, 0f4B400000;\n"             # j = x + 1.5 * 2^23: round(x) in j's low bits
            "sub.rn.f32 r, j, 0f4B400000;\n"             # r = round(x)
            "sub.rn.f32 f, x, r;\n"                      # f in [-0.5, 0.5]
            f"fma.rn.f32 p, f, {c4}, {c3};\n"
            f"fma.rn.f32 p, p, f, {c2};\n"
            f"fma.rn.f32 p, p, f, {c1};\n"
            "fma.rn.f32 p, p, f, 0f3F800000;\n"
            "mad.lo.s32 e, j, 8388608, 1065353216;\n"    # bits of 2^round(x): (round(x) + 127) << 23
            f"mul.rn.f32 {out}, p, e;\n}}\n")


def offload_asm(pack: int) -> str:
    """Inline PTX for ``pack`` consecutive terms: ``pack - 1`` MUFU exponentials, one polynomial."""
    lines = [f"ex2.approx.ftz.f32 ${i}, ${pack + i};" for i in range(pack - 1)]
    lines.append(poly_ptx(f"${pack - 1}", f"${2 * pack - 1}"))
    return "\n".join(lines)


@gpu_jit
def exp2_terms(x, EXP_PACK: tl.constexpr, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr):
    if EXP_PACK == 0:
        p = tl.math.exp2(x)
    elif EXP_PACK < 0:
        p = x
    else:
        p = tl.inline_asm_elementwise(ASM, CONSTRAINTS, [x],
                                      dtype=tl.float32, is_pure=True, pack=EXP_PACK)
    return p


@gpu_jit
def offload_loop(
    Q, K, V, Out, Gate,
    KvNum, KvIdx, BlockLen, KeyMean, TailLse, TailValue, Coarse, KeyBias, Lse, Resid,
    sqb, sqt, sqh, sqd, skb, skt, skh, skd, svb, svt, svh, svd, sgb, sgt, sgh, sgd,
    s_bias_b, T, H, n_blocks, max_blocks, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
    HAS_TAIL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_COARSE: tl.constexpr, KV_TMA: tl.constexpr,
    FOLD_SCALE: tl.constexpr, TMA_LEN: tl.constexpr = False, WRITE_LSE: tl.constexpr = False,
    EXP_PACK: tl.constexpr = 0, ASM: tl.constexpr = "", CONSTRAINTS: tl.constexpr = "",
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
        # softmax_update of kernel.py with the terms' exponential swapped
        if FOLD_SCALE:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_ref)
        if FOLD_SCALE:
            p = exp2_terms(s * qk_scale - m_ref[:, None], EXP_PACK, ASM, CONSTRAINTS)
        else:
            p = exp2_terms(s - m_ref[:, None], EXP_PACK, ASM, CONSTRAINTS)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    write_rows(Out, Gate, Coarse, acc, l_i, tok_q, row_ok, b, h, plan_row, T, H,
               sgb, sgt, sgh, sgd, HEAD_DIM, HAS_COARSE)


def constexprs(pack: int) -> dict:
    """The launch constexprs of :func:`offload_loop` for ``EXP_PACK = pack``."""
    if pack <= 0:
        return {"EXP_PACK": pack}
    return {"EXP_PACK": pack, "ASM": offload_asm(pack), "CONSTRAINTS": ",".join(["=r"] * pack + ["r"] * pack)}
