"""The fused Sol-Attn forward kernel: one program per (64-row query block, batch, head).

Each program loads its query block once, walks that block's ``kv_indices`` with an
online softmax in base 2, and writes the finished rows. Nothing is gathered in
memory: key and value rows are read straight from the caller's ``(B, T, H, D)``
tensors, through their strides (pointer loads) or through ``(B, T, H, D)`` TMA
tensor descriptors (``KV_TMA``, sm_90+). A problem with a row table
(``Problem.rows``: VSA's tiled layout over the model's token order) reads its query
rows and gate and writes its output at the table's tokens (``ROWS``), and its keys and
values either the same way (``KV_ROWS``, pointer loads), or from a tiled copy that
:func:`tile_rows` writes for TMA loads, which need a block's rows contiguous.

Two identities keep the inner loop as short as dense flash attention's:

- Centring. ``scale q_t . (k_u - m) = scale q_t . k_u - scale q_t . m``: the second
  term is one constant per query row. A softmax is unchanged when every term of a
  row moves by the same constant, so the loop uses the uncentred logits
  ``scale q_t . k_u + bias_u`` and the tail logit is moved by ``+ scale q_t . m``
  instead; no centred copy of the keys is made and no per-tile subtraction is paid.
- Tail. The pooled terms of one query block sum to one extra key with logit
  ``tail_lse`` and value ``tail_value`` (see ``solattn.routing.Plan``), so the
  online softmax starts from that key: running max = its logit, running sum = 1,
  accumulator = its value. An empty tail (``tail_lse = -inf``) starts from nothing.

The kernel is built from small ``@jit`` pieces (the program's prologue: query block and
starting state; one key block's logits, the online-softmax update, the epilogue); the backward
kernels (``backward.py``) read their query and key blocks and recompute logits with the same pieces.

Every function here is a compiled ``JITFunction`` (:func:`solattn.triton_runtime.jit.gpu_jit`),
launched on the GPU or in Triton's CPU interpreter through
:func:`solattn.triton_runtime.jit.compiled`.
"""

from __future__ import annotations

import math

import triton.language as tl

from ...triton_runtime.jit import gpu_jit

LOG2E = math.log2(math.e)


