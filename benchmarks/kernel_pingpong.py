"""Experiment: the Sol-Attn forward as a warp-specialised Gluon kernel (sm_90), FA3's ping-pong.

Session 15 left the production kernel (``solattn/backends/triton/kernel.py``) at two programs per
SM with the tensor pipe 60 % busy and nothing saturated. The hypothesis: the two programs fall into
step, so the tensor cores wait while both are in their softmax. This kernel gives one program (CTA)
two 64-row query blocks of one (batch, head) and three partitions:

- a producer (the default partition, 4 warps, 40 registers) that issues every TMA load: both query
  blocks, then per step both consumers' key blocks and then both consumers' value blocks (the
  order in which the consumers free their slots), into per-consumer rings of ``K_SLOTS`` key and
  ``V_SLOTS`` value slots, each slot with a ready and an empty barrier;
- two consumer warpgroups (232 registers each), one per query block, each walking its own
  ``kv_indices`` list with an online softmax. With ``PINGPONG`` they take turns: a consumer issues
  its step's products (``S_j = Q K_j^T`` and ``O += P_{j-1} V_{j-1}``, both asynchronous) only
  after the other has issued its own (a turn barrier each), so one warpgroup's exponentials run
  while the other's products do; a consumer whose list is shorter passes its turns until the other
  is done. ``PER_STEP`` is 1 or 2 key blocks per step (a step of two past the list's end loads the
  last block again and masks it to -inf). ``LOAD_V=False`` is a diagnostic that never loads the
  values (meaningless output, half the bytes, the same arithmetic). ``Q_IN_REGS`` keeps each
  consumer's query tile in registers, its shared memory lent to the value ring (written after the
  session-16 runs: 3 key + 4 value slots, 225 KB, no spills).

Outcome on an H200 (``benchmarks/results/h200/session16``): the output is bit-identical to the
production kernel's with one block per step, and every session-16 variant ran slower than it, at
0.57-0.98x (the best: one block per step without turns, 0.91-0.98x, and two blocks per step with
2 key and 4 value slots in ping-pong, 0.94-0.96x); skipping the value loads bought 2.9-4.8 %.
``Q_IN_REGS`` (``session17``), two blocks per step in ping-pong, was the first to pass it where
lists are long: 0.988x / 1.056x / 1.032x at top-k 10 % / 20 % / tau 1 + tail. That does not reach
the tau goal, loses at 10 %, and would be a second production kernel on an API that has since
moved (see below), so it stays a benchmark, not a backend.

Scope (what it was built to measure): no ``key_bias`` (the scale is folded into the softmax's FMA),
no ``block_len``, contiguous ``(B, T, H, D)`` q, k, v (two-dimensional ``(B*T, H*D)`` TMA
descriptors), forward only, bf16; tail and coarse branch as the production kernel computes them.
Key rows of a block cut by T are masked; the rows TMA reads past T (the next batch's tokens, or
zeros) never reach a stored output. Written against Triton 3.6's Gluon (the GPU host's version);
under Triton 3.9 it does not compile (``tma.async_copy_global_to_shared`` was renamed
``async_load``), so importing it where Gluon has ``tma.async_load`` raises an ImportError that
says so.

    python benchmarks/diag/pingpong_h3.py check h3   # on an sm_90 GPU: check, then time at H3
"""

from __future__ import annotations

from typing import Optional

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.runtime.jit import constexpr_function

if hasattr(tma, "async_load"):   # Gluon's API moves between Triton releases; 3.6 has no async_load
    import triton
    raise ImportError(f"benchmarks/kernel_pingpong.py is written against Triton 3.6's Gluon API "
                      f"(tma.async_copy_global_to_shared, which later releases replaced by async_load) "
                      f"and was run with 3.6 only; this is Triton {triton.__version__}. Run it with "
                      f"triton==3.6.*")

ROWS = 64                  # the routing block: query rows per consumer, keys per step
BLOCK = gl.constexpr(ROWS)
LOG2E = 1.4426950408889634


