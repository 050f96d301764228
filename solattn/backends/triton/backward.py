"""The fused backward of the ``triton`` backend: two kernels that walk the routing plan.

The forward (``kernel.sol_attn_fwd`` with ``WRITE_LSE``) stores each row's base-2 log-sum-exp
``lse_t`` over everything its softmax covered, in the kernel's own units: uncentred exact logits
``c q_t . k_u + bias_u log2(e)`` (``c = scale log2(e)``) and the tail key's logit
``c q_t . m + tail_lse_i log2(e)``. Any probability of the row is then ``exp2(logit - lse_t)``,
so the backward recomputes the logits of a block pair and never a softmax.

With ``O_t`` the normalised attention output before the coarse term, ``dO_t`` the output's
gradient and ``delta_t = dO_t . O_t``, a logit's natural-log gradient is ``p (dO_t . value - delta_t)``
(flash attention's identity; the tail key's value is ``tail_value_i``). The kernels:

- :func:`sol_attn_bwd_dq`, one program per (64-row query block, b*H + h), walks the block's
  ``kv_indices``: ``delta`` first (from the forward's output less the rounded coarse term plus
  the forward's rounding residual, stored for the other kernel), then ``dq``; it also finishes what belongs to the query block:
  the tail key's gradients (its ``dq`` term ``dlogit_tail scale m`` enters through centred keys:
  ``dq_t = scale sum_u ds_tu (k_u - m)``, exact because a row's logit gradients sum to zero; and the per-block sums
  ``dtail_lse_i = sum_t dlogit_tail_t``, ``dtail_value_i = sum_t p_tail_t dO_t``,
  ``dm_i = sum_t dlogit_tail_t scale q_t``) and the coarse term's (``dgate_t = dO_t coarse_i``,
  ``dcoarse_i = sum_t gate_t dO_t``).
- :func:`sol_attn_bwd_dkdv`, one program per (64-key block, b*H + h), walks the transposed
  lists (the query blocks whose list holds this key block, :meth:`solattn.routing.Plan.query_lists`)
  and accumulates ``dk``, ``dv`` and, for a float key bias, ``dbias``; no atomics. With a
  coarse term it also adds the block means' gradients to the block's live rows of ``dk``,
  ``dv`` and ``dq`` (``POOLED``).

Between the two, :func:`coarse_row_grads` carries ``dcoarse`` through the coarse term's softmax
over the block means (:mod:`solattn.backends.triton.coarse_kernels`: two kernels at block
granularity; the torch products of :mod:`solattn.routing.coarse_grad` where those cannot run),
so the coarse branch needs neither a rebuilt plan nor an autograd graph. The tail's block-level
sums are ``(B, H, n, ...)`` tensors: :func:`fused_backward` hands them to the caller (the op
layer), which back-propagates them through the plan's differentiable block means and tail terms
with torch autograd. Dead query rows (``block_len``) get zero gradients and send none to keys;
dead keys get zero gradients. The kernels read the problem's rows as they are: a problem with a
row table (``Problem.rows``) is refused, VSA's backward takes tiled copies
(:class:`solattn.op.route.VideoRoute`: a row index loaded in both kernels' inner loops cost about
a fifth of their time on an H200). Their inner loops load blocks (k and v in the dq kernel, q
and dO in the dkdv kernel) through ``(B, T, H, D)`` TMA descriptors where the forward would
(``BackwardConfig.tma``), else through pointers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton.language as tl

from ...config import current_tuning, graph_recording
from ...triton_runtime import interpretable
from ...triton_runtime.jit import compiled, gpu_jit
from ...validation import BLOCK, Problem
from .coarse_kernels import coarse_kernels_pay, coarse_kernels_usable, fused_coarse_row_grads
from .kernel import LOG2E, key_rows, logits, program_ids, query_rows
from .operands import kernel_operands, tma_descriptors, tma_layout_ok, tma_ok
from .tuning import BackwardConfig, TritonTuning


def lse_shape(B: int, T: int, H: int) -> Tuple[int, int, int]:
    """Shape of the forward's log-sum-exp buffer: ``(B, H, n * 64)``, one entry per row of every
    query block (dead and past-T rows included), fp32, base 2."""
    return (B, H, -(-T // BLOCK) * BLOCK)


@gpu_jit
def sol_attn_bwd_dq(
    Q, K, V, KD, VD, Out, Resid, DO, Gate, DQ, DGate, Lse, Delta,
    KvNum, KvIdx, BlockLen, KeyMean, TailLse, TailValue, Coarse, KeyBias,
    DTailLse, DTailValue, DCoarse, DKeyMean, Means, Rows,
    sqb, sqt, sqh, sqd,
    skb, skt, skh, skd,
    svb, svt, svh, svd,
    sdb, sdt, sdh, sdd,
    sgb, sgt, sgh, sgd,
    s_bias_b,
    T, T_out, H, n_blocks, max_blocks,
    qk_scale, scale, long_lo, long_n,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
    HAS_TAIL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_COARSE: tl.constexpr,
    LONG_FIRST: tl.constexpr, FOLD_SCALE: tl.constexpr, DEAD_ZERO: tl.constexpr,
    BLOCK_TMA: tl.constexpr, TMA_LEN: tl.constexpr, OUT_ROWS: tl.constexpr,
):
    q_block, bh = program_ids(n_blocks, long_lo, long_n, LONG_FIRST)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    plan_row = bh.to(tl.int64) * n_blocks + q_block
    rows = tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    q, tok_q, row_ok, src, q_live = query_rows(Q, Q, BlockLen, q_block, b, h, sqb, sqt, sqh, sqd, T,
                                               HEAD_DIM, BLOCK, False)
    # dead rows' outputs are unspecified: their gradient is dropped here, so nothing flows from them
    do = tl.load(DO + b * sdb + h * sdh + src[:, None] * sdt + dims[None, :] * sdd,
                 mask=q_live[:, None], other=0.0)
    do32 = do.to(tl.float32)
    out_off = ((b * T + src) * H + h) * HEAD_DIM                  # contiguous (B, T, H, D)
    # the output and the gradients: (B, T_out, H, D), in the caller's token order with OUT_ROWS
    # (Rows[r] the token of live row r; dead rows have no token and are neither read nor written)
    own_off, own_ok = out_off, row_ok
    if OUT_ROWS:
        own_off = ((b * T_out + tl.load(Rows + src, mask=q_live, other=0)) * H + h) * HEAD_DIM
        own_ok = q_live
    if HAS_COARSE:
        gate = tl.load(Gate + b * sgb + h * sgh + src[:, None] * sgt + dims[None, :] * sgd,
                       mask=q_live[:, None], other=0.0).to(tl.float32)
        coarse = tl.load(Coarse + plan_row * HEAD_DIM + dims)
        tl.store(DGate + own_off[:, None] + dims[None, :], (do32 * coarse[None, :]).to(DGate.dtype.element_ty),
                 mask=own_ok[:, None])
        tl.store(DCoarse + plan_row * HEAD_DIM + dims, tl.sum(gate * do32, 0))
        # the block means of q, k, v over the live rows, which the coarse term's gradient needs
        # (Means: fp32 (3, B, H, n, D)); this program's rows are key block q_block's as well
        inv_len = 1.0 / tl.load(BlockLen + q_block).to(tl.float32)
        k_own = tl.load(K + b * skb + h * skh + src[:, None] * skt + dims[None, :] * skd,
                        mask=q_live[:, None], other=0.0)
        v_own = tl.load(V + b * svb + h * svh + src[:, None] * svt + dims[None, :] * svd,
                        mask=q_live[:, None], other=0.0)
        means = Means + plan_row * HEAD_DIM + dims
        part = tl.num_programs(1).to(tl.int64) * n_blocks * HEAD_DIM
        tl.store(means, tl.sum(q.to(tl.float32), 0) * inv_len)
        tl.store(means + part, tl.sum(k_own.to(tl.float32), 0) * inv_len)
        tl.store(means + 2 * part, tl.sum(v_own.to(tl.float32), 0) * inv_len)
    # flash attention's delta, dO . O, with O the unrounded attention output: the stored output,
    # less the coarse term as the forward rounded it, plus the forward's rounding residual
    o = tl.load(Out + own_off[:, None] + dims[None, :], mask=q_live[:, None], other=0.0).to(tl.float32)
    if HAS_COARSE:
        o = o - (gate * coarse[None, :]).to(Out.dtype.element_ty).to(tl.float32)
    o += tl.load(Resid + out_off[:, None] + dims[None, :], mask=q_live[:, None], other=0.0).to(tl.float32)
    delta = tl.sum(o * do32, 1)
    lse = tl.load(Lse + plan_row * BLOCK + rows)
    lse = tl.where(lse == float("-inf"), float("inf"), lse)            # no finite term: every p is 0

    dq = tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32)
    key_mean = tl.load(KeyMean + bh.to(tl.int64) * HEAD_DIM + dims)
    count = tl.load(KvNum + plan_row)
    idx_row = KvIdx + plan_row * max_blocks
    bias_row = KeyBias + b * s_bias_b
    ds_sum = tl.zeros([BLOCK], dtype=tl.float32)
    for step in range(0, count):
        # the forward's loads of the listed block: TMA, or pointers (dead rows zeros, never keys)
        k, v, tok_k, live, ragged = key_rows(KD, VD, K, idx_row, step, bh, b, h, skb, skt, skh, skd,
                                             svb, svt, svh, svd, BlockLen, T, H, HEAD_DIM, BLOCK, BLOCK_TMA,
                                             TMA_LEN, False, False, DEAD_ZERO)
        s = logits(q, k, tok_k, live, ragged, bias_row, qk_scale, HAS_BIAS, FOLD_SCALE)
        if FOLD_SCALE:
            p = tl.math.exp2(s * qk_scale - lse[:, None])
        else:
            p = tl.math.exp2(s - lse[:, None])
        dp = tl.dot(do, tl.trans(v))
        ds = (p * (dp - delta[:, None])).to(k.dtype)
        dq += tl.dot(ds, k)
        ds_sum += tl.sum(ds.to(tl.float32), 1)
    # dq against centred keys: a row's logit gradients (tail key included) sum to zero, so
    # sum_u ds_u k_u + ds_tail m = sum_u ds_u (k_u - m). Uncentred, a large common key offset
    # would make both terms large and the bf16-rounded ds would leave their difference noisy;
    # sum_u ds_u (k_u - m) = sum_u ds_u k_u - (sum_u ds_u) m with the same rounded ds, the
    # products accumulated in fp32, is that centred sum without a centred copy of each key block
    # (an fp32 subtraction and two casts per key element per step)
    dq = dq - ds_sum[:, None] * key_mean[None, :]

    if HAS_TAIL:
        q32 = q.to(tl.float32)
        shift = tl.sum(q32 * key_mean[None, :], 1) * qk_scale
        tail_lse = tl.load(TailLse + plan_row)
        tail_value = tl.load(TailValue + plan_row * HEAD_DIM + dims)
        p_tail = tl.math.exp2(shift + tail_lse * 1.4426950408889634 - lse)   # 0 for an empty tail
        p_tail = tl.where(q_live, p_tail, 0.0)
        dp_tail = tl.sum(do32 * tail_value[None, :], 1)
    tl.store(Delta + plan_row * BLOCK + rows, delta)
    dq = dq * scale
    if HAS_TAIL:
        dl_tail = p_tail * (dp_tail - delta)                                  # natural-log logit
        # (its share of dq, dl_tail scale m, is in the centred keys above)
        tl.store(DTailLse + plan_row, tl.sum(dl_tail, 0))
        tl.store(DTailValue + plan_row * HEAD_DIM + dims, tl.sum(p_tail[:, None] * do32, 0))
        tl.store(DKeyMean + plan_row * HEAD_DIM + dims, tl.sum((dl_tail * scale)[:, None] * q32, 0))
    tl.store(DQ + own_off[:, None] + dims[None, :], dq.to(DQ.dtype.element_ty), mask=own_ok[:, None])


@gpu_jit
def sol_attn_bwd_dkdv(
    Q, K, V, DO, DQ, DK, DV, DBias, Lse, Delta,
    QNum, QIdx, BlockLen, KeyBias, DQMean, DKMean, DVMean, Rows,
    sqb, sqt, sqh, sqd,
    skb, skt, skh, skd,
    svb, svt, svh, svd,
    sdb, sdt, sdh, sdd,
    s_bias_b,
    T, T_out, H, n_blocks, max_q_blocks,
    qk_scale, scale, long_lo, long_n,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr, POOLED: tl.constexpr,
    LONG_FIRST: tl.constexpr, FOLD_SCALE: tl.constexpr, DEAD_ZERO: tl.constexpr,
    BLOCK_TMA: tl.constexpr, TMA_LEN: tl.constexpr, OUT_ROWS: tl.constexpr,
):
    kv_block, bh = program_ids(n_blocks, long_lo, long_n, LONG_FIRST)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    plan_row = bh.to(tl.int64) * n_blocks + kv_block
    rows = tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    tok_k = (kv_block * BLOCK + rows).to(tl.int64)
    k_len = tl.load(BlockLen + kv_block)
    live = rows < k_len
    ragged = k_len < BLOCK
    k = tl.load(K + b * skb + h * skh + tok_k[:, None] * skt + dims[None, :] * skd, mask=live[:, None], other=0.0)
    v = tl.load(V + b * svb + h * svh + tok_k[:, None] * svt + dims[None, :] * svd, mask=live[:, None], other=0.0)
    if HAS_BIAS:
        bias = tl.load(KeyBias + b * s_bias_b + tok_k, mask=live, other=0.0)
        bias = tl.where(bias == float("-inf"), bias, tl.minimum(tl.maximum(bias, -1e30), 1e30))
        bias2 = bias * 1.4426950408889634
    dk = tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32)
    dbias = tl.zeros([BLOCK], dtype=tl.float32)
    count = tl.load(QNum + plan_row)
    idx_row = QIdx + plan_row * max_q_blocks
    stat_base = bh.to(tl.int64) * n_blocks * BLOCK
    for step in range(0, count):
        # the listed query block's q and dO, loaded as the dq kernel loads its k and v (TMA
        # descriptors Q and DO with BLOCK_TMA, else pointers; dead rows zeros, never queries)
        q, do, tok_q, _q_live, _ = key_rows(Q, DO, K, idx_row, step, bh, b, h, sqb, sqt, sqh, sqd,
                                            sdb, sdt, sdh, sdd, BlockLen, T, H, HEAD_DIM, BLOCK, BLOCK_TMA,
                                            TMA_LEN, False, False, DEAD_ZERO)
        stat_row = stat_base + tok_q
        lse = tl.load(Lse + stat_row)
        lse = tl.where(lse == float("-inf"), float("inf"), lse)
        delta = tl.load(Delta + stat_row)                       # 0 on dead rows (their dO is 0)
        s_t = tl.dot(k, tl.trans(q))                            # (keys, queries)
        if FOLD_SCALE:        # raw logits, the scale in the exponent's FMA (as the forward's softmax)
            if ragged:
                s_t = tl.where(live[:, None], s_t, float("-inf"))
            p_t = tl.math.exp2(s_t * qk_scale - lse[None, :])
        else:
            s_t = s_t * qk_scale                                # base 2
            if HAS_BIAS:
                s_t = s_t + bias2[:, None]
            s_t = tl.where(live[:, None], s_t, float("-inf"))
            p_t = tl.math.exp2(s_t - lse[None, :])
        dv += tl.dot(p_t.to(do.dtype), do)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q)
        if BIAS_GRAD:
            dbias += tl.sum(ds_t, 1)
    dk = dk * scale
    out_off = ((b * T + tok_k) * H + h) * HEAD_DIM
    in_t = tok_k < T
    if OUT_ROWS:       # the caller's token order (see sol_attn_bwd_dq): live rows only
        out_off = ((b * T_out + tl.load(Rows + tok_k, mask=live, other=0)) * H + h) * HEAD_DIM
        in_t = live
    if POOLED:
        # the block means' gradients (coarse branch), one share per live row; the rows of this
        # block are also those of query block kv_block, whose dq the other kernel has written
        pooled = plan_row * HEAD_DIM + dims
        dk += tl.where(live[:, None], tl.load(DKMean + pooled)[None, :], 0.0)
        dv += tl.where(live[:, None], tl.load(DVMean + pooled)[None, :], 0.0)
        dq_ptrs = DQ + out_off[:, None] + dims[None, :]
        dq = tl.load(dq_ptrs, mask=live[:, None], other=0.0).to(tl.float32)
        dq += tl.load(DQMean + pooled)[None, :]
        tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=live[:, None])
    tl.store(DK + out_off[:, None] + dims[None, :], dk.to(DK.dtype.element_ty), mask=in_t[:, None])
    tl.store(DV + out_off[:, None] + dims[None, :], dv.to(DV.dtype.element_ty), mask=in_t[:, None])
    if BIAS_GRAD:
        tl.store(DBias + plan_row * BLOCK + rows, dbias)


def coarse_row_grads(problem: Problem, plan, means: torch.Tensor, dcoarse: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """The coarse branch's share of a live row's ``(dq, dk, dv)`` in each block, fp32 contiguous
    ``(B * H, n, D)``: its gradient ``dcoarse`` ``(B * H, n, D)`` carried through the softmax over the
    block means ``means`` (``(3, B * H, n, D)``: those of q, k, v; both from
    :func:`sol_attn_bwd_dq`), see :func:`solattn.routing.coarse_grad.coarse_block_grads`: by two
    Triton kernels (:mod:`.coarse_kernels`) where they can run and pay (up to ``MAX_BLOCKS``
    blocks), else by those torch products."""
    if coarse_kernels_usable(means) and coarse_kernels_pay(means.shape[2]):
        return fused_coarse_row_grads(means, dcoarse, plan.block_len, problem.scale)
    from ...routing.coarse_grad import coarse_block_grads, per_rows
    return per_rows(coarse_block_grads(means[0], means[1], means[2], dcoarse, problem.scale), plan.block_len)


def _block_range(blocks) -> Tuple[int, int]:
    """``[lo, hi)`` as ``(lo, hi - lo)``; ``(0, 0)`` for None."""
    lo, hi = blocks or (0, 0)
    return lo, hi - lo


@dataclass
class FusedGrads:
    """What :func:`fused_backward` returns. Token-level gradients in the inputs' dtypes, the
    coarse branch's included (``dgate`` and ``dbias`` only when asked for: ``dbias`` fp32 ``(B, T)``
    summed over heads); the tail's block-level sums fp32 ``(B, H, n)`` / ``(B, H, n, D)`` /
    ``(B, H, 1, D)``, ``None`` without a tail."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dgate: Optional[torch.Tensor]
    dbias: Optional[torch.Tensor]
    dtail_lse: Optional[torch.Tensor]
    dtail_value: Optional[torch.Tensor]
    dkey_mean: Optional[torch.Tensor]


