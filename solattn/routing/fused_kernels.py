"""Triton kernels of the fused routing plan (see :mod:`solattn.routing.fused`); importing this
module imports Triton.

Every kernel is a compiled ``JITFunction`` (:func:`solattn.triton_runtime.jit.gpu_jit`), launched on
the GPU or in Triton's CPU interpreter through :func:`solattn.triton_runtime.jit.compiled`.
"""

from __future__ import annotations

import triton.language as tl

from ..triton_runtime.jit import gpu_jit


@gpu_jit
def means_kernel(Q, K, V, BlockLen, Rows, Qm, Km, Vm, Lout, Kt, Vt,
                 sqb, sqt, sqh, sqd, skb, skt, skh, skd, svb, svt, svh, svd,
                 T, H, n,
                 HAS_BLOCK_LEN: tl.constexpr, NEED_V: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK: tl.constexpr, ROWS: tl.constexpr = False, TILE_KV: tl.constexpr = False):
    """fp32 means of q, k (and with NEED_V v) over the live rows of block j (program ids: block,
    batch * head), and its live length. With ROWS, row r of the problem is token ``Rows[r]`` of
    the tensors (``Problem.rows``): the live rows are read there, in the same order, so the sums
    are those of a tiled copy. With TILE_KV that tiled copy of k and v is also written, into the
    contiguous ``(B, T, H, D)`` Kt and Vt with zeros in the dead rows (what the forward kernel's
    TMA loads read, as ``kernel.tile_rows`` writes it, here on the rows this kernel reads anyway)."""
    j = tl.program_id(0)
    g = tl.program_id(1)
    b = (g // H).to(tl.int64)
    h = (g % H).to(tl.int64)
    rows = tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    # live rows of block j (live_lengths): block_len clamped to [1, 64], never past T
    L = tl.minimum(T - j * BLOCK, BLOCK)
    if HAS_BLOCK_LEN:
        L = tl.minimum(L, tl.minimum(tl.maximum(tl.load(BlockLen + j), 1), BLOCK))
    tok = (j * BLOCK + rows).to(tl.int64)
    if ROWS:
        tok = tl.load(Rows + tok, mask=rows < L, other=0)
    live = (rows < L)[:, None]
    # dead rows are masked out of the load: they add 0 even when they hold NaN
    x = tl.load(Q + b * sqb + h * sqh + tok[:, None] * sqt + dims[None, :] * sqd, mask=live, other=0.0)
    qs = tl.sum(x.to(tl.float32), 0)
    x = tl.load(K + b * skb + h * skh + tok[:, None] * skt + dims[None, :] * skd, mask=live, other=0.0)
    ks = tl.sum(x.to(tl.float32), 0)
    if TILE_KV:
        r = (j * BLOCK + rows).to(tl.int64)
        dst = ((b * T + r[:, None]) * H + h) * HEAD_DIM + dims[None, :]
        in_t = (r < T)[:, None]
        tl.store(Kt + dst, x.to(Kt.dtype.element_ty), mask=in_t)
    Lf = L.to(tl.float32)
    out = (g.to(tl.int64) * n + j) * HEAD_DIM + dims
    tl.store(Qm + out, qs / Lf)
    tl.store(Km + out, ks / Lf)
    if NEED_V or TILE_KV:  # value means feed the tail and coarse terms only
        x = tl.load(V + b * svb + h * svh + tok[:, None] * svt + dims[None, :] * svd, mask=live, other=0.0)
        if NEED_V:
            tl.store(Vm + out, tl.sum(x.to(tl.float32), 0) / Lf)
        if TILE_KV:
            tl.store(Vt + dst, x.to(Vt.dtype.element_ty), mask=in_t)
    if g == 0:
        tl.store(Lout + j, L)


@gpu_jit
def centroid_kernel(Km, Mout, Var, n,
                    NEED_VAR: tl.constexpr, HEAD_DIM: tl.constexpr, BD: tl.constexpr, BJ: tl.constexpr):
    """The key centroid ``m`` (and, tau mode, the variance of the key means about it) of one batch *
    head over BD of its dims: HEAD_DIM / BD programs per batch * head, each walking all n blocks in
    chunks of BJ. One program per batch * head (BD = HEAD_DIM) left most of an H200 idle at H3:
    0.057 ms against 0.017 ms with BD = 32."""
    g = tl.program_id(0).to(tl.int64)
    dims = tl.program_id(1) * BD + tl.arange(0, BD)
    cols = tl.arange(0, BJ)
    base = Km + g * n * HEAD_DIM
    acc = tl.zeros([BD], tl.float32)
    for j0 in range(0, n, BJ):
        ok = (j0 + cols) < n
        x = tl.load(base + (j0 + cols)[:, None] * HEAD_DIM + dims[None, :], mask=ok[:, None], other=0.0)
        acc += tl.sum(x, 0)
    m = acc / n
    tl.store(Mout + g * HEAD_DIM + dims, m)
    if NEED_VAR:
        acc2 = tl.zeros([BD], tl.float32)
        for j0 in range(0, n, BJ):
            ok = (j0 + cols) < n
            x = tl.load(base + (j0 + cols)[:, None] * HEAD_DIM + dims[None, :], mask=ok[:, None], other=0.0)
            d = tl.where(ok[:, None], x - m[None, :], 0.0)
            acc2 += tl.sum(d * d, 0)
        tl.store(Var + g * HEAD_DIM + dims, acc2 / n)


@gpu_jit
def mean_cols(Means, gn, rows, ok, d0, HEAD_DIM: tl.constexpr, W: tl.constexpr):
    """Dims ``d0 .. d0 + W`` of block means ``rows`` of one batch * head from an ``(G n,
    HEAD_DIM)`` fp32 table whose row ``gn`` is the head's first (0 where not ``ok``)."""
    dims = d0 + tl.arange(0, W)
    return tl.load(Means + (gn + rows)[:, None] * HEAD_DIM + dims[None, :], mask=ok[:, None], other=0.0)


@gpu_jit
def mean_rows(Means, gn, rows, ok, HEAD_DIM: tl.constexpr):
    """:func:`mean_cols` over every dim."""
    return mean_cols(Means, gn, rows, ok, 0, HEAD_DIM, HEAD_DIM)


@gpu_jit
def score_ptrs(Scores, gn, ii, jj, n):
    """Where the routing scores of query blocks ``ii`` against key blocks ``jj`` of one batch *
    head are kept: the ``(G, n, n)`` fp32 scratch that the scores, select and pooled-terms kernels
    share."""
    return Scores + (gn + ii)[:, None] * n + jj[None, :]


@gpu_jit
def score_tile(Scores, gn, ii, jj, ii_ok, jj_ok, n):
    """The stored scores of query blocks ``ii`` against key blocks ``jj`` (0 outside ``ii_ok`` x
    ``jj_ok``): what the select and pooled-terms kernels both decide from."""
    return tl.load(score_ptrs(Scores, gn, ii, jj, n), mask=ii_ok[:, None] & jj_ok[None, :], other=0.0)


@gpu_jit
def centred_dot(q, Km, m, gn, jj, ok, d0, acc, HEAD_DIM: tl.constexpr, W: tl.constexpr, DOT: tl.constexpr):
    """``acc + q . (km_j - m)`` over dims ``d0 .. d0 + W`` of query-block means ``q`` (those dims)
    against key blocks ``jj`` (0 where not ``ok``); ``m``: the centroid's same dims."""
    kmc = mean_cols(Km, gn, jj, ok, d0, HEAD_DIM, W)
    kmc = tl.where(ok[:, None], kmc - m[None, :], 0.0)
    return tl.dot(q, tl.trans(kmc), acc, input_precision=DOT)


@gpu_jit
def centred_scores(q, Km, m, gn, jj, ok, c, HEAD_DIM: tl.constexpr, DOT: tl.constexpr):
    """``c q . (km_j - m)`` of query-block means ``q`` against key blocks ``jj`` (0 where not ``ok``)."""
    acc = tl.zeros([q.shape[0], jj.shape[0]], tl.float32)
    return centred_dot(q, Km, m, gn, jj, ok, 0, acc, HEAD_DIM, HEAD_DIM, DOT) * c


@gpu_jit
def scores_kernel(Qm, Km, Mean, Scores, n, c,
                  HEAD_DIM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  DOT: tl.constexpr):
    """Routing scores ``c qm_i . (km_j - m)`` of one (BM query blocks, BN key blocks) tile of one
    batch * head into the ``(G, n, n)`` fp32 ``Scores``: a plain tiled GEMM over BK dims at a time,
    so the select kernel reads its scores instead of recomputing them from the key means for
    every 16 query blocks (0.13 ms at H3 on an H200 against 0.43 ms inside the select kernel)."""
    g = tl.program_id(2).to(tl.int64)
    ii = tl.program_id(0) * BM + tl.arange(0, BM)
    jj = tl.program_id(1) * BN + tl.arange(0, BN)
    gn = g * n
    row_ok = ii < n
    ok = jj < n
    acc = tl.zeros([BM, BN], tl.float32)
    for d0 in range(0, HEAD_DIM, BK):
        q = mean_cols(Qm, gn, ii, row_ok, d0, HEAD_DIM, BK)
        m = tl.load(Mean + g * HEAD_DIM + d0 + tl.arange(0, BK))
        acc = centred_dot(q, Km, m, gn, jj, ok, d0, acc, HEAD_DIM, BK, DOT)
    tl.store(score_ptrs(Scores, gn, ii, jj, n), acc * c, mask=row_ok[:, None] & ok[None, :])


@gpu_jit
def order_key(r):
    # fp32 -> int32 whose signed order is the float order (+0.0 and -0.0 made equal first)
    bits = (r + 0.0).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@gpu_jit
def unsettled_rows(cnt_lo, lo, hi, kk):
    # rows of a top-k bisection tile not yet settled: count(key >= lo) is not kk and the
    # interval [lo, hi) holds more than one key
    return tl.sum(((cnt_lo != kk) & (hi - lo > 1)).to(tl.int32), 0)


@gpu_jit
def row_tile(n, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BJ: tl.constexpr):
    """This program's tile of ROWS query-block rows of one batch * head (program ids: row tile,
    batch * head): ``(g, i0, ii, row_ok, dims, cols, gn)`` with ``gn = g * n`` the head's first
    plan row and ``cols`` one chunk of BJ key-block offsets."""
    g = tl.program_id(1).to(tl.int64)
    i0 = tl.program_id(0) * ROWS
    ii = i0 + tl.arange(0, ROWS)
    return g, i0, ii, ii < n, tl.arange(0, HEAD_DIM), tl.arange(0, BJ), g * n


@gpu_jit
def exact_blocks(r, ii, jj, row_ok, ok, thr, theta, s0, s1, q0, q1,
                 SEL: tl.constexpr, BI: tl.constexpr, BJ: tl.constexpr, NEAR: tl.constexpr):
    """Which pairs of a ``(BI query blocks ii, BJ key blocks jj)`` score tile ``r`` are exact (in
    ``E_i``): above the row's tau threshold ``thr`` (SEL 0), at or above its k-th largest
    non-sink score (order key ``theta``, SEL 1) or neither (SEL 2), then every forced pair
    (``|i - j| <= 1`` when ``NEAR``: sol_attn's neighbours, not VSA's; sink key blocks ``[s0, s1)``,
    sink query blocks ``[q0, q1)``). The select
    and the pooled-terms kernels both call this on the same stored scores and thresholds, so
    a block is pooled exactly when it is not listed."""
    if SEL == 0:
        sel = r > thr[:, None]
    elif SEL == 1:
        is_sink = (jj >= s0) & (jj < s1)
        # a NaN score (a NaN query token's block) passes no comparison, as in the torch path: its
        # order key would sort above +inf
        sel = (order_key(r) >= theta[:, None]) & (r == r) & ~is_sink[None, :]
    else:
        sel = tl.zeros([BI, BJ], tl.int1)
    forced = tl.zeros([BI, BJ], tl.int1)
    if NEAR:        # (written first, sol_attn's specialisations compile as before NEAR existed)
        forced = (jj[None, :] >= ii[:, None] - 1) & (jj[None, :] <= ii[:, None] + 1)
    forced = forced | ((jj >= s0) & (jj < s1))[None, :] | ((ii >= q0) & (ii < q1))[:, None]
    return (sel | forced) & row_ok[:, None] & ok[None, :]


@gpu_jit
def key_value(key):
    """The fp32 value whose :func:`order_key` is ``key`` (the map is its own inverse on the bits)."""
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@gpu_jit
def candidate_keys(Scratch, gn, rr, rok, c0, n, s0, s1, W: tl.constexpr):
    """Order keys of the scores of rows ``rr`` against key blocks ``c0 .. c0 + W``, the smallest
    int32 where a block is no candidate (past n or a sink), and whether each block is one."""
    cols = c0 + tl.arange(0, W)
    cand = (cols < n) & ((cols < s0) | (cols >= s1))
    key = order_key(score_tile(Scratch, gn, rr, cols, rok, cand, n))
    return tl.where(cand[None, :], key, -2147483648), cand


@gpu_jit
def kth_keys(Scratch, gn, rr, rok, n, kk, s0, s1, NA: tl.constexpr, NB: tl.constexpr, RB: tl.constexpr):
    """The order key (:func:`order_key`) of the kk-th largest score outside the sink key blocks
    ``[s0, s1)`` of query-block rows ``rr`` (RB of them, ``rok`` the real ones) of one batch *
    head: ``order_key(score) >= theta`` then keeps exactly those kk, or more on ties.

    Bisection over the int32 keys of whole rows held in registers, as two power-of-two pieces of
    NA and NB (0: none) blocks, so that a row of n = 583 (H3) takes 640 lanes, not 1024."""
    key_a, cand_a = candidate_keys(Scratch, gn, rr, rok, 0, n, s0, s1, NA)
    lo = tl.min(tl.where(cand_a[None, :], key_a, 2147483647), 1)
    hi = tl.max(key_a, 1)
    n_cand = tl.sum(cand_a.to(tl.int32), 0)
    key_b = key_a     # (unused without a second piece)
    if NB > 0:
        key_b, cand_b = candidate_keys(Scratch, gn, rr, rok, NA, n, s0, s1, NB)
        lo = tl.minimum(lo, tl.min(tl.where(cand_b[None, :], key_b, 2147483647), 1))
        hi = tl.maximum(hi, tl.max(key_b, 1))
        n_cand += tl.sum(cand_b.to(tl.int32), 0)
    # Bisection between the row's smallest and largest candidate keys, with the invariant
    # cnt_lo = count(key >= lo) >= kk > count(key >= hi). A row is settled when cnt_lo == kk
    # (key >= lo is then exactly its kk largest: the same set as ">= the kk-th largest", as no
    # candidate lies in between) or hi == lo + 1 (lo is the kk-th largest key, ties included); the
    # loop ends when all RB rows have. Non-candidates hold the smallest key and are never counted:
    # every probe lies above lo (a settled row whose hi == lo + 1 probes lo, and its lo and hi
    # stay as they are).
    # The probe is the key of the midpoint of the interval's values, which halves the range
    # of the scores, where the keys' midpoint halves the range of their bit patterns (a
    # logarithmic scale: from [-3, 3] it probes 0, then 1e-19, ...). On H3's scores that took 9-10
    # halvings per row on average against 14 (bisection over keys alone, max 20-22 against 25-26).
    # Every fourth probe, and whenever the values' midpoint is not strictly inside the interval
    # (adjacent values, infinities, NaN), is the keys' midpoint, which bounds the halvings by
    # 4 x 32 whatever the scores' spread (values from 1e-30 to 1e30: at most 31 measured).
    lo = lo.to(tl.int64)
    hi = hi.to(tl.int64) + 1
    cnt_lo = tl.zeros([RB], tl.int32) + n_cand
    unsettled = unsettled_rows(cnt_lo, lo, hi, kk)
    step = 0
    while unsettled > 0:
        mid = (lo + hi) >> 1
        vmid = order_key(0.5 * key_value(lo.to(tl.int32)) + 0.5 * key_value((hi - 1).to(tl.int32))).to(tl.int64)
        mid = tl.where((vmid > lo) & (vmid < hi) & (step % 4 != 3), vmid, mid)
        m32 = mid.to(tl.int32)[:, None]
        cnt = tl.sum((key_a >= m32).to(tl.int32), 1)
        if NB > 0:
            cnt += tl.sum((key_b >= m32).to(tl.int32), 1)
        ge = cnt >= kk
        lo = tl.where(ge, mid, lo)
        cnt_lo = tl.where(ge, cnt, cnt_lo)
        hi = tl.where(ge, hi, mid)
        unsettled = unsettled_rows(cnt_lo, lo, hi, kk)
        step += 1
    return lo.to(tl.int32)


@gpu_jit
def kth_kernel(Scratch, Theta, n, kk, s0, s1, NA: tl.constexpr, NB: tl.constexpr, RB: tl.constexpr):
    """:func:`kth_keys` of RB query-block rows of one batch * head (program ids: row tile, batch *
    head) into ``Theta``, for the select and pooled-terms kernels. A kernel of its own so that it
    runs at its own width: in one warp each count of the bisection is a reduction within the warp
    (shuffles), where inside the select kernel's 4 warps every halving also crossed warps through
    shared memory and a barrier (see ``fused._fused_plan``)."""
    g = tl.program_id(1).to(tl.int64)
    rr = tl.program_id(0) * RB + tl.arange(0, RB)
    rok = rr < n
    tl.store(Theta + g * n + rr, kth_keys(Scratch, g * n, rr, rok, n, kk, s0, s1, NA, NB, RB), mask=rok)


@gpu_jit
def select_kernel(Qm, Km, Mean, Var, Lens, Scratch, Theta, Thr,
                  KvNum, KvIdx, Touch, Codes,
                  n, c, cc, tau, kk, s0, s1, q0, q1,
                  SEL: tl.constexpr,          # 0: tau, 1: top-k, 2: forced blocks only
                  NEAR: tl.constexpr,         # |i - j| <= 1 forced (sol_attn; not VSA)
                  HEAD_DIM: tl.constexpr, BLOCK_I: tl.constexpr, BJ: tl.constexpr,
                  NA: tl.constexpr, NB: tl.constexpr, RB: tl.constexpr, BLOCK: tl.constexpr,
                  DOT: tl.constexpr,             # tl.dot input_precision of the scores (SCORES_HERE)
                  SCORES_HERE: tl.constexpr,     # this kernel writes the scores into Scratch (IEEE
                                                 # products), not scores_kernel
                  CODES: tl.constexpr = False):
    """Selection of one tile of BLOCK_I query-block rows of one batch * head, from the scores in
    ``Scratch``: the tau threshold (computed here, stored in ``Thr``) or the k-th largest score
    (its order key in ``Theta``: from :func:`kth_kernel`, or found here with SCORES_HERE), then
    ``kv_num_blocks``, ``kv_indices`` (ascending, 0-padded) and ``touches_dead``. With CODES also
    each listed block with its dead rows, ``index | (BLOCK - L) << 16``, into ``Codes`` (nothing
    past a row's count): what ``kernel.len_codes`` makes for the forward kernel. The pooled terms
    are :func:`pooled_kernel`'s."""
    g, i0, ii, row_ok, dims, cols, gn = row_tile(n, BLOCK_I, HEAD_DIM, BJ)
    thr = tl.zeros([BLOCK_I], tl.float32)
    theta = tl.zeros([BLOCK_I], tl.int32)
    if SCORES_HERE or SEL == 0:
        q = mean_rows(Qm, gn, ii, row_ok, HEAD_DIM)
    if SEL == 0:
        var = tl.load(Var + g * HEAD_DIM + dims)
        thr = tau * tl.sqrt(cc * tl.sum(q * q * var[None, :], 1) + 1e-6)
        tl.store(Thr + gn + ii, thr, mask=row_ok)
    if SCORES_HERE:
        # this tile's rows of scores into the scratch (scores_kernel's work, in chunks of BJ)
        m = tl.load(Mean + g * HEAD_DIM + dims)
        for j0 in range(0, n, BJ):
            jj = j0 + cols
            ok = jj < n
            r = centred_scores(q, Km, m, gn, jj, ok, c, HEAD_DIM, DOT)
            tl.store(score_ptrs(Scratch, gn, ii, jj, n), r, mask=row_ok[:, None] & ok[None, :])
        tl.debug_barrier()
    if SEL == 1:
        if SCORES_HERE:     # the scores were written just now: their k-th largest here too
            for r0 in range(0, BLOCK_I, RB):
                rr = i0 + r0 + tl.arange(0, RB)
                rok = rr < n
                tl.store(Theta + gn + rr, kth_keys(Scratch, gn, rr, rok, n, kk, s0, s1, NA, NB, RB), mask=rok)
            tl.debug_barrier()
        theta = tl.load(Theta + gn + ii, mask=row_ok, other=0)    # else kth_kernel's
    count = tl.zeros([BLOCK_I], tl.int32)
    touches = tl.zeros([BLOCK_I], tl.int32)
    for j0 in range(0, n, BJ):
        jj = j0 + cols
        ok = jj < n
        r = score_tile(Scratch, gn, ii, jj, row_ok, ok, n)
        sel = exact_blocks(r, ii, jj, row_ok, ok, thr, theta, s0, s1, q0, q1, SEL, BLOCK_I, BJ, NEAR)
        L = tl.load(Lens + jj, mask=ok, other=BLOCK)
        touches = tl.maximum(touches, tl.max((sel & (L < BLOCK)[None, :]).to(tl.int32), 1))
        seli = sel.to(tl.int32)
        pos = count[:, None] + tl.cumsum(seli, 1) - 1
        tl.store(KvIdx + (gn + ii)[:, None] * n + pos, jj[None, :] + tl.zeros([BLOCK_I, BJ], tl.int32),
                 mask=sel)
        if CODES:
            code = jj | ((BLOCK - L) << 16)
            tl.store(Codes + (gn + ii)[:, None] * n + pos, code[None, :] + tl.zeros([BLOCK_I, BJ], tl.int32),
                     mask=sel)
        count += tl.sum(seli, 1)
    tl.store(KvNum + gn + ii, count, mask=row_ok)
    tl.store(Touch + gn + ii, touches.to(tl.int8), mask=row_ok)
    for w0 in range(0, n, BJ):            # padding after the count
        ww = w0 + cols
        pad = row_ok[:, None] & (ww[None, :] < n) & (ww[None, :] >= count[:, None])
        tl.store(KvIdx + (gn + ii)[:, None] * n + ww[None, :], tl.zeros([BLOCK_I, BJ], tl.int32), mask=pad)


@gpu_jit
def pooled_update(z, mx, sm, acc, vm, POOL_DOT: tl.constexpr):
    """Fold one chunk of base-2 logits ``z`` (``-inf``: not a term) with values ``vm`` into an
    online softmax ``(max, sum, weighted sum)``; a row with nothing finite yet keeps max -inf."""
    new = tl.maximum(mx, tl.max(z, 1))
    ref = tl.where(new == float("-inf"), 0.0, new)
    alpha = tl.math.exp2(mx - ref)
    p = tl.math.exp2(z - ref[:, None])
    return new, sm * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p, vm, input_precision=POOL_DOT)