@gluon.jit
def _pair(KvNum, T, H, n_blocks):
    """This program's (b, h, first query block, plan row of the first block, counts of both)."""
    pair = gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    qb0 = 2 * pair
    row0 = bh.to(gl.int64) * n_blocks + qb0
    c0 = gl.load(KvNum + row0)
    has1 = qb0 + 1 < n_blocks
    c1 = gl.load(KvNum + gl.where(has1, row0 + 1, row0))
    c1 = gl.where(has1, c1, 0)
    return bh, b, h, qb0, row0, c0, c1, has1


@constexpr_function
def _q_slot(c, V_SLOTS, Q_IN_REGS):
    """Where consumer ``c``'s query tile lands: its own slot, or (``Q_IN_REGS``) the last slot of its
    value ring, which it reads into registers and hands back before the ring gets there."""
    return c * V_SLOTS + V_SLOTS - 1 if Q_IN_REGS else c


@gluon.jit
def _load_tile(desc, smem, ready, empty, idx, count, t, row, col, gate,
               slot0: gl.constexpr, SLOTS: gl.constexpr, tile_bytes: gl.constexpr, GATED: gl.constexpr):
    """Load the ``t``-th listed block of one consumer (keys or values) into its ring of ``SLOTS``
    slots (a ``t`` past the list, which pads a step of two blocks, loads the last listed block
    again: finite data that the consumer masks to -inf). ``GATED``: the ring's last slot first
    held the consumer's query tile, so its first load waits for ``gate`` (the query read out)."""
    s = slot0 + t % SLOTS
    free_phase = ((t // SLOTS) & 1) ^ 1          # a fresh barrier counts its phase "-1" as done
    kb = gl.load(idx + gl.minimum(t, count - 1))
    if GATED:
        mbarrier.wait(gate, 0, pred=t == SLOTS - 1)
    mbarrier.wait(empty.index(s), free_phase)
    mbarrier.expect(ready.index(s), tile_bytes)
    tma.async_copy_global_to_shared(desc, [row + kb * BLOCK, col], ready.index(s), smem.index(s))


@gluon.jit
def _load_step(desc, smem, ready, empty, idx0, idx1, c0, c1, steps0, steps1, j, row, col, gates,
               SLOTS: gl.constexpr, PER_STEP: gl.constexpr, tile_bytes: gl.constexpr, GATED: gl.constexpr):
    """Step ``j``'s tiles (keys or values) for both consumers, consumer 0's first."""
    if j < steps0:
        for i in gl.static_range(PER_STEP):
            _load_tile(desc, smem, ready, empty, idx0, c0, j * PER_STEP + i, row, col, gates.index(0),
                       0, SLOTS, tile_bytes, GATED)
    if j < steps1:
        for i in gl.static_range(PER_STEP):
            _load_tile(desc, smem, ready, empty, idx1, c1, j * PER_STEP + i, row, col, gates.index(1),
                       SLOTS, SLOTS, tile_bytes, GATED)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_free, k_ready, k_empty, v_ready, v_empty,
              KvNum, KvIdx, T, H, n_blocks, max_blocks,
              HEAD_DIM: gl.constexpr, K_SLOTS: gl.constexpr, V_SLOTS: gl.constexpr, PER_STEP: gl.constexpr,
              LOAD_V: gl.constexpr, Q_IN_REGS: gl.constexpr):
    """Per step: both consumers' key blocks, then both consumers' value blocks, the order in which
    the consumers free their slots (keys after a step's scores, values after its products), so
    the producer never waits on one slot while another it could fill is free."""
    bh, b, h, qb0, row0, c0, c1, has1 = _pair(KvNum, T, H, n_blocks)
    tile_bytes: gl.constexpr = BLOCK * HEAD_DIM * 2
    col = h * HEAD_DIM
    base = b * T
    q_slot0: gl.constexpr = _q_slot(0, V_SLOTS, Q_IN_REGS)
    q_slot1: gl.constexpr = _q_slot(1, V_SLOTS, Q_IN_REGS)
    mbarrier.expect(q_bar.index(0), tile_bytes)
    tma.async_copy_global_to_shared(q_desc, [base + qb0 * BLOCK, col], q_bar.index(0), q_smem.index(q_slot0))
    mbarrier.expect(q_bar.index(1), tile_bytes, pred=has1)
    tma.async_copy_global_to_shared(q_desc, [base + qb0 * BLOCK + BLOCK, col], q_bar.index(1),
                                    q_smem.index(q_slot1), pred=has1)
    idx0 = KvIdx + row0 * max_blocks
    idx1 = idx0 + max_blocks
    steps0 = gl.cdiv(c0, PER_STEP)
    steps1 = gl.cdiv(c1, PER_STEP)
    for j in range(gl.maximum(steps0, steps1)):
        _load_step(k_desc, k_smem, k_ready, k_empty, idx0, idx1, c0, c1, steps0, steps1, j, base, col, q_free,
                   K_SLOTS, PER_STEP, tile_bytes, False)
        if LOAD_V:
            _load_step(v_desc, v_smem, v_ready, v_empty, idx0, idx1, c0, c1, steps0, steps1, j, base, col, q_free,
                       V_SLOTS, PER_STEP, tile_bytes, Q_IN_REGS)


@gluon.jit
def _mask(s, kb, live, T, s_layout: gl.constexpr):
    """Key rows past T, and a whole padding block (``live`` false), to -inf."""
    limit = gl.where(live, T, 0)
    if kb * BLOCK + BLOCK > limit:
        cols = kb * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(0, s_layout))
        s = gl.where((cols < limit)[None, :], s, float("-inf"))
    return s


