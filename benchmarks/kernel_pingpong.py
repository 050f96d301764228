"""Experiment: the Sol-Attn forward as a warp-specialised Gluon kernel (sm_90), FA3's ping-pong.

Session 15 left the production kernel (``solattn/backends/triton/kernel.py``) at two programs per
SM with the tensor pipe 60 % busy and nothing saturated: the two programs fall into step and wait on
each other. This kernel gives one program (CTA) two 64-row query blocks of one (batch, head) and
three partitions:

- a producer (the default partition, 4 warps, few registers) that issues every TMA load: both query
  blocks, then the listed key and value blocks of both, interleaved, into a ring of ``STAGES`` slots
  per query block, each slot with a ready and an empty barrier;
- two consumer warpgroups, one per query block, each walking its own ``kv_indices`` list with an
  online softmax, in ping-pong: a consumer issues its step's GEMMs (``S_j = Q K_j^T`` and
  ``O += P_{j-1} V_{j-1}``, both asynchronous) only when the other has issued its own (a turn
  barrier each), so one warpgroup's exponentials run while the other's GEMMs do. A consumer whose
  list is shorter passes its turns until the other is done.

Scope (what it was built to measure): no ``key_bias`` (the scale is folded into the softmax's FMA),
no ``block_len``, contiguous ``(B, T, H, D)`` q, k, v (two-dimensional ``(B*T, H*D)`` TMA
descriptors), forward only; tail and coarse branch as the production kernel computes them. Key rows
of a block cut by T are masked; the rows TMA reads past T (the next batch's tokens, or zeros) never
reach a stored output.

    python benchmarks/kernel_pingpong.py      # on an sm_90 GPU with Triton 3.6: check and time at H3
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

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


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
              KvNum, KvIdx, T, H, n_blocks, max_blocks,
              HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    bh, b, h, qb0, row0, c0, c1, has1 = _pair(KvNum, T, H, n_blocks)
    tile_bytes: gl.constexpr = BLOCK * HEAD_DIM * 2
    col = h * HEAD_DIM
    base = b * T
    mbarrier.expect(q_bar.index(0), tile_bytes)
    tma.async_copy_global_to_shared(q_desc, [base + qb0 * BLOCK, col], q_bar.index(0), q_smem.index(0))
    mbarrier.expect(q_bar.index(1), tile_bytes, pred=has1)
    tma.async_copy_global_to_shared(q_desc, [base + qb0 * BLOCK + BLOCK, col], q_bar.index(1), q_smem.index(1),
                                    pred=has1)
    idx0 = KvIdx + row0 * max_blocks
    idx1 = idx0 + max_blocks
    for j in range(gl.maximum(c0, c1)):
        s = j % STAGES
        free_phase = ((j // STAGES) & 1) ^ 1          # a fresh barrier counts its phase "-1" as done
        if j < c0:
            kb = gl.load(idx0 + j)
            mbarrier.wait(k_empty.index(s), free_phase)
            mbarrier.expect(k_ready.index(s), tile_bytes)
            tma.async_copy_global_to_shared(k_desc, [base + kb * BLOCK, col], k_ready.index(s), k_smem.index(s))
            mbarrier.wait(v_empty.index(s), free_phase)
            mbarrier.expect(v_ready.index(s), tile_bytes)
            tma.async_copy_global_to_shared(v_desc, [base + kb * BLOCK, col], v_ready.index(s), v_smem.index(s))
        if j < c1:
            kb = gl.load(idx1 + j)
            mbarrier.wait(k_empty.index(STAGES + s), free_phase)
            mbarrier.expect(k_ready.index(STAGES + s), tile_bytes)
            tma.async_copy_global_to_shared(k_desc, [base + kb * BLOCK, col], k_ready.index(STAGES + s),
                                            k_smem.index(STAGES + s))
            mbarrier.wait(v_empty.index(STAGES + s), free_phase)
            mbarrier.expect(v_ready.index(STAGES + s), tile_bytes)
            tma.async_copy_global_to_shared(v_desc, [base + kb * BLOCK, col], v_ready.index(STAGES + s),
                                            v_smem.index(STAGES + s))


@gluon.jit
def _softmax(s, m_i, l_i, kb, T, qk_scale, s_layout: gl.constexpr):
    """Fold one block of raw ``q . k`` into the running max and sum (base 2, scale in the FMA):
    ``(p, alpha, m, l)``; key rows past T are -inf."""
    if kb * BLOCK + BLOCK > T:
        cols = kb * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(0, s_layout))
        s = gl.where((cols < T)[None, :], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_ref)
    p = gl.exp2(s * qk_scale - m_ref[:, None])
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_new


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn,
              Out, Gate, KvNum, KvIdx, KeyMean, TailLse, TailValue, Coarse,
              sgb, sgt, sgh, sgd, T, H, n_blocks, max_blocks, qk_scale,
              C: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
              HAS_TAIL: gl.constexpr, HAS_COARSE: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    o_cols: gl.constexpr = gl.SliceLayout(0, o_layout)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)

    bh, b, h, qb0, row0, c0, c1, has1 = _pair(KvNum, T, H, n_blocks)
    if C == 0:
        count = c0
    else:
        count = c1
    n_turns = gl.maximum(c0, c1)
    q_block = qb0 + C
    plan_row = row0 + C
    idx = KvIdx + plan_row * max_blocks
    slot0: gl.constexpr = C * STAGES
    q = q_smem.index(C)
    dims = gl.arange(0, HEAD_DIM, layout=o_cols)

    if C == 0:
        live = qb0 >= 0
    else:
        live = has1
    mbarrier.wait(q_bar.index(C), 0, pred=live)
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
    s_zero = gl.zeros([BLOCK, BLOCK], gl.float32, layout=s_layout)

    if count > 0:
        # step 0: S only
        mbarrier.wait(k_ready.index(slot0), 0)
        mbarrier.wait(turn.index(C), 0)
        s_tok = warpgroup_mma(q, k_smem.index(slot0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.arrive(turn.index(1 - C))
        s = warpgroup_mma_wait(0, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(slot0))
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, gl.load(idx), T, qk_scale, s_layout)
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        p_prev = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        for j in range(1, count):
            st = slot0 + j % STAGES
            pv = slot0 + (j - 1) % STAGES
            mbarrier.wait(k_ready.index(st), (j // STAGES) & 1)
            mbarrier.wait(v_ready.index(pv), ((j - 1) // STAGES) & 1)
            mbarrier.wait(turn.index(C), j & 1)
            s_tok = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            o_tok = warpgroup_mma(p_prev, v_smem.index(pv), acc, is_async=True)
            mbarrier.arrive(turn.index(1 - C))
            s = warpgroup_mma_wait(1, deps=(s_tok, ))
            mbarrier.arrive(k_empty.index(st))
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i, gl.load(idx + j), T, qk_scale, s_layout)
            acc, p_done = warpgroup_mma_wait(0, deps=(o_tok, p_prev))
            mbarrier.arrive(v_empty.index(pv))
            acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
            p_prev = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        last = slot0 + (count - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((count - 1) // STAGES) & 1)
        o_tok = warpgroup_mma(p_prev, v_smem.index(last), acc, is_async=True)
        acc, p_done = warpgroup_mma_wait(0, deps=(o_tok, p_prev))
        mbarrier.arrive(v_empty.index(last))
    # the other consumer's remaining steps: pass the turn back each time
    for j in range(count, n_turns):
        mbarrier.wait(turn.index(C), j & 1)
        mbarrier.arrive(turn.index(1 - C))

    # epilogue (kernel.write_rows' arithmetic): normalise, add the coarse term, store
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
def pingpong_fwd(q_desc, k_desc, v_desc, Out, Gate,
                 KvNum, KvIdx, KeyMean, TailLse, TailValue, Coarse,
                 sgb, sgt, sgh, sgd,
                 T, H, n_blocks, max_blocks, qk_scale,
                 HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                 HAS_TAIL: gl.constexpr, HAS_COARSE: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    layout: gl.constexpr = q_desc.layout
    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK, HEAD_DIM], layout)
    k_smem = gl.allocate_shared_memory(dtype, [2 * STAGES, BLOCK, HEAD_DIM], layout)
    v_smem = gl.allocate_shared_memory(dtype, [2 * STAGES, BLOCK, HEAD_DIM], layout)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], bar_layout)
    k_empty = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], bar_layout)
    v_ready = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], bar_layout)
    v_empty = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], bar_layout)
    for i in gl.static_range(2):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(2 * STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=1)
    fence_async_shared()
    mbarrier.arrive(turn.index(0))          # consumer 0 issues first

    gl.warp_specialize([
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                     KvNum, KvIdx, T, H, n_blocks, max_blocks, HEAD_DIM, STAGES)),
        (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn,
                     Out, Gate, KvNum, KvIdx, KeyMean, TailLse, TailValue, Coarse,
                     sgb, sgt, sgh, sgd, T, H, n_blocks, max_blocks, qk_scale,
                     0, HEAD_DIM, STAGES, HAS_TAIL, HAS_COARSE)),
        (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn,
                     Out, Gate, KvNum, KvIdx, KeyMean, TailLse, TailValue, Coarse,
                     sgb, sgt, sgh, sgd, T, H, n_blocks, max_blocks, qk_scale,
                     1, HEAD_DIM, STAGES, HAS_TAIL, HAS_COARSE)),
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
        why.append("scale <= 0")
    if problem.q.dtype != torch.bfloat16:
        why.append("dtype")
    if problem.D not in (64, 128):
        why.append("head dim")
    for name in ("q", "k", "v"):
        if not getattr(problem, name).is_contiguous():
            why.append(f"{name} not contiguous")
    return why


def launch(problem, plan, stages: int = 2, consumer_regs: int = 232, out=None):
    """Run the experiment on ``problem`` with ``plan`` (the production kernel's operands)."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from solattn.backends.triton.backend import kernel_operands

    why = supported(problem)
    if why:
        raise ValueError(f"kernel_pingpong: not supported here: {', '.join(why)}")
    B, T, H, D, n = problem.B, problem.T, problem.H, problem.D, problem.n
    ops = kernel_operands(problem, plan)
    layout = gl.NVMMASharedLayout.get_default_for([ROWS, D], gl.bfloat16)
    descs = [TensorDescriptor(t.view(B * T, H * D), [B * T, H * D], [H * D, 1], [ROWS, D], layout)
             for t in (ops.q, ops.k, ops.v)]
    if out is None:
        out = torch.empty((B, T, H, D), dtype=problem.v.dtype, device=problem.v.device)
    grid = ((n + 1) // 2, B * H)
    pingpong_fwd[grid](*descs, out, ops.gate, ops.kv_num, ops.kv_idx, ops.key_mean, ops.tail_lse,
                       ops.tail_value, ops.coarse, *ops.gate.stride(), T, H, n, ops.kv_idx.shape[-1],
                       problem.scale * LOG2E, HEAD_DIM=D, STAGES=stages, HAS_TAIL=ops.has_tail,
                       HAS_COARSE=ops.has_coarse, CONSUMER_REGS=consumer_regs, num_warps=4)
    return out
