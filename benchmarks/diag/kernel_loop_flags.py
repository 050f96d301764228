"""The production forward's key loop under ``tl.range`` options (warp specialization, unrolling,
per-loop pipelining), kernel alone at H3 (B=1, T=37296, H=56, D=128, bf16) on a GPU, next to the
production kernel, each with its error against the sdpa backend in fp32. TEMPORARY diagnostic.

    python benchmarks/diag/kernel_loop_flags.py
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import solattn  # noqa: E402
from solattn.backends.triton import backend as tb  # noqa: E402
from solattn.backends.triton.kernel import (  # noqa: E402
    block_logits, gpu_jit, key_block, program_start, raw_logits, softmax_update, write_rows)
from solattn.bench.timing import time_calls  # noqa: E402
from solattn.routing import build_plan  # noqa: E402
from solattn.testing import make_qkv, rel_l2  # noqa: E402
from solattn.validation import validate  # noqa: E402


@gpu_jit
def loop_flags(
    Q, K, V, Out, Gate,
    KvNum, KvIdx, BlockLen, KeyMean, TailLse, TailValue, Coarse, KeyBias, Lse, Resid,
    sqb, sqt, sqh, sqd, skb, skt, skh, skd, svb, svt, svh, svd, sgb, sgt, sgh, sgd,
    s_bias_b, T, H, n_blocks, max_blocks, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
    HAS_TAIL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_COARSE: tl.constexpr, KV_TMA: tl.constexpr,
    FOLD_SCALE: tl.constexpr,
    WS: tl.constexpr = False, UNROLL: tl.constexpr = 1, LOOP_STAGES: tl.constexpr = 3,
):
    bh, b, h, plan_row, q, tok_q, row_ok, m_i, l_i, acc, count, idx_row = program_start(
        Q, KvNum, KvIdx, BlockLen, KeyMean, TailLse, TailValue, sqb, sqt, sqh, sqd,
        T, H, n_blocks, max_blocks, qk_scale, HEAD_DIM, BLOCK, HAS_TAIL)
    bias_row = KeyBias + b * s_bias_b
    for step in tl.range(0, count, num_stages=LOOP_STAGES, loop_unroll_factor=UNROLL, warp_specialize=WS):
        k, v, tok_k, live, ragged = key_block(K, V, idx_row, step, bh, b, h, skb, skt, skh, skd,
                                              svb, svt, svh, svd, BlockLen, T, H, HEAD_DIM, BLOCK, KV_TMA)
        if FOLD_SCALE:
            s = raw_logits(q, k, live, ragged)
        else:
            s = block_logits(q, k, tok_k, live, bias_row, qk_scale, HAS_BIAS)
        p, alpha, m_i, l_i = softmax_update(s, m_i, l_i, qk_scale, FOLD_SCALE)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    write_rows(Out, Gate, Coarse, acc, l_i, tok_q, row_ok, b, h, plan_row, T, H,
               sgb, sgt, sgh, sgd, HEAD_DIM, HAS_COARSE)


CASES = [("production", None, {}),
         ("tl.range, stages 3", {}, {}),
         ("unroll 2", dict(UNROLL=2), {}),
         ("warp_specialize, 4 warps", dict(WS=True), {}),
         ("warp_specialize, 8 warps", dict(WS=True), dict(num_warps=8)),
         ("warp_specialize, 8 warps, 2 stages", dict(WS=True, LOOP_STAGES=2), dict(num_warps=8))]


def main():
    dev = torch.device("cuda")
    q, k, v = make_qkv(1, 37296, 56, 128, dtype=torch.bfloat16, device=dev, seed=0)
    base = tb.DEFAULT_CONFIGS[128]
    for label, kw in (("top-k 10 %", dict(topk_ratio=0.1)), ("top-k 20 %", dict(topk_ratio=0.2)),
                      ("tau 1 + tail", dict(tau=1.0, tail=True))):
        problem = validate(q, k, v, **kw)
        with torch.no_grad():
            plan = build_plan(problem)
            ref = solattn.sol_attn(q.float(), k.float(), v.float(), backend="sdpa", **kw)
            print(f"\n## H3 {label}", flush=True)
            for name, cx, cfg_kw in CASES:
                cfg = tb.replace(base, **cfg_kw) if cfg_kw else base
                if cx is None:
                    def fn():
                        return tb.run_kernel(tb_kernel().sol_attn_fwd, problem, plan, cfg)
                else:
                    def fn():
                        return tb.run_kernel(loop_flags, problem, plan, cfg, constexprs=cx)
                try:
                    err = rel_l2(fn().float(), ref)
                    t = statistics.median(time_calls(fn, dev, 10, 2))
                    print(f"  {name:36s} {t:.3f} ms  err {err:.2e}", flush=True)
                except Exception as exc:  # noqa: BLE001 - report and go on
                    print(f"  {name:36s} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            del ref


def tb_kernel():
    from solattn.backends.triton import kernel
    return kernel


if __name__ == "__main__":
    main()
