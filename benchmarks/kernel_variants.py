"""Diagnostic variants of the triton backend's kernel, for benchmarks only.

They split the key loop's time into its two halves, and are assembled from the
production kernel's own ``@jit`` pieces (``program_start``, ``logits``, ``softmax_update``,
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
    gpu_jit, key_block, logits, program_start, softmax_update, write_rows)


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
    if MATH_ONLY:
        # the first listed block, loaded once before the loop
        k, v, tok0, live0, ragged0 = key_block(K, V, idx_row, 0, bh, b, h, skb, skt, skh, skd, svb, svt, svh, svd,
                                               BlockLen, T, H, HEAD_DIM, BLOCK, KV_TMA, False)
        for step in range(0, count):
            s = logits(q, k, tok0, live0, ragged0, KeyBias + b * s_bias_b, qk_scale, HAS_BIAS, FOLD_SCALE)
            p, alpha, m_i, l_i = softmax_update(s, m_i, l_i, qk_scale, FOLD_SCALE)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    else:
        for step in range(0, count):
            k, v, tok_k, live, ragged = key_block(K, V, idx_row, step, bh, b, h, skb, skt, skh, skd, svb, svt, svh,
                                                  svd, BlockLen, T, H, HEAD_DIM, BLOCK, KV_TMA, False)
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


# Key-loop candidates, measured on the H200 at H3, kernel only (results/h200/session12, with
# benchmarks/diag/kernel_softmax.py): against the loop of f65d347 (9.35 ms at top-k 10 %, 18.03 at
# 20 %), folding the scale into the softmax's FMA with K and V loaded before the softmax took
# 8.68 / 16.77 ms, and masking only ragged blocks another 2 % (8.57 / 16.25 / 13.20 ms with tau 1 +
# tail); both are the production loop now. Lost: the mask on a peeled last step (9.84 ms at 10 %),
# a lazy rescale behind a branch per step (12.2), the next block's Q K^T issued before this
# block's softmax (9.78), two key blocks per step with TMA loads (11.9-13.5, one program per SM
# instead of two); PV accumulating into the rescaled accumulator made no difference (8.69 against
# 8.66). That code, the timing script and its interpreter test are in the history: ``fast_loop``
# at f65d347, ``candidate_loop`` at 0582787, ``kv2_loop`` and the script at d2320f6.
#
# The same loop under ``tl.range`` options (results/h200/session13/a036e4b/loop_flags.txt, with
# benchmarks/diag/kernel_loop_flags.py, removed afterwards; in the history at 2a27781), production
# 7.97 / 16.54 / 13.32 ms at top-k 10 % / 20 % / tau 1 + tail: ``tl.range`` with 3 stages 7.81 /
# 16.69 / 13.43 (within run-to-run noise), Triton 3.6's automatic warp specialization on Hopper
# 7.99 / 16.74 / 13.40 with 4 warps and 13.4-32.6 with 8, unrolling by 2 12.5 / 22.9 / 18.6. None
# ships; the errors were unchanged (1.66-1.67e-3).
