"""Where the fused plan's select kernel spends its time at H3 (B=1, T=37296, H=56, D=128, bf16),
on a GPU. TEMPORARY diagnostic: a copy of
``solattn.routing.fused_kernels.select_kernel`` with ablation switches (each switched-off part's
saving is its cost; outputs of ablated runs are wrong by design).

    python benchmarks/diag/select_cost.py
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from solattn.bench.timing import time_calls  # noqa: E402
from solattn.routing import build_plan, fused  # noqa: E402
from solattn.routing.fused_kernels import gpu_jit, order_key, unsettled_rows  # noqa: E402
from solattn.testing import make_qkv  # noqa: E402
from solattn.validation import validate  # noqa: E402


@gpu_jit
def select_ablate(Qm, Km, Vm, Mean, Var, Lens, Scratch, Theta,
                  KvNum, KvIdx, Touch, TailLse, TailValue, Coarse,
                  n, c, cc, tau, kk, s0, s1, q0, q1,
                  SEL: tl.constexpr, HAS_TAIL: tl.constexpr, HAS_COARSE: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_I: tl.constexpr, BJ: tl.constexpr,
                  NP: tl.constexpr, RB: tl.constexpr, BLOCK: tl.constexpr, DOT: tl.constexpr,
                  SEARCH: tl.constexpr = 1,   # 0 none (theta = 0), 1 bisection
                  CHECK: tl.constexpr = 1,    # halvings per settled check
                  SCORES: tl.constexpr = True, SCATTER: tl.constexpr = True,
                  PAD: tl.constexpr = True, TOUCH: tl.constexpr = True):
    g = tl.program_id(1).to(tl.int64)
    i0 = tl.program_id(0) * BLOCK_I
    ii = i0 + tl.arange(0, BLOCK_I)
    row_ok = ii < n
    dims = tl.arange(0, HEAD_DIM)
    cols = tl.arange(0, BJ)
    gn = g * n
    q = tl.load(Qm + (gn + ii)[:, None] * HEAD_DIM + dims[None, :], mask=row_ok[:, None], other=0.0)
    m = tl.load(Mean + g * HEAD_DIM + dims)
    if SEL == 0:
        var = tl.load(Var + g * HEAD_DIM + dims)
        thr = tau * tl.sqrt(cc * tl.sum(q * q * var[None, :], 1) + 1e-6)
    if SEL == 1:
        if SCORES:
            for j0 in range(0, n, BJ):
                jj = j0 + cols
                ok = jj < n
                kmc = tl.load(Km + (gn + jj)[:, None] * HEAD_DIM + dims[None, :], mask=ok[:, None], other=0.0)
                kmc = tl.where(ok[:, None], kmc - m[None, :], 0.0)
                r = tl.dot(q, tl.trans(kmc), input_precision=DOT) * c
                tl.store(Scratch + (gn + ii)[:, None] * n + jj[None, :], r,
                         mask=row_ok[:, None] & ok[None, :])
            tl.debug_barrier()
        if SEARCH > 0:
            allc = tl.arange(0, NP)
            cand_ok = (allc < n) & ((allc < s0) | (allc >= s1))
            for r0 in range(0, BLOCK_I, RB):
                rr = i0 + r0 + tl.arange(0, RB)
                rok = rr < n
                r = tl.load(Scratch + (gn + rr)[:, None] * n + allc[None, :],
                            mask=rok[:, None] & cand_ok[None, :], other=0.0)
                key = order_key(r)
                lo = tl.min(tl.where(cand_ok[None, :], key, 2147483647), 1).to(tl.int64)
                hi = tl.max(tl.where(cand_ok[None, :], key, -2147483648), 1).to(tl.int64) + 1
                cnt_lo = tl.zeros([RB], tl.int32) + tl.sum(cand_ok.to(tl.int32), 0)
                unsettled = unsettled_rows(cnt_lo, lo, hi, kk)
                while unsettled > 0:
                    for _u in tl.static_range(CHECK):
                        mid = (lo + hi) >> 1
                        cnt = tl.sum(((key >= mid.to(tl.int32)[:, None]) & cand_ok[None, :]).to(tl.int32), 1)
                        ge = cnt >= kk
                        lo = tl.where(ge, mid, lo)
                        cnt_lo = tl.where(ge, cnt, cnt_lo)
                        hi = tl.where(ge, hi, mid)
                    unsettled = unsettled_rows(cnt_lo, lo, hi, kk)
                tl.store(Theta + gn + rr, lo.to(tl.int32), mask=rok)
            tl.debug_barrier()
            theta = tl.load(Theta + gn + ii, mask=row_ok, other=0)
        else:
            theta = tl.zeros([BLOCK_I], tl.int32)
    sink_row = (ii >= q0) & (ii < q1)
    count = tl.zeros([BLOCK_I], tl.int32)
    touches = tl.zeros([BLOCK_I], tl.int32)
    if HAS_TAIL:
        t_max = tl.full([BLOCK_I], float("-inf"), tl.float32)
        t_sum = tl.zeros([BLOCK_I], tl.float32)
        t_acc = tl.zeros([BLOCK_I, HEAD_DIM], tl.float32)
    for j0 in range(0, n, BJ):
        jj = j0 + cols
        ok = jj < n
        both = row_ok[:, None] & ok[None, :]
        if SEL == 1:
            r = tl.load(Scratch + (gn + ii)[:, None] * n + jj[None, :], mask=both, other=0.0)
            is_sink = (jj >= s0) & (jj < s1)
            sel = (order_key(r) >= theta[:, None]) & ~is_sink[None, :]
        else:
            kmc = tl.load(Km + (gn + jj)[:, None] * HEAD_DIM + dims[None, :], mask=ok[:, None], other=0.0)
            kmc = tl.where(ok[:, None], kmc - m[None, :], 0.0)
            r = tl.dot(q, tl.trans(kmc), input_precision=DOT) * c
            if SEL == 0:
                sel = r > thr[:, None]
            else:
                sel = tl.zeros([BLOCK_I, BJ], tl.int1)
        near = (jj[None, :] >= ii[:, None] - 1) & (jj[None, :] <= ii[:, None] + 1)
        forced = near | ((jj >= s0) & (jj < s1))[None, :] | sink_row[:, None]
        sel = (sel | forced) & both
        L = tl.load(Lens + jj, mask=ok, other=BLOCK)
        if TOUCH:
            touches = tl.maximum(touches, tl.max((sel & (L < BLOCK)[None, :]).to(tl.int32), 1))
        seli = sel.to(tl.int32)
        if SCATTER:
            pos = count[:, None] + tl.cumsum(seli, 1) - 1
            tl.store(KvIdx + (gn + ii)[:, None] * n + pos, jj[None, :] + tl.zeros([BLOCK_I, BJ], tl.int32),
                     mask=sel)
        count += tl.sum(seli, 1)
        if HAS_TAIL:
            vm = tl.load(Vm + (gn + jj)[:, None] * HEAD_DIM + dims[None, :], mask=ok[:, None], other=0.0)
            z = tl.where(sel | ~ok[None, :], float("-inf"), r + tl.log2(L.to(tl.float32))[None, :])
            new = tl.maximum(t_max, tl.max(z, 1))
            ref = tl.where(new == float("-inf"), 0.0, new)
            alpha = tl.math.exp2(t_max - ref)
            p = tl.math.exp2(z - ref[:, None])
            t_sum = t_sum * alpha + tl.sum(p, 1)
            t_acc = t_acc * alpha[:, None] + tl.dot(p, vm, input_precision=DOT)
            t_max = new
    tl.store(KvNum + gn + ii, count, mask=row_ok)
    tl.store(Touch + gn + ii, touches.to(tl.int8), mask=row_ok)
    if PAD:
        for w0 in range(0, n, BJ):
            ww = w0 + cols
            pad = row_ok[:, None] & (ww[None, :] < n) & (ww[None, :] >= count[:, None])
            tl.store(KvIdx + (gn + ii)[:, None] * n + ww[None, :], tl.zeros([BLOCK_I, BJ], tl.int32), mask=pad)
    out = (gn + ii)[:, None] * HEAD_DIM + dims[None, :]
    if HAS_TAIL:
        live = t_sum > 0.0
        lse = tl.where(live, (t_max + tl.log2(tl.where(live, t_sum, 1.0))) * 0.6931471805599453,
                       float("-inf"))
        tl.store(TailLse + gn + ii, lse, mask=row_ok)
        tl.store(TailValue + out, t_acc / tl.where(live, t_sum, 1.0)[:, None], mask=row_ok[:, None])


dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def med(fn, n=20, warm=3):
    return statistics.median(time_calls(fn, dev, n, warm))


TOPK = [("production kernel", None),
        ("copy, all on", {}),
        ("no search (theta 0)", dict(SEARCH=0)),
        ("no scores pass", dict(SCORES=False)),
        ("no scatter", dict(SCATTER=False)),
        ("no pad", dict(PAD=False)),
        ("no touch", dict(TOUCH=False)),
        ("no scatter, pad, touch", dict(SCATTER=False, PAD=False, TOUCH=False)),
        ("no search, scores, scatter, pad, touch", dict(SEARCH=0, SCORES=False, SCATTER=False, PAD=False, TOUCH=False)),
        ("check every 2", dict(CHECK=2)),
        ("check every 4", dict(CHECK=4)),
        ("production, block_i 32 (4 warps)", "block_i=32"),
        ("production, block_i 8 (4 warps)", "block_i=8"),
        ("production, block_i 8 (2 warps)", "block_i=8 select_warps=2"),
        ("production, 8 warps", "select_warps=8")]
TAU = [("production kernel", None), ("copy, all on", {}), ("no scatter", dict(SCATTER=False)),
       ("no pad", dict(PAD=False)), ("no touch", dict(TOUCH=False)),
       ("no scatter, pad, touch", dict(SCATTER=False, PAD=False, TOUCH=False)),
       ("production, block_i 32 (4 warps)", "block_i=32"), ("production, block_i 8 (2 warps)", "block_i=8 select_warps=2")]


def main():
    shape = (1, 37296, 56, 128) if dev.type == "cuda" else (1, 2000, 2, 64)
    q, k, v = make_qkv(*shape, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32, device=dev, seed=0)
    for label, kw, cases in (("top-k 10 %", dict(topk_ratio=0.1), TOPK), ("top-k 20 %", dict(topk_ratio=0.2), TOPK),
                             ("tau 1 + tail", dict(tau=1.0, tail=True), TAU), ("tau 1", dict(tau=1.0), TAU[:2])):
        problem = validate(q, k, v, **kw)
        with torch.no_grad():
            want = build_plan(problem)
            print(f"\n## {label}  {shape}", flush=True)
            for name, flags in cases:
                if isinstance(flags, str):
                    tuning = {kv.split("=")[0]: int(kv.split("=")[1]) for kv in flags.split()}
                else:
                    tuning = {} if flags is None else {"select_kernel": select_ablate, "select_constexprs": flags}
                got = fused._fused_plan(problem, tuning)
                try:
                    same = int((got.dense_mask() != want.dense_mask()).any(-1).sum())
                except RuntimeError:                    # ablated runs write garbage indices
                    same = "n/a"
                tm = med(lambda: fused._fused_plan(problem, tuning))
                print(f"  {name:42s} plan {tm:.3f} ms  rows differing from torch plan {same}", flush=True)


if __name__ == "__main__":
    main()