@gluon.jit
def _softmax(s, m_i, l_i, kb, T, qk_scale, s_layout: gl.constexpr):
    """Fold one block of raw ``q . k`` into the running max and sum (base 2, scale in the FMA):
    ``(p, alpha, m, l)``; key rows past T are -inf."""
    s = _mask(s, kb, kb >= 0, T, s_layout)
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_ref)
    p = gl.exp2(s * qk_scale - m_ref[:, None])
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_new


@gluon.jit
def _softmax2(sa, sb, m_i, l_i, kba, kbb, live_b, T, qk_scale, s_layout: gl.constexpr):
    """:func:`_softmax` over two blocks at once: ``(pa, pb, alpha, m, l)``."""
    sa = _mask(sa, kba, kba >= 0, T, s_layout)
    sb = _mask(sb, kbb, live_b, T, s_layout)
    m_new = gl.maximum(m_i, gl.maximum(gl.max(sa, 1), gl.max(sb, 1)) * qk_scale)
    m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_ref)
    pa = gl.exp2(sa * qk_scale - m_ref[:, None])
    pb = gl.exp2(sb * qk_scale - m_ref[:, None])
    l_new = l_i * alpha + gl.sum(pa, 1) + gl.sum(pb, 1)
    return pa, pb, alpha, m_new, l_new