@gpu_jit
def pooled_kernel(Vm, Lens, Scratch, Theta, Thr, TailLse, TailValue, Coarse,
                  n, s0, s1, q0, q1,
                  SEL: tl.constexpr, NEAR: tl.constexpr, HAS_TAIL: tl.constexpr, HAS_COARSE: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BI: tl.constexpr, BJ: tl.constexpr,
                  POOL_DOT: tl.constexpr):      # tl.dot input_precision of the p @ vm products
    """The pooled terms of BI query-block rows of one batch * head, by an online softmax over
    chunks of BJ key blocks of the stored scores: the tail (``tail_lse``, ``tail_value``) over
    the blocks :func:`exact_blocks` leaves out, weighted by their live lengths, and the coarse
    branch (a softmax over every block). It is a kernel of its own because inside the select
    kernel its ``p @ vm`` products and accumulators crowded the registers (12.5 % occupancy on
    an H200); here it runs at its own tile sizes (``fused._fused_plan``)."""
    g, i0, ii, row_ok, dims, cols, gn = row_tile(n, BI, HEAD_DIM, BJ)
    thr = tl.zeros([BI], tl.float32)
    theta = tl.zeros([BI], tl.int32)
    if SEL == 0:
        thr = tl.load(Thr + gn + ii, mask=row_ok, other=0.0)
    if SEL == 1:
        theta = tl.load(Theta + gn + ii, mask=row_ok, other=0)
    t_max = tl.full([BI], float("-inf"), tl.float32)
    t_sum = tl.zeros([BI], tl.float32)
    t_acc = tl.zeros([BI, HEAD_DIM], tl.float32)
    c_max = tl.full([BI], float("-inf"), tl.float32)
    c_sum = tl.zeros([BI], tl.float32)
    c_acc = tl.zeros([BI, HEAD_DIM], tl.float32)
    for j0 in range(0, n, BJ):
        jj = j0 + cols
        ok = jj < n
        r = score_tile(Scratch, gn, ii, jj, row_ok, ok, n)
        vm = mean_rows(Vm, gn, jj, ok, HEAD_DIM)
        if HAS_TAIL:
            sel = exact_blocks(r, ii, jj, row_ok, ok, thr, theta, s0, s1, q0, q1, SEL, BI, BJ, NEAR)
            L = tl.load(Lens + jj, mask=ok, other=1)
            # base-2 logits of the pooled tail: scale qm.kmc / ln 2 + log2 L_j
            z = tl.where(sel | ~ok[None, :], float("-inf"), r + tl.log2(L.to(tl.float32))[None, :])
            t_max, t_sum, t_acc = pooled_update(z, t_max, t_sum, t_acc, vm, POOL_DOT)
        if HAS_COARSE:
            # softmax over every block; centred scores differ from scale qm.km by a per-row constant
            z = tl.where(ok[None, :], r, float("-inf"))
            c_max, c_sum, c_acc = pooled_update(z, c_max, c_sum, c_acc, vm, POOL_DOT)
    out = (gn + ii)[:, None] * HEAD_DIM + dims[None, :]
    if HAS_TAIL:
        live = t_sum != 0.0         # a NaN sum (a NaN query token's block) stays NaN, as in the torch path
        lse = tl.where(live, (t_max + tl.log2(tl.where(live, t_sum, 1.0))) * 0.6931471805599453,
                       float("-inf"))
        tl.store(TailLse + gn + ii, lse, mask=row_ok)
        tl.store(TailValue + out, t_acc / tl.where(live, t_sum, 1.0)[:, None], mask=row_ok[:, None])
    if HAS_COARSE:
        tl.store(Coarse + out, c_acc / tl.where(c_sum > 0.0, c_sum, 1.0)[:, None], mask=row_ok[:, None])