def fused_backward(problem: Problem, plan, out: torch.Tensor, lse: torch.Tensor, resid: torch.Tensor,
                   grad_out: torch.Tensor, bias_grad: bool = False,
                   config: Optional[BackwardConfig] = None, rows: Optional[torch.Tensor] = None) -> FusedGrads:
    """Gradients of one triton forward: ``out`` its ``(B, T, H, D)`` contiguous output, ``lse`` and
    ``resid`` what it wrote for the backward (:func:`solattn.backends.triton.backend.launch`),
    ``grad_out`` the output's gradient (any strides). ``plan`` is the forward's plan (the same
    selection); a problem with a row table (``Problem.rows``) is refused. When the problem's dead
    rows hold zeros (``Problem.dead_rows_zero``), ``grad_out``'s must too (VSA tiles both with
    :func:`solattn.tiling.to_tiled`). ``config``: default the ``backward`` of the
    :class:`~.tuning.TritonTuning` in force. ``rows``: the problem's rows are a tiled layout of the
    caller's tokens (``rows[r]``, int64 ``(T,)``, the token of live row ``r``); ``out`` is then
    ``(B, T_out, H, D)`` in the caller's token order, and so are the returned dq, dk, dv and dgate,
    read and written there by the kernels' prologues and epilogues. Runs under ``torch.no_grad``."""
    tuning_in_force = current_tuning(TritonTuning)
    cfg = config or tuning_in_force.backward
    B, T, H, D, n = problem.B, problem.T, problem.H, problem.D, problem.n
    dev, f32 = problem.device, torch.float32
    if problem.rows is not None:
        raise ValueError("triton backward: received a problem with a row table (Problem.rows); allowed: a "
                         "problem whose q, k, v hold its rows (video_sparse_attn's backward takes tiled copies)")
    if rows is not None and (rows.shape != (T,) or rows.dtype != torch.int64 or rows.device != dev):
        raise ValueError(f"triton backward: argument 'rows' received shape {tuple(rows.shape)}, dtype {rows.dtype}, "
                         f"device {rows.device}; allowed: an int64 ({T},) tensor on {dev}")
    T_out = T if rows is None else out.shape[1]
    with torch.no_grad():
        ops = kernel_operands(problem, plan)
        q, k, v, gate = ops.q, ops.k, ops.v, ops.gate
        q_num, q_idx = plan.query_lists()
        q_num, q_idx = q_num.contiguous(), q_idx.contiguous()
        bias_grad = bool(bias_grad and ops.has_bias)
        out, resid, dout = out.contiguous(), resid.contiguous(), grad_out
        # dO enters tl.dot (an fp32 copy under the interpreter, as q, k, v are); the output and its
        # residual stay bf16 there, so the coarse term is rounded to bf16 as the forward did
        (dout,) = interpretable(ops.interpret, dout)
        cdt = q.dtype
        dq, dk, dv = (torch.empty((B, T_out, H, D), dtype=cdt, device=dev) for _ in range(3))
        dgate = torch.empty((B, T_out, H, D), dtype=gate.dtype, device=dev) if ops.has_coarse else dq
        row_table = rows.contiguous() if rows is not None else ops.key_mean        # (never read without)
        delta = torch.empty(lse_shape(B, T, H), dtype=f32, device=dev)
        dbias = torch.empty(lse_shape(B, T, H), dtype=f32, device=dev) if bias_grad else delta
        dummy = ops.key_mean
        dtl = torch.empty((B, H, n), dtype=f32, device=dev) if ops.has_tail else dummy
        dtv = torch.empty((B, H, n, D), dtype=f32, device=dev) if ops.has_tail else dummy
        dkm = torch.empty((B, H, n, D), dtype=f32, device=dev) if ops.has_tail else dummy
        # (B * H, n, D) rows, the layout of (B, H, n, D): the batched products read them without views
        dco = torch.empty((B * H, n, D), dtype=f32, device=dev) if ops.has_coarse else dummy
        means = torch.empty((3, B * H, n, D), dtype=f32, device=dev) if ops.has_coarse else dummy
        qk_scale = problem.scale * LOG2E
        # the forward's FOLD_SCALE: nothing added to the logits and a positive scale
        fold_scale = not ops.has_bias and problem.scale > 0
        # dead rows of q, k, v and dO hold zeros (the tiled layout's copies, dO tiled the same way),
        # or there are none inside T
        dead_zero = problem.block_len is None or problem.dead_rows_zero
        grid = (n, B * H)
        # the long programs first (kernel.program_ids), as the forward runs them: query blocks that
        # attend every key block (sink_q) and key blocks every query block keeps (sink_blocks; VSA's
        # prefix tiles, sink_q, are both where they are exempt from the competition)
        long_q = _block_range(problem.sink_q)
        long_k = _block_range(problem.sink_blocks or problem.sink_q)
        kernel_dq = compiled(ops.interpret, sol_attn_bwd_dq)
        kernel_dkdv = compiled(ops.interpret, sol_attn_bwd_dkdv)
        # TMA loads in both inner loops where the forward would take them (tma_ok: dead rows hold
        # zeros or there are none) and every tensor they read has a descriptor-ready layout
        block_tma = (cfg.tma and tuning_in_force.tma_pays(B * H * n, graph_recording())
                     and tma_ok(problem, ops.interpret) and all(tma_layout_ok(t) for t in (q, k, v, dout)))
        kd, vd, qd, dod = tma_descriptors(k, v, q, dout) if block_tma else (k, v, q, dout)
        tma_len = block_tma and problem.block_len is not None
        kernel_dq[grid](
            q, k, v, kd, vd, out, resid, dout, gate, dq, dgate, lse, delta,
            ops.kv_num, ops.kv_idx, ops.block_len, ops.key_mean, ops.tail_lse, ops.tail_value, ops.coarse,
            ops.key_bias, dtl, dtv, dco, dkm, means, row_table,
            *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *gate.stride(),
            ops.bias_stride_b, T, T_out, H, n, ops.kv_idx.shape[-1], qk_scale, problem.scale, *long_q,
            HEAD_DIM=D, BLOCK=BLOCK, HAS_TAIL=ops.has_tail, HAS_BIAS=ops.has_bias, HAS_COARSE=ops.has_coarse,
            LONG_FIRST=0 < long_q[1] < n, FOLD_SCALE=fold_scale, DEAD_ZERO=dead_zero,
            BLOCK_TMA=block_tma, TMA_LEN=tma_len,
            OUT_ROWS=rows is not None,
            num_warps=cfg.dq_warps, num_stages=cfg.dq_stages,
        )
        pooled = coarse_row_grads(problem, plan, means, dco) if ops.has_coarse else (dummy,) * 3
        kernel_dkdv[grid](
            qd, k, v, dod, dq, dk, dv, dbias, lse, delta,
            q_num, q_idx, ops.block_len, ops.key_bias, *pooled, row_table,
            *q.stride(), *k.stride(), *v.stride(), *dout.stride(),
            ops.bias_stride_b, T, T_out, H, n, q_idx.shape[-1], qk_scale, problem.scale, *long_k,
            HEAD_DIM=D, BLOCK=BLOCK, HAS_BIAS=ops.has_bias, BIAS_GRAD=bias_grad, POOLED=ops.has_coarse,
            LONG_FIRST=0 < long_k[1] < n, FOLD_SCALE=fold_scale, DEAD_ZERO=dead_zero, BLOCK_TMA=block_tma,
            TMA_LEN=tma_len,
            OUT_ROWS=rows is not None,
            num_warps=cfg.dkdv_warps, num_stages=cfg.dkdv_stages,
        )
        dt = problem.q.dtype
        return FusedGrads(
            dq=dq.to(dt), dk=dk.to(dt), dv=dv.to(dt),
            dgate=dgate.to(problem.coarse_gate.dtype) if ops.has_coarse else None,
            dbias=dbias[..., :T].sum(dim=1) if bias_grad else None,
            dtail_lse=dtl if ops.has_tail else None, dtail_value=dtv if ops.has_tail else None,
            dkey_mean=dkm.sum(dim=2, keepdim=True) if ops.has_tail else None)