@gluon.jit
def _start(q, bh, plan_row, KeyMean, TailLse, TailValue, qk_scale,
           HEAD_DIM: gl.constexpr, HAS_TAIL: gl.constexpr,
           s_layout: gl.constexpr, o_layout: gl.constexpr):
    """Online-softmax state before the first key block (kernel.start_state): ``(m, l, acc)``."""
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    if HAS_TAIL:
        # the per-row shift that stands in for centring the keys (see kernel.py), then the tail key
        qr = q.load(o_layout).to(gl.float32)
        key_mean = gl.load(KeyMean + bh.to(gl.int64) * HEAD_DIM + dims)
        shift = gl.sum(qr * key_mean[None, :], 1) * qk_scale
        tail_lse = gl.load(TailLse + plan_row)
        tail_live = tail_lse > float("-inf")
        m_o = shift + tail_lse * 1.4426950408889634
        l_o = gl.where(tail_live, 1.0, 0.0) + gl.zeros([BLOCK], gl.float32, layout=o_rows)
        tail_value = gl.load(TailValue + plan_row * HEAD_DIM + dims)
        acc = gl.where(tail_live, tail_value, 0.0)[None, :] + gl.zeros([BLOCK, HEAD_DIM], gl.float32,
                                                                       layout=o_layout)
        m_i = gl.convert_layout(m_o, s_rows)
        l_i = gl.convert_layout(l_o, s_rows)
    else:
        m_i = gl.full([BLOCK], float("-inf"), gl.float32, layout=s_rows)
        l_i = gl.zeros([BLOCK], gl.float32, layout=s_rows)
        acc = gl.zeros([BLOCK, HEAD_DIM], gl.float32, layout=o_layout)
    return m_i, l_i, acc


@gluon.jit
def _finish(acc, l_i, Out, Gate, Coarse, b, h, q_block, plan_row, live, T, H, sgb, sgt, sgh, sgd,
            HEAD_DIM: gl.constexpr, HAS_COARSE: gl.constexpr, o_layout: gl.constexpr):
    """Normalise, add the coarse term, store (kernel.write_rows' arithmetic)."""
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    l_o = gl.convert_layout(l_i, o_rows)
    fine = acc / gl.where(l_o > 0.0, l_o, 1.0)[:, None]
    out = fine.to(Out.dtype.element_ty)
    tok = q_block * BLOCK + gl.arange(0, BLOCK, layout=o_rows)
    row_ok = (tok < T) & live
    if HAS_COARSE:
        g_ptrs = Gate + b * sgb + h * sgh + tok.to(gl.int64)[:, None] * sgt + dims[None, :] * sgd
        gate = gl.load(g_ptrs, mask=row_ok[:, None], other=0.0).to(gl.float32)
        coarse = gl.load(Coarse + plan_row * HEAD_DIM + dims)
        coarse_term = (gate * coarse[None, :]).to(Out.dtype.element_ty)
        out = (out.to(gl.float32) + coarse_term.to(gl.float32)).to(Out.dtype.element_ty)
    o_ptrs = Out + ((b.to(gl.int64) * T + tok.to(gl.int64)[:, None]) * H + h) * HEAD_DIM + dims[None, :]
    gl.store(o_ptrs, out, mask=row_ok[:, None])


