"""The fused Sol-Attn forward kernel: one program per (64-row query block, batch, head).

Each program loads its query block once, walks that block's ``kv_indices`` with an
online softmax in base 2, and writes the finished rows. Nothing is gathered in
memory: key and value rows are read straight from the caller's ``(B, T, H, D)``
tensors through their strides.

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

The function below is plain Python; :func:`compiled` wraps it either for the GPU
(``triton.jit``) or for Triton's CPU interpreter, chosen per call, so that the same
source runs in CI without a GPU.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

LOG2E = math.log2(math.e)

# Reductions go through tl.reduce with Triton's own combine functions rather than
# tl.sum / tl.max: those are @triton.jit library functions, which the CPU interpreter
# can only call when TRITON_INTERPRET=1 was set before triton was first imported,
# whereas tl.reduce is a builtin the interpreter patches (and it recognises these
# two combine functions and reduces with numpy).
_ADD = tl.standard._sum_combine
_MAX = tl.standard._elementwise_max


def _sol_attn_fwd(
    Q, K, V, Out, Gate,
    KvNum, KvIdx, BlockLen, KeyMean, TailLse, TailValue, Coarse, KeyBias,
    sqb, sqt, sqh, sqd,
    skb, skt, skh, skd,
    svb, svt, svh, svd,
    sgb, sgt, sgh, sgd,
    s_bias_b,
    T, H, n_blocks, max_blocks,
    qk_scale,                      # scale * log2(e): logits are kept in base 2
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,           # 64: the routing block, query rows per program
    KV_PER_ITER: tl.constexpr,     # key blocks (from kv_indices) consumed per loop step
    HAS_TAIL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_COARSE: tl.constexpr,
    DOT_IN_F32: tl.constexpr,      # interpreter only: its tl.dot multiplies bf16 bit patterns as integers
    USE_TMA: tl.constexpr = 0,     # K, V as TMA descriptors: 4 = (B, T, H, D), 2 = (B*T, H*D) (KV_PER_ITER == 1)
    DIAG: tl.constexpr = 0,        # benchmarks only: 1 = no K/V loads in the loop, 2 = loads only, no math
):
    BLOCK_N: tl.constexpr = BLOCK * KV_PER_ITER
    q_block = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    plan_row = bh.to(tl.int64) * n_blocks + q_block   # flat index of (b, h, i) in the plan

    rows = tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    tok_q = q_block * BLOCK + rows
    row_ok = tok_q < T
    q_ptrs = Q + b * sqb + h * sqh + tok_q.to(tl.int64)[:, None] * sqt + dims[None, :] * sqd
    # dead query rows (block_len) are read as zeros: their outputs are unspecified but finite
    q_live = row_ok & (rows < tl.load(BlockLen + q_block))
    q = tl.load(q_ptrs, mask=q_live[:, None], other=0.0)

    # per-row shift that stands in for centring the keys (base-2 units)
    key_mean = tl.load(KeyMean + bh.to(tl.int64) * HEAD_DIM + dims)
    shift = tl.reduce(q.to(tl.float32) * key_mean[None, :], 1, _ADD) * qk_scale

    if HAS_TAIL:
        tail_lse = tl.load(TailLse + plan_row)
        tail_live = tail_lse > float("-inf")
        m_i = shift + tail_lse * 1.4426950408889634
        l_i = tl.where(tail_live, 1.0, 0.0) + tl.full([BLOCK], 0.0, tl.float32)
        tail_value = tl.load(TailValue + plan_row * HEAD_DIM + dims)
        acc = tl.where(tail_live, tail_value, 0.0)[None, :] + tl.full([BLOCK, HEAD_DIM], 0.0, tl.float32)
    else:
        m_i = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        l_i = tl.full([BLOCK], 0.0, tl.float32)
        acc = tl.full([BLOCK, HEAD_DIM], 0.0, tl.float32)

    count = tl.load(KvNum + plan_row)
    idx_row = KvIdx + plan_row * max_blocks
    cols = tl.arange(0, BLOCK_N)
    slot_in_step = cols // BLOCK        # which of the KV_PER_ITER blocks a column belongs to
    row_in_block = cols % BLOCK
    if USE_TMA:
        b32 = bh // H
        h32 = bh % H
    else:
        k_base = K + b * skb + h * skh
        v_base = V + b * svb + h * svh
    if DIAG == 1:  # the first block's keys and values, loaded once (times the loop without its loads)
        tok0 = (tl.load(idx_row) * BLOCK + row_in_block).to(tl.int64)
        k_fixed = tl.load(k_base + tok0[:, None] * skt + dims[None, :] * skd)
        v_fixed = tl.load(v_base + tok0[:, None] * svt + dims[None, :] * svd)
    for step in range(0, (count + KV_PER_ITER - 1) // KV_PER_ITER):
        if USE_TMA:
            # one block per step; without block_len the only dead rows are past T (zero-filled or masked)
            kv_block = tl.load(idx_row + step)
            live = (kv_block * BLOCK + row_in_block) < T
            tok_k = (kv_block * BLOCK + row_in_block).to(tl.int64)
            if USE_TMA == 4:
                k = K.load([b32, kv_block * BLOCK, h32, 0]).reshape(BLOCK, HEAD_DIM)
            else:  # rows past T come from the next batch entry: finite, and masked out through `live`
                k = K.load([b32 * T + kv_block * BLOCK, h32 * HEAD_DIM])
        else:
            slot = step * KV_PER_ITER + slot_in_step
            slot_ok = slot < count
            kv_block = tl.load(idx_row + slot, mask=slot_ok, other=0)
            live_len = tl.load(BlockLen + kv_block)
            live = slot_ok & (row_in_block < live_len)      # dead rows are never keys
            tok_k = (kv_block * BLOCK + row_in_block).to(tl.int64)
            if DIAG == 1:
                k = k_fixed
            else:
                k = tl.load(k_base + tok_k[:, None] * skt + dims[None, :] * skd, mask=live[:, None], other=0.0)
        if DIAG == 2:
            v = tl.load(v_base + tok_k[:, None] * svt + dims[None, :] * svd, mask=live[:, None], other=0.0)
            acc += k.to(tl.float32) + v.to(tl.float32)
            l_i += 1.0
        else:
            if DOT_IN_F32:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) * qk_scale
            else:
                s = tl.dot(q, tl.trans(k)) * qk_scale
            if HAS_BIAS:
                bias = tl.load(KeyBias + b * s_bias_b + tok_k, mask=live, other=0.0)
                # a huge finite bias (an fp32 finfo.min "mask") must stay finite in base 2
                bias = tl.where(bias == float("-inf"), bias, tl.minimum(tl.maximum(bias, -1e30), 1e30))
                s = s + bias[None, :] * 1.4426950408889634
            s = tl.where(live[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
            # a row with nothing finite yet keeps m = -inf; subtract 0 there to avoid inf - inf
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(m_i - m_ref)
            p = tl.math.exp2(s - m_ref[:, None])
            l_i = l_i * alpha + tl.reduce(p, 1, _ADD)
            if USE_TMA:
                if USE_TMA == 4:
                    v = V.load([b32, kv_block * BLOCK, h32, 0]).reshape(BLOCK, HEAD_DIM)
                else:
                    v = V.load([b32 * T + kv_block * BLOCK, h32 * HEAD_DIM])
            elif DIAG == 1:
                v = v_fixed
            else:
                v = tl.load(v_base + tok_k[:, None] * svt + dims[None, :] * svd, mask=live[:, None], other=0.0)
            if DOT_IN_F32:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

    # a row whose terms are all -inf has l = 0 (and acc = 0): it returns 0, not NaN
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    out = out.to(Out.dtype.element_ty)
    if HAS_COARSE:
        g_ptrs = Gate + b * sgb + h * sgh + tok_q.to(tl.int64)[:, None] * sgt + dims[None, :] * sgd
        gate = tl.load(g_ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
        coarse = tl.load(Coarse + plan_row * HEAD_DIM + dims)
        # added after the cast to v's dtype (SPEC.md): round both terms, add in fp32, round once
        # more, which is what a bf16/fp16 add does (and the interpreter's bf16 add does not)
        coarse_term = (gate * coarse[None, :]).to(Out.dtype.element_ty)
        out = (out.to(tl.float32) + coarse_term.to(tl.float32)).to(Out.dtype.element_ty)
    o_ptrs = Out + ((b * T + tok_q.to(tl.int64)[:, None]) * H + h) * HEAD_DIM + dims[None, :]
    tl.store(o_ptrs, out, mask=row_ok[:, None])


_COMPILED = {}


def compiled(interpret: bool):
    """The kernel as a launchable Triton function: GPU-compiled, or run by Triton's CPU interpreter.

    Built on first use and cached; chosen per call rather than at import so that
    ``TRITON_INTERPRET`` can be set after solattn is imported (tests do).
    """
    key = bool(interpret)
    if key not in _COMPILED:
        if key:
            from triton.runtime.interpreter import InterpretedFunction
            _COMPILED[key] = InterpretedFunction(_sol_attn_fwd)
        else:
            from triton.runtime.jit import JITFunction
            _COMPILED[key] = JITFunction(_sol_attn_fwd)
    return _COMPILED[key]