@gpu_jit
def query_rows(Q, Rows, BlockLen, q_block, b, h, sqb, sqt, sqh, sqd, T,
               HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """This program's query rows: ``(q, tok_q, row_ok, src, q_live)``: ``tok_q`` the problem's rows,
    ``src`` the tokens of Q they read (``Rows[tok_q]`` with ROWS, the row table of
    ``Problem.rows``; else ``tok_q``), ``q_live`` the live ones; dead rows read as zeros (never
    through the table), so their outputs are unspecified but finite."""
    rows = tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    tok_q = q_block * BLOCK + rows
    row_ok = tok_q < T
    q_live = row_ok & (rows < tl.load(BlockLen + q_block))
    if ROWS:
        src = tl.load(Rows + tok_q, mask=q_live, other=0)
    else:
        src = tok_q.to(tl.int64)
    q_ptrs = Q + b * sqb + h * sqh + src[:, None] * sqt + dims[None, :] * sqd
    q = tl.load(q_ptrs, mask=q_live[:, None], other=0.0)
    return q, tok_q, row_ok, src, q_live


@gpu_jit
def start_state(q, KeyMean, TailLse, TailValue, bh, plan_row, qk_scale,
                HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, HAS_TAIL: tl.constexpr):
    """Online-softmax state ``(m, l, acc)`` before the first key block: the tail key, or nothing."""
    dims = tl.arange(0, HEAD_DIM)
    if HAS_TAIL:
        # per-row shift that stands in for centring the keys (base-2 units)
        key_mean = tl.load(KeyMean + bh.to(tl.int64) * HEAD_DIM + dims)
        shift = tl.sum(q.to(tl.float32) * key_mean[None, :], 1) * qk_scale
        tail_lse = tl.load(TailLse + plan_row)
        # only -inf is an empty tail: a NaN tail (a NaN query token in the block) stays NaN
        tail_empty = tail_lse == float("-inf")
        m_i = shift + tail_lse * 1.4426950408889634
        l_i = tl.where(tail_empty, 0.0, 1.0) + tl.full([BLOCK], 0.0, tl.float32)
        tail_value = tl.load(TailValue + plan_row * HEAD_DIM + dims)
        acc = tl.where(tail_empty, 0.0, tail_value)[None, :] + tl.full([BLOCK, HEAD_DIM], 0.0, tl.float32)
    else:
        m_i = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        l_i = tl.full([BLOCK], 0.0, tl.float32)
        acc = tl.full([BLOCK, HEAD_DIM], 0.0, tl.float32)
    return m_i, l_i, acc


@gpu_jit
def program_ids(n_blocks, long_lo, long_n, LONG_FIRST: tl.constexpr):
    """``(query block, b*H + h)`` of this program. GPUs start programs in about the order of their
    linear id (grid axis 0 fastest). With LONG_FIRST the ``long_n`` query blocks from ``long_lo``
    on, which attend every key block (``sink_q``: VSA's prefix tiles, 9x the work of a video tile
    at H3), take the first ids for every batch * head, then the rest follow head by head. In grid
    order the last heads' long programs would start near the end and run on alone after every
    other program had finished (longest work first is the classic cure)."""
    q_block = tl.program_id(0)
    bh = tl.program_id(1)
    if LONG_FIRST:
        t = bh * n_blocks + q_block
        n_long = long_n * tl.num_programs(1)
        if t < n_long:
            bh = t // long_n
            q_block = long_lo + t % long_n
        else:
            u = t - n_long
            bh = u // (n_blocks - long_n)
            q_block = u % (n_blocks - long_n)
            q_block = tl.where(q_block >= long_lo, q_block + long_n, q_block)
    return q_block, bh


@gpu_jit
def program_start(Q, Rows, KvNum, KvIdx, BlockLen, KeyMean, TailLse, TailValue, sqb, sqt, sqh, sqd,
                  T, H, n_blocks, max_blocks, qk_scale, long_lo, long_n,
                  HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, HAS_TAIL: tl.constexpr, ROWS: tl.constexpr,
                  LONG_FIRST: tl.constexpr):
    """Everything a program knows before its key loop, from its program ids (:func:`program_ids`):
    ``(bh, b, h, plan_row, q, tok_q, row_ok, q_live, m, l, acc, count, idx_row)``, where
    ``plan_row`` is the flat index of (b, h, query block) in the plan, ``q_live`` as
    :func:`query_rows` gives it, ``count`` its number of listed key blocks and ``idx_row`` the
    pointer to their indices."""
    q_block, bh = program_ids(n_blocks, long_lo, long_n, LONG_FIRST)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    plan_row = bh.to(tl.int64) * n_blocks + q_block
    q, tok_q, row_ok, _src, q_live = query_rows(Q, Rows, BlockLen, q_block, b, h, sqb, sqt, sqh, sqd, T,
                                                HEAD_DIM, BLOCK, ROWS)
    m_i, l_i, acc = start_state(q, KeyMean, TailLse, TailValue, bh, plan_row, qk_scale,
                                HEAD_DIM, BLOCK, HAS_TAIL)
    count = tl.load(KvNum + plan_row)
    idx_row = KvIdx + plan_row * max_blocks
    return bh, b, h, plan_row, q, tok_q, row_ok, q_live, m_i, l_i, acc, count, idx_row


@gpu_jit
def block_logits(q, k, tok_k, live, bias_row, qk_scale, HAS_BIAS: tl.constexpr):
    """Base-2 logits of the query block against one key block; dead keys are -inf."""
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if HAS_BIAS:
        bias = tl.load(bias_row + tok_k, mask=live, other=0.0)
        # a huge finite bias (an fp32 finfo.min "mask") must stay finite in base 2
        bias = tl.where(bias == float("-inf"), bias, tl.minimum(tl.maximum(bias, -1e30), 1e30))
        s = s + bias[None, :] * 1.4426950408889634
    return tl.where(live[None, :], s, float("-inf"))


@gpu_jit
def key_rows(K, V, Rows, KvIdx_row, step, bh, b, h, skb, skt, skh, skd, svb, svt, svh, svd, BlockLen, T, H,
             HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, KV_TMA: tl.constexpr, TMA_LEN: tl.constexpr,
             KV_ROWS: tl.constexpr, LEN_CODE: tl.constexpr, DEAD_ZERO: tl.constexpr = False):
    """The ``step``-th listed key block: ``(k, v, tok_k, live, ragged)``, ``live`` its key rows that
    are keys and ``ragged`` whether any is not (a block cut by T or by block_len). K and V are both
    asked for here, before the caller's softmax, which gives their loads the whole step to land
    (4 % faster at H3 on an H200 than loading V after the softmax). With KV_ROWS the live rows are
    read at their tokens ``Rows[tok_k]`` (pointer loads: a block's rows are not contiguous). With
    LEN_CODE the list's entries are :func:`len_codes`: the block's dead rows travel with its index.
    With DEAD_ZERO (pointer loads: dead rows hold zeros) the loads wait on no length: only rows
    past T are masked, and ``live`` (from block_len) is first needed by the logits' mask."""
    rows = tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    entry = tl.load(KvIdx_row + step)
    kv_block = entry
    if LEN_CODE:
        kv_block = entry & 0xFFFF
    tok_k = (kv_block * BLOCK + rows).to(tl.int64)
    if KV_TMA and not TMA_LEN:
        # without block_len the only dead rows are past T, which the descriptor zero-fills
        live = tok_k < T
        ragged = kv_block * BLOCK + BLOCK > T
    elif LEN_CODE:
        blen = BLOCK - (entry >> 16)
        live = rows < blen
        ragged = blen < BLOCK
    else:
        blen = tl.load(BlockLen + kv_block)
        live = rows < blen                                   # dead rows are never keys
        ragged = blen < BLOCK
    if KV_TMA:
        # with TMA_LEN the dead rows are read (Problem.dead_rows_zero: they hold zeros)
        k = K.load([bh // H, kv_block * BLOCK, bh % H, 0]).reshape(BLOCK, HEAD_DIM)
        v = V.load([bh // H, kv_block * BLOCK, bh % H, 0]).reshape(BLOCK, HEAD_DIM)
    else:
        if KV_ROWS:
            src = tl.load(Rows + tok_k, mask=live, other=0)
        else:
            src = tok_k
        load_ok = live
        if DEAD_ZERO:
            load_ok = tok_k < T
        k = tl.load(K + b * skb + h * skh + src[:, None] * skt + dims[None, :] * skd,
                    mask=load_ok[:, None], other=0.0)
        v = tl.load(V + b * svb + h * svh + src[:, None] * svt + dims[None, :] * svd,
                    mask=load_ok[:, None], other=0.0)
    return k, v, tok_k, live, ragged


@gpu_jit
def raw_logits(q, k, live, ragged):
    """``q . k`` of one key block, dead keys -inf; the mask is paid only by a ragged block, behind
    one scalar branch (2 % of the kernel's time at H3 on an H200 when every block paid it)."""
    s = tl.dot(q, tl.trans(k))
    if ragged:
        s = tl.where(live[None, :], s, float("-inf"))
    return s


@gpu_jit
def logits(q, k, tok_k, live, ragged, bias_row, qk_scale, HAS_BIAS: tl.constexpr, FOLD_SCALE: tl.constexpr):
    """One key block's logits as :func:`softmax_update` takes them: the raw ``q . k`` with
    ``FOLD_SCALE`` (no bias, positive scale), else the scaled and biased base-2 logits."""
    if FOLD_SCALE:
        s = raw_logits(q, k, live, ragged)
    else:
        s = block_logits(q, k, tok_k, live, bias_row, qk_scale, HAS_BIAS)
    return s


@gpu_jit
def softmax_update(s, m_i, l_i, qk_scale, FOLD_SCALE: tl.constexpr):
    """Fold one block of logits into the running max and sum: ``(p, alpha, m_new, l_new)``;
    the caller rescales its accumulator by ``alpha`` and adds ``p @ v``.

    ``s`` is in base-2 units, or with ``FOLD_SCALE`` the raw ``q . k`` (dead keys -inf) still to be
    multiplied by ``qk_scale > 0``: the row max is then scaled once per row (a positive scale keeps
    the order) and each term's scale and shift are one fused multiply-add, one multiply per logit
    fewer in a loop whose elementwise work is what the tensor cores wait for (3 % of the kernel's
    time at H3 on an H200, 8.97 -> 8.68 ms at top-k 10 %)."""
    if FOLD_SCALE:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row with nothing finite yet keeps m = -inf; subtract 0 there to avoid inf - inf
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_ref)
    if FOLD_SCALE:
        p = tl.math.exp2(s * qk_scale - m_ref[:, None])
    else:
        p = tl.math.exp2(s - m_ref[:, None])
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_new


@gpu_jit
def attend(q, k, v, tok_k, live, ragged, m_i, l_i, acc, bias_row, qk_scale,
           HAS_BIAS: tl.constexpr, FOLD_SCALE: tl.constexpr):
    """One step of the key loop: fold key block ``k``, ``v`` into the online softmax ``(m, l, acc)``."""
    s = logits(q, k, tok_k, live, ragged, bias_row, qk_scale, HAS_BIAS, FOLD_SCALE)
    p, alpha, m_i, l_i = softmax_update(s, m_i, l_i, qk_scale, FOLD_SCALE)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_i, l_i, acc


@gpu_jit
def write_rows(Out, Gate, Coarse, acc, l_i, tok_out, out_ok, b, h, plan_row, T_out, H,
               sgb, sgt, sgh, sgd, HEAD_DIM: tl.constexpr, HAS_COARSE: tl.constexpr):
    """Normalise, add the coarse term, store into the contiguous ``(B, T_out, H, D)`` output at
    tokens ``tok_out`` (rows ``out_ok``; the gate is read at the same tokens).

    Returns the stored rows' rounding residual ``fine - (out - coarse term)`` in fp32 (``fine`` the
    attention part before rounding, the coarse term as rounded here): the stored output plus that
    residual gives the backward the unrounded attention output (its ``delta``)."""
    dims = tl.arange(0, HEAD_DIM)
    # a row whose terms are all -inf has l = 0 (and acc = 0): it returns 0, not NaN
    fine = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    out = fine.to(Out.dtype.element_ty)
    resid = fine - out.to(tl.float32)
    if HAS_COARSE:
        g_ptrs = Gate + b * sgb + h * sgh + tok_out[:, None] * sgt + dims[None, :] * sgd
        gate = tl.load(g_ptrs, mask=out_ok[:, None], other=0.0).to(tl.float32)
        coarse = tl.load(Coarse + plan_row * HEAD_DIM + dims)
        # added after the cast to v's dtype (the spec's order): round both terms, add in fp32,
        # round once more, which is what a bf16/fp16 add does (and the interpreter's does not)
        coarse_term = (gate * coarse[None, :]).to(Out.dtype.element_ty)
        out = (out.to(tl.float32) + coarse_term.to(tl.float32)).to(Out.dtype.element_ty)
        resid = fine - (out.to(tl.float32) - coarse_term.to(tl.float32))
    o_ptrs = Out + ((b * T_out + tok_out[:, None]) * H + h) * HEAD_DIM + dims[None, :]
    tl.store(o_ptrs, out, mask=out_ok[:, None])
    return resid


@gpu_jit
def sol_attn_fwd(
    Q, K, V, Out, Gate,
    KvNum, KvIdx, BlockLen, KeyMean, TailLse, TailValue, Coarse, KeyBias, Lse, Resid, Rows,
    sqb, sqt, sqh, sqd,
    skb, skt, skh, skd,
    svb, svt, svh, svd,
    sgb, sgt, sgh, sgd,
    s_bias_b,
    T, T_out, H, n_blocks, max_blocks,
    qk_scale,                      # scale * log2(e): logits are kept in base 2
    long_lo, long_n,               # query blocks that attend every key block (LONG_FIRST)
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,           # 64: the routing block, query rows per program, keys per step
    HAS_TAIL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_COARSE: tl.constexpr,
    KV_TMA: tl.constexpr,          # K, V are (B, T, H, D) TMA descriptors (no block_len) instead of pointers
    FOLD_SCALE: tl.constexpr,      # no key_bias and qk_scale > 0: scale folded into the softmax's FMA
    TMA_LEN: tl.constexpr = False,    # KV_TMA with block_len (its dead rows hold zeros)
    WRITE_LSE: tl.constexpr = False,  # also store each row's base-2 log-sum-exp and the output's
                                      # rounding residual (for the backward)
    ROWS: tl.constexpr = False,       # Q and Gate are read, Out written at the row table's tokens
                                      # (Problem.rows; Out and Gate have T_out tokens, the rest T rows)
    KV_ROWS: tl.constexpr = False,    # K and V are read through the row table too (pointer loads)
    LONG_FIRST: tl.constexpr = False,  # the long_n query blocks from long_lo on run first (program_ids)
    LEN_CODE: tl.constexpr = False,   # KvIdx holds len_codes (block_len with TMA loads)
):
    bh, b, h, plan_row, q, tok_q, row_ok, q_live, m_i, l_i, acc, count, idx_row = program_start(
        Q, Rows, KvNum, KvIdx, BlockLen, KeyMean, TailLse, TailValue, sqb, sqt, sqh, sqd,
        T, H, n_blocks, max_blocks, qk_scale, long_lo, long_n, HEAD_DIM, BLOCK, HAS_TAIL, ROWS, LONG_FIRST)
    rows = tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    bias_row = KeyBias + b * s_bias_b
    for step in range(0, count):
        k, v, tok_k, live, ragged = key_rows(K, V, Rows, idx_row, step, bh, b, h, skb, skt, skh, skd,
                                             svb, svt, svh, svd, BlockLen, T, H, HEAD_DIM, BLOCK, KV_TMA,
                                             TMA_LEN, KV_ROWS, LEN_CODE)
        m_i, l_i, acc = attend(q, k, v, tok_k, live, ragged, m_i, l_i, acc, bias_row, qk_scale,
                               HAS_BIAS, FOLD_SCALE)

    out_ok = row_ok
    src = tok_q.to(tl.int64)
    if ROWS:       # only live rows are written: a dead row has no token of its own
        out_ok = q_live
        # the tokens again rather than kept through the key loop (registers are what it runs short of)
        src = tl.load(Rows + tok_q, mask=q_live, other=0)
    resid = write_rows(Out, Gate, Coarse, acc, l_i, src, out_ok, b, h, plan_row, T_out, H,
                       sgb, sgt, sgh, sgd, HEAD_DIM, HAS_COARSE)
    if WRITE_LSE:
        # the residual in the problem's rows (T of them; Resid's layout and dtype): output + residual
        # is the unrounded attention output to about 2^-16 relative, which flash attention's delta needs
        r_ptrs = Resid + ((b * T + tok_q.to(tl.int64)[:, None]) * H + h) * HEAD_DIM + dims[None, :]
        tl.store(r_ptrs, resid.to(Resid.dtype.element_ty), mask=row_ok[:, None])
        # log2 of the softmax denominator over everything the row saw (exact keys and the tail
        # key), in the uncentred base-2 units of the loop; -inf for a row whose terms were all -inf.
        # Layout (B * H, n * BLOCK): row plan_row * BLOCK + r, dead and past-T rows included.
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(Lse + plan_row * BLOCK + rows, lse)


#: the most tensors one :func:`tile_rows` launch copies
TILE_ROWS_MAX = 5


@gpu_jit(do_not_specialize=["O1", "O2", "O3", "O4"])
def tile_rows(X, Y, Rows, BlockLen, O1, O2, O3, O4, sxb, sxt, sxh, sxd, T, H,
              HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """One block of rows (program ids: block, b*H + h, tensor) of one of up to five tensors of one
    dtype and strides, read at the row table's tokens into its part of Y, their contiguous ``(N, B,
    T, H, D)`` tiled copies, zeros in the dead rows: what TMA loads read for a problem with a row
    table (``sol_attn_fwd``'s k and v; the backward's q, k, v, gate and dO). Tensor t starts ``Ot``
    elements after X (tensor 0); the offsets are not specialised on (they change every call)."""
    j = tl.program_id(0)
    bh = tl.program_id(1)
    t = tl.program_id(2)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    off = tl.where(t == 1, O1, tl.where(t == 2, O2, tl.where(t == 3, O3, tl.where(t == 4, O4, 0))))
    x, tok, row_ok, _src, _live = query_rows(X + off, Rows, BlockLen, j, b, h, sxb, sxt, sxh, sxd, T, HEAD_DIM,
                                             BLOCK, True)
    B = tl.num_programs(1) // H
    dst = ((t * B + b) * T + tok.to(tl.int64)[:, None]) * H * HEAD_DIM + h * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    tl.store(Y + dst, x, mask=row_ok[:, None])


@gpu_jit
def len_codes(KvNum, KvIdx, BlockLen, Codes, max_blocks, W: tl.constexpr, BLOCK: tl.constexpr):
    """The listed key blocks of one plan row (program id) with their dead rows: ``index | (BLOCK -
    live length) << 16`` (indices below 2 ** 16), what ``sol_attn_fwd`` reads with LEN_CODE. Read from
    block_len inside the key loop, the length was a second load behind the index, and it made
    Triton's pipeliner keep the TMA loads of k and v two stages deep instead of three."""
    row = tl.program_id(0).to(tl.int64)
    count = tl.load(KvNum + row)
    for i0 in range(0, count, W):
        i = i0 + tl.arange(0, W)
        ok = i < count
        idx = tl.load(KvIdx + row * max_blocks + i, mask=ok, other=0)
        dead = BLOCK - tl.load(BlockLen + idx, mask=ok, other=BLOCK)
        tl.store(Codes + row * max_blocks + i, idx | (dead << 16), mask=ok)