@gluon.jit
def _walk(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turn, idx, count, m_i, l_i, acc, T, qk_scale,
          C: gl.constexpr, K_SLOTS: gl.constexpr, V_SLOTS: gl.constexpr, PER_STEP: gl.constexpr,
          PINGPONG: gl.constexpr, LOAD_V: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):
    """One consumer's key loop over ``count >= 1`` listed blocks, ``PER_STEP`` (1 or 2) per step
    (with 2, a block past the list is padding); returns ``(m, l, acc)``."""
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    k0: gl.constexpr = C * K_SLOTS
    v0: gl.constexpr = C * V_SLOTS
    s_zero = gl.zeros([BLOCK, BLOCK], gl.float32, layout=s_layout)
    if PER_STEP == 1:
        # step 0: S only
        mbarrier.wait(k_ready.index(k0), 0)
        mbarrier.wait(turn.index(C), 0, pred=PINGPONG)
        s_tok = warpgroup_mma(q, k_smem.index(k0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.arrive(turn.index(1 - C), pred=PINGPONG)
        s = warpgroup_mma_wait(0, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(k0))
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, gl.load(idx), T, qk_scale, s_layout)
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        p_prev = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        for j in range(1, count):
            kb = gl.load(idx + j)                       # asked for before the waits: off the softmax's path
            st = k0 + j % K_SLOTS
            pv = v0 + (j - 1) % V_SLOTS
            mbarrier.wait(k_ready.index(st), (j // K_SLOTS) & 1)
            mbarrier.wait(v_ready.index(pv), ((j - 1) // V_SLOTS) & 1, pred=LOAD_V)
            mbarrier.wait(turn.index(C), j & 1, pred=PINGPONG)
            s_tok = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            o_tok = warpgroup_mma(p_prev, v_smem.index(pv), acc, is_async=True)
            mbarrier.arrive(turn.index(1 - C), pred=PINGPONG)
            s = warpgroup_mma_wait(1, deps=(s_tok, ))
            mbarrier.arrive(k_empty.index(st))
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i, kb, T, qk_scale, s_layout)
            acc, p_done = warpgroup_mma_wait(0, deps=(o_tok, p_prev))
            mbarrier.arrive(v_empty.index(pv))
            acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
            p_prev = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        last = v0 + (count - 1) % V_SLOTS
        mbarrier.wait(v_ready.index(last), ((count - 1) // V_SLOTS) & 1, pred=LOAD_V)
        o_tok = warpgroup_mma(p_prev, v_smem.index(last), acc, is_async=True)
        acc, p_done = warpgroup_mma_wait(0, deps=(o_tok, p_prev))
        mbarrier.arrive(v_empty.index(last))


    else:
        steps = gl.cdiv(count, 2)
        # step 0: S only
        sa_slot = k0
        sb_slot = k0 + (1 % K_SLOTS)
        mbarrier.wait(k_ready.index(sa_slot), 0)
        mbarrier.wait(k_ready.index(sb_slot), (1 // K_SLOTS) & 1)
        mbarrier.wait(turn.index(C), 0, pred=PINGPONG)
        sa_tok = warpgroup_mma(q, k_smem.index(sa_slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        sb_tok = warpgroup_mma(q, k_smem.index(sb_slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.arrive(turn.index(1 - C), pred=PINGPONG)
        sa, sb = warpgroup_mma_wait(0, deps=(sa_tok, sb_tok))
        mbarrier.arrive(k_empty.index(sa_slot))
        mbarrier.arrive(k_empty.index(sb_slot))
        kb_b = gl.load(idx + gl.minimum(1, count - 1))
        pa, pb, alpha, m_i, l_i = _softmax2(sa, sb, m_i, l_i, gl.load(idx), kb_b, 1 < count, T, qk_scale, s_layout)
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        pa_prev = gl.convert_layout(pa.to(gl.bfloat16), p_layout)
        pb_prev = gl.convert_layout(pb.to(gl.bfloat16), p_layout)
        for j in range(1, steps):
            t = 2 * j
            kb_a = gl.load(idx + t)                     # asked for before the waits: off the softmax's path
            kb_b = gl.load(idx + gl.minimum(t + 1, count - 1))
            sa_slot = k0 + t % K_SLOTS
            sb_slot = k0 + (t + 1) % K_SLOTS
            va_slot = v0 + (t - 2) % V_SLOTS
            vb_slot = v0 + (t - 1) % V_SLOTS
            mbarrier.wait(k_ready.index(sa_slot), (t // K_SLOTS) & 1)
            mbarrier.wait(k_ready.index(sb_slot), ((t + 1) // K_SLOTS) & 1)
            mbarrier.wait(v_ready.index(va_slot), ((t - 2) // V_SLOTS) & 1, pred=LOAD_V)
            mbarrier.wait(v_ready.index(vb_slot), ((t - 1) // V_SLOTS) & 1, pred=LOAD_V)
            mbarrier.wait(turn.index(C), j & 1, pred=PINGPONG)
            sa_tok = warpgroup_mma(q, k_smem.index(sa_slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            sb_tok = warpgroup_mma(q, k_smem.index(sb_slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            o_tok = warpgroup_mma(pa_prev, v_smem.index(va_slot), acc, is_async=True)
            o_tok = warpgroup_mma(pb_prev, v_smem.index(vb_slot), o_tok, is_async=True)
            mbarrier.arrive(turn.index(1 - C), pred=PINGPONG)
            sa, sb = warpgroup_mma_wait(2, deps=(sa_tok, sb_tok))
            mbarrier.arrive(k_empty.index(sa_slot))
            mbarrier.arrive(k_empty.index(sb_slot))
            pa, pb, alpha, m_i, l_i = _softmax2(sa, sb, m_i, l_i, kb_a, kb_b, t + 1 < count, T, qk_scale, s_layout)
            acc, pa_done, pb_done = warpgroup_mma_wait(0, deps=(o_tok, pa_prev, pb_prev))
            mbarrier.arrive(v_empty.index(va_slot))
            mbarrier.arrive(v_empty.index(vb_slot))
            acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
            pa_prev = gl.convert_layout(pa.to(gl.bfloat16), p_layout)
            pb_prev = gl.convert_layout(pb.to(gl.bfloat16), p_layout)
        t = 2 * steps
        va_slot = v0 + (t - 2) % V_SLOTS
        vb_slot = v0 + (t - 1) % V_SLOTS
        mbarrier.wait(v_ready.index(va_slot), ((t - 2) // V_SLOTS) & 1, pred=LOAD_V)
        mbarrier.wait(v_ready.index(vb_slot), ((t - 1) // V_SLOTS) & 1, pred=LOAD_V)
        o_tok = warpgroup_mma(pa_prev, v_smem.index(va_slot), acc, is_async=True)
        o_tok = warpgroup_mma(pb_prev, v_smem.index(vb_slot), o_tok, is_async=True)
        acc, pa_done, pb_done = warpgroup_mma_wait(0, deps=(o_tok, pa_prev, pb_prev))
        mbarrier.arrive(v_empty.index(va_slot))
        mbarrier.arrive(v_empty.index(vb_slot))


    return m_i, l_i, acc


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_bar, q_free, k_ready, k_empty, v_ready, v_empty, turn,
              Out, Gate, KvNum, KvIdx, KeyMean, TailLse, TailValue, Coarse,
              sgb, sgt, sgh, sgd, T, H, n_blocks, max_blocks, qk_scale,
              C: gl.constexpr, HEAD_DIM: gl.constexpr, K_SLOTS: gl.constexpr, V_SLOTS: gl.constexpr,
              PER_STEP: gl.constexpr,
              PINGPONG: gl.constexpr, LOAD_V: gl.constexpr, HAS_TAIL: gl.constexpr, HAS_COARSE: gl.constexpr,
              Q_IN_REGS: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    bh, b, h, qb0, row0, c0, c1, has1 = _pair(KvNum, T, H, n_blocks)
    if C == 0:
        count = c0
        live = qb0 >= 0
    else:
        count = c1
        live = has1
    n_turns = gl.cdiv(gl.maximum(c0, c1), PER_STEP)
    q_block = qb0 + C
    plan_row = gl.where(live, row0 + C, row0)          # a missing second block reads the first's row
    idx = KvIdx + plan_row * max_blocks
    q_tile = q_smem.index(_q_slot(C, V_SLOTS, Q_IN_REGS))
    mbarrier.wait(q_bar.index(C), 0, pred=live)
    m_i, l_i, acc = _start(q_tile, bh, plan_row, KeyMean, TailLse, TailValue, qk_scale, HEAD_DIM, HAS_TAIL,
                           s_layout, o_layout)
    if Q_IN_REGS:
        # the products' left operand from registers (32 per thread); the slot joins the value ring
        q = q_tile.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
        fence_async_shared()
        mbarrier.arrive(q_free.index(C))
    else:
        q = q_tile
    if count > 0:
        m_i, l_i, acc = _walk(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turn, idx, count,
                              m_i, l_i, acc, T, qk_scale, C, K_SLOTS, V_SLOTS, PER_STEP, PINGPONG, LOAD_V,
                              s_layout, o_layout)
    if PINGPONG:
        # the other consumer's remaining steps: pass the turn back each time
        for j in range(gl.cdiv(count, PER_STEP), n_turns):
            mbarrier.wait(turn.index(C), j & 1)
            mbarrier.arrive(turn.index(1 - C))
    _finish(acc, l_i, Out, Gate, Coarse, b, h, q_block, plan_row, live, T, H, sgb, sgt, sgh, sgd,
            HEAD_DIM, HAS_COARSE, o_layout)


@gluon.jit
def pingpong_fwd(q_desc, k_desc, v_desc, Out, Gate,
                 KvNum, KvIdx, KeyMean, TailLse, TailValue, Coarse,
                 sgb, sgt, sgh, sgd,
                 T, H, n_blocks, max_blocks, qk_scale,
                 HEAD_DIM: gl.constexpr, K_SLOTS: gl.constexpr, V_SLOTS: gl.constexpr, PER_STEP: gl.constexpr,
                 PINGPONG: gl.constexpr,
                 LOAD_V: gl.constexpr, HAS_TAIL: gl.constexpr, HAS_COARSE: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                 Q_IN_REGS: gl.constexpr = False):
    dtype: gl.constexpr = q_desc.dtype
    layout: gl.constexpr = q_desc.layout
    if not Q_IN_REGS:
        q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK, HEAD_DIM], layout)
    k_smem = gl.allocate_shared_memory(dtype, [2 * K_SLOTS, BLOCK, HEAD_DIM], layout)
    v_smem = gl.allocate_shared_memory(dtype, [2 * V_SLOTS, BLOCK, HEAD_DIM], layout)
    if Q_IN_REGS:
        q_smem = v_smem                     # see _q_slot
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [2 * K_SLOTS, 1], bar_layout)
    k_empty = gl.allocate_shared_memory(gl.int64, [2 * K_SLOTS, 1], bar_layout)
    v_ready = gl.allocate_shared_memory(gl.int64, [2 * V_SLOTS, 1], bar_layout)
    v_empty = gl.allocate_shared_memory(gl.int64, [2 * V_SLOTS, 1], bar_layout)
    if Q_IN_REGS:
        q_free = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
        for i in gl.static_range(2):
            mbarrier.init(q_free.index(i), count=1)
    else:
        q_free = q_bar                      # not waited on
    for i in gl.static_range(2):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(2 * K_SLOTS):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=1)
    for i in gl.static_range(2 * V_SLOTS):
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=1)
    fence_async_shared()
    mbarrier.arrive(turn.index(0))          # consumer 0 issues first

    gl.warp_specialize([
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_free, k_ready, k_empty, v_ready,
                     v_empty, KvNum, KvIdx, T, H, n_blocks, max_blocks, HEAD_DIM, K_SLOTS, V_SLOTS, PER_STEP, LOAD_V,
                     Q_IN_REGS)),
        (_consumer, (q_smem, k_smem, v_smem, q_bar, q_free, k_ready, k_empty, v_ready, v_empty, turn,
                     Out, Gate, KvNum, KvIdx, KeyMean, TailLse, TailValue, Coarse,
                     sgb, sgt, sgh, sgd, T, H, n_blocks, max_blocks, qk_scale,
                     0, HEAD_DIM, K_SLOTS, V_SLOTS, PER_STEP, PINGPONG, LOAD_V, HAS_TAIL, HAS_COARSE,
                     Q_IN_REGS)),
        (_consumer, (q_smem, k_smem, v_smem, q_bar, q_free, k_ready, k_empty, v_ready, v_empty, turn,
                     Out, Gate, KvNum, KvIdx, KeyMean, TailLse, TailValue, Coarse,
                     sgb, sgt, sgh, sgd, T, H, n_blocks, max_blocks, qk_scale,
                     1, HEAD_DIM, K_SLOTS, V_SLOTS, PER_STEP, PINGPONG, LOAD_V, HAS_TAIL, HAS_COARSE,
                     Q_IN_REGS)),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


# ----------------------------------------------------------------------------- host side

def supported(problem) -> list:
    """Why this experiment cannot run ``problem`` (empty when it can)."""
    import torch
    why = []
    if problem.key_bias is not None:
        why.append("key_bias")
    if problem.block_len is not None:
        why.append("block_len")
    if not (problem.scale > 0):
        why.append(f"scale {problem.scale}")
    if problem.q.dtype != torch.bfloat16:
        why.append(f"dtype {problem.q.dtype}")
    if problem.D not in (64, 128):
        why.append(f"head dim {problem.D}")
    for name in ("q", "k", "v"):
        if not getattr(problem, name).is_contiguous():
            why.append(f"{name} not contiguous")
    return why


def launch(problem, plan, slots: int = 2, v_slots: Optional[int] = None, per_step: int = 1,
           pingpong: bool = True, consumer_regs: int = 232, out=None, load_v: bool = True,
           q_in_regs: bool = False):
    """Run the experiment on ``problem`` with ``plan`` (the production kernel's operands).

    ``load_v=False`` is a diagnostic: values are never loaded (the products read whatever the
    value slots hold, so the output is meaningless), which halves the bytes each block pair moves
    while the arithmetic stays the same; its time says how much the bytes cost. ``q_in_regs``
    keeps each query tile in registers and lends its shared memory to the value ring (see
    ``_q_slot``), which frees 32 KB for deeper rings (3 key + 4 value slots at D = 128)."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from solattn.backends.triton.backend import kernel_operands

    why = supported(problem)
    if why:
        raise ValueError(f"kernel_pingpong.launch: argument 'problem' has {', '.join(why)}; allowed: bf16, "
                         "head dim 64 or 128, contiguous q, k, v, no key_bias or block_len, scale > 0")
    v_slots = slots if v_slots is None else v_slots
    if per_step not in (1, 2):
        raise ValueError(f"kernel_pingpong.launch: argument 'per_step' received {per_step!r}; allowed: 1 or 2")
    if min(slots, v_slots) < per_step:
        # both blocks of a step must sit in the ring at once, or producer and consumer wait on each other
        raise ValueError(f"kernel_pingpong.launch: arguments 'slots', 'v_slots' received {slots}, {v_slots}; "
                         f"allowed: at least per_step ({per_step}) each")
    B, T, H, D, n = problem.B, problem.T, problem.H, problem.D, problem.n
    smem = ((0 if q_in_regs else 2) + 2 * (slots + v_slots)) * ROWS * D * 2
    if smem > 227 * 1024:
        raise ValueError(f"kernel_pingpong.launch: arguments 'slots', 'v_slots' received {slots}, {v_slots}; "
                         f"allowed: rings that fit 227 KB of shared memory with the query tiles "
                         f"({smem // 1024} KB asked for at D={D})")
    ops = kernel_operands(problem, plan)
    layout = gl.NVMMASharedLayout.get_default_for([ROWS, D], gl.bfloat16)
    descs = [TensorDescriptor(t.view(B * T, H * D), [B * T, H * D], [H * D, 1], [ROWS, D], layout)
             for t in (ops.q, ops.k, ops.v)]
    if out is None:
        out = torch.empty((B, T, H, D), dtype=problem.v.dtype, device=problem.v.device)
    grid = ((n + 1) // 2, B * H)
    pingpong_fwd[grid](*descs, out, ops.gate, ops.kv_num, ops.kv_idx, ops.key_mean, ops.tail_lse,
                       ops.tail_value, ops.coarse, *ops.gate.stride(), T, H, n, ops.kv_idx.shape[-1],
                       problem.scale * LOG2E, HEAD_DIM=D, K_SLOTS=slots,
                       V_SLOTS=v_slots, PER_STEP=per_step,
                       PINGPONG=pingpong, LOAD_V=load_v, HAS_TAIL=ops.has_tail,
                       HAS_COARSE=ops.has_coarse, CONSUMER_REGS=consumer_regs, Q_IN_REGS=q_in_regs, num_warps=4)
    return out
