"""The coarse branch's gradient at block granularity in two Triton kernels (the ``triton``
backend's backward); importing this module imports Triton.

The same quantities as :func:`solattn.routing.coarse_grad.coarse_block_grads` followed by
:func:`solattn.routing.coarse_grad.per_rows` (the definitions are in
:mod:`solattn.routing.coarse_grad`), computed the way a flash-attention backward computes a
softmax's gradient, with blocks in place of tokens: the ``(n, n)`` weights are recomputed from
the block means inside each kernel, never stored.

1. :func:`coarse_rows_kernel`, one program per (tile of query blocks, batch * head), walks the
   key blocks in chunks with an online softmax and gives each row its base-2 log-sum-exp, its
   ``delta_i = dcoarse_i . coarse_i = sum_j a_ij (dcoarse_i . vm_j)`` and
   ``dqm_i = scale sum_j a_ij (dcoarse_i . vm_j - delta_i) km_j``, accumulated in one pass as
   ``sum_j p_ij dp_ij km_j - delta_i sum_j p_ij km_j`` over the unnormalised weights ``p``.
2. :func:`coarse_cols_kernel`, one program per (tile of key blocks, batch * head), walks the
   query blocks in chunks with those statistics: ``a_ij = exp2(s_ij - lse_i)``,
   ``dvm_j = sum_i a_ij dcoarse_i``, ``dkm_j = scale sum_i a_ij (dp_ij - delta_i) qm_i``.

Each result is divided by its block's live length (a live row's share). The torch path took
about 16 operations per backward (four fp32 batched products, a softmax, elementwise updates,
a division and a copy per result); here two launches, no host synchronisation, no cache, any n
(the loops walk chunks: registers hold tiles of blocks, never a whole row of n).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import triton.language as tl

from ...routing.fused import dot_precision
from ...routing.fused_kernels import mean_rows
from ...triton_runtime import interpret_on
from ...triton_runtime.jit import compiled, gpu_jit

#: query blocks per program of the row kernel and key blocks per program of the column kernel
#: (``TILE``), blocks per chunk of the loop over the other side (``CHUNK``), warps: at D = 128 a
#: program holds two fp32 (TILE, D) operands, two accumulators of that size and a chunk's two
#: (CHUNK, D) operands, about 128 registers a thread in 4 warps before the tf32x3 products split
#: their operands (32-block tiles would double it). Chosen by that count;
#: ``benchmarks/bench_coarse_grad.py --sweep`` times the alternatives on a GPU
TILE = 16
CHUNK = 32
WARPS = 4

#: the most blocks for which the triton backward takes these kernels (:func:`coarse_kernels_pay`).
#: On an H200 (B=1, H=56, D=128, benchmarks/bench_coarse_grad.py) they took 0.19 ms against the
#: torch products' 0.53 ms at n = 128 (and 0.33 against 0.71 ms of host time), but 1.67 against
#: 1.26 ms at n = 583 and 15.0 against 11.0 ms at n = 2048: their tf32x3 products on 16-block
#: tiles lose to fp32 batched products once the GPU, not the host, bounds the call
MAX_BLOCKS = 256


def coarse_kernels_usable(means: torch.Tensor) -> bool:
    """Whether :func:`fused_coarse_row_grads` takes block means ``means`` (``(3, G, n, D)``): fp32
    with a power-of-two D in 16..256 (``tl.dot``'s operands), on a device the ``triton`` backend
    launches on (CUDA, XPU) or in the interpreter (:func:`solattn.triton_runtime.interpret_on`:
    the CPU); elsewhere the torch path (:func:`solattn.routing.coarse_grad.coarse_block_grads`)
    computes the same."""
    D = means.shape[-1]
    return (means.dtype == torch.float32 and 16 <= D <= 256 and D & (D - 1) == 0
            and (means.device.type in ("cuda", "xpu") or interpret_on(means.device)))


def coarse_kernels_pay(n: int) -> bool:
    """Whether the kernels beat the torch products for ``n`` blocks (:data:`MAX_BLOCKS`)."""
    return n <= MAX_BLOCKS


def fused_coarse_row_grads(means: torch.Tensor, dcoarse: torch.Tensor, L: torch.Tensor, scale: float,
                           tile: Optional[int] = None, chunk: Optional[int] = None,
                           num_warps: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The coarse branch's share of a live row's ``(dq, dk, dv)`` in each block: three fp32
    contiguous ``(G, n, D)`` tensors (views of one buffer), ``dqm_i / L_i``, ``dkm_j / L_j``,
    ``dvm_j / L_j`` as :func:`solattn.routing.coarse_grad.coarse_block_grads` and
    :func:`solattn.routing.coarse_grad.per_rows` define them.

    ``means``: fp32 contiguous ``(3, G, n, D)``, the block means of q, k, v; ``dcoarse``: fp32
    contiguous ``(G, n, D)``, the coarse term's gradient; ``L``: ``(n,)`` integer live lengths;
    ``scale``: the logit scale. ``tile``, ``chunk``, ``num_warps``: launch overrides (default
    :data:`TILE`, :data:`CHUNK`, :data:`WARPS`; tile and chunk powers of two >= 16). Launched on
    the current device; the products at :func:`solattn.routing.fused.dot_precision`. See
    :func:`coarse_kernels_usable` for what the kernels take."""
    three, G, n, D = means.shape
    if three != 3 or dcoarse.shape != (G, n, D) or L.shape != (n,):
        raise ValueError(f"fused_coarse_row_grads: received means {tuple(means.shape)}, dcoarse "
                         f"{tuple(dcoarse.shape)}, L {tuple(L.shape)}; allowed: (3, G, n, D), (G, n, D), (n,)")
    if not all(t.is_contiguous() and t.dtype == torch.float32 for t in (means, dcoarse)):
        raise ValueError(f"fused_coarse_row_grads: received means {means.dtype} (contiguous: "
                         f"{means.is_contiguous()}), dcoarse {dcoarse.dtype} (contiguous: {dcoarse.is_contiguous()}); "
                         "allowed: fp32 contiguous tensors")
    tile, chunk, warps = tile or TILE, chunk or CHUNK, num_warps or WARPS
    dev = means.device
    interpret = interpret_on(dev)
    out = torch.empty((3, G, n, D), dtype=torch.float32, device=dev)
    stats = torch.empty((2, G, n), dtype=torch.float32, device=dev)     # lse (base 2), delta
    c = scale * math.log2(math.e)
    precision = dot_precision(dev)
    grid = (-(-n // tile), G)
    compiled(interpret, coarse_rows_kernel)[grid](
        means, dcoarse, L, stats, out, n, c, scale,
        HEAD_DIM=D, BI=tile, BJ=chunk, DOT=precision, num_warps=warps)
    compiled(interpret, coarse_cols_kernel)[grid](
        means, dcoarse, L, stats, out, n, c, scale,
        HEAD_DIM=D, BJ=tile, BI=chunk, DOT=precision, num_warps=warps)
    return out.unbind(0)


@gpu_jit
def coarse_rows_kernel(Means, DCoarse, Lens, Stats, Out, n, c, scale,
                       HEAD_DIM: tl.constexpr, BI: tl.constexpr, BJ: tl.constexpr, DOT: tl.constexpr):
    """Rows ``ii`` (BI query blocks) of one batch * head (program ids: row tile, batch * head):
    their base-2 log-sum-exp and ``delta`` into ``Stats`` (fp32 ``(2, G, n)``) and ``dqm_i / L_i``
    into ``Out[0]`` (fp32 ``(3, G, n, D)``), over every key block in chunks of BJ. ``Means``: fp32
    ``(3, G, n, D)`` (q, k, v), ``DCoarse`` fp32 ``(G, n, D)``, ``c = scale log2(e)``."""
    g = tl.program_id(1).to(tl.int64)
    G = tl.num_programs(1).to(tl.int64)
    gn = g * n
    part = G * n * HEAD_DIM                           # one of Means' and Out's three (G, n, D) parts
    ii = tl.program_id(0) * BI + tl.arange(0, BI)
    row_ok = ii < n
    cols = tl.arange(0, BJ)
    qm = mean_rows(Means, gn, ii, row_ok, HEAD_DIM)
    dco = mean_rows(DCoarse, gn, ii, row_ok, HEAD_DIM)
    mx = tl.full([BI], float("-inf"), tl.float32)     # running max of the base-2 scores
    sm = tl.zeros([BI], tl.float32)                   # sum_j p_ij, p_ij = exp2(s_ij - mx)
    pdp = tl.zeros([BI], tl.float32)                  # sum_j p_ij dp_ij
    acc_dp = tl.zeros([BI, HEAD_DIM], tl.float32)     # sum_j p_ij dp_ij km_j
    acc_k = tl.zeros([BI, HEAD_DIM], tl.float32)      # sum_j p_ij km_j
    for j0 in range(0, n, BJ):
        jj = j0 + cols
        ok = jj < n
        km = mean_rows(Means + part, gn, jj, ok, HEAD_DIM)
        vm = mean_rows(Means + 2 * part, gn, jj, ok, HEAD_DIM)
        s = tl.dot(qm, tl.trans(km), input_precision=DOT) * c
        s = tl.where(ok[None, :], s, float("-inf"))
        dp = tl.dot(dco, tl.trans(vm), input_precision=DOT)        # dcoarse_i . vm_j
        # every row has a finite score in its first chunk (block 0), so new is finite from there on
        new = tl.maximum(mx, tl.max(s, 1))
        alpha = tl.math.exp2(mx - new)
        p = tl.math.exp2(s - new[:, None])
        pd = p * dp
        sm = sm * alpha + tl.sum(p, 1)
        pdp = pdp * alpha + tl.sum(pd, 1)
        acc_dp = acc_dp * alpha[:, None] + tl.dot(pd, km, input_precision=DOT)
        acc_k = acc_k * alpha[:, None] + tl.dot(p, km, input_precision=DOT)
        mx = new
    inv = 1.0 / sm
    delta = pdp * inv
    tl.store(Stats + gn + ii, mx + tl.log2(sm), mask=row_ok)
    tl.store(Stats + G * n + gn + ii, delta, mask=row_ok)
    # sum_j a_ij (dp_ij - delta_i) km_j, a_ij = p_ij / sm_i
    dqm = (acc_dp - delta[:, None] * acc_k) * inv[:, None]
    L = tl.load(Lens + ii, mask=row_ok, other=1).to(tl.float32)
    dims = tl.arange(0, HEAD_DIM)
    tl.store(Out + (gn + ii)[:, None] * HEAD_DIM + dims[None, :], dqm * (scale / L)[:, None],
             mask=row_ok[:, None])


@gpu_jit
def coarse_cols_kernel(Means, DCoarse, Lens, Stats, Out, n, c, scale,
                       HEAD_DIM: tl.constexpr, BJ: tl.constexpr, BI: tl.constexpr, DOT: tl.constexpr):
    """Columns ``jj`` (BJ key blocks) of one batch * head (program ids: column tile, batch *
    head): ``dkm_j / L_j`` into ``Out[1]`` and ``dvm_j / L_j`` into ``Out[2]``, over every query
    block in chunks of BI, from :func:`coarse_rows_kernel`'s ``Stats`` (same operands)."""
    g = tl.program_id(1).to(tl.int64)
    G = tl.num_programs(1).to(tl.int64)
    gn = g * n
    part = G * n * HEAD_DIM
    jj = tl.program_id(0) * BJ + tl.arange(0, BJ)
    ok = jj < n
    rows = tl.arange(0, BI)
    km = mean_rows(Means + part, gn, jj, ok, HEAD_DIM)
    vm = mean_rows(Means + 2 * part, gn, jj, ok, HEAD_DIM)
    dkm = tl.zeros([BJ, HEAD_DIM], tl.float32)
    dvm = tl.zeros([BJ, HEAD_DIM], tl.float32)
    for i0 in range(0, n, BI):
        ii = i0 + rows
        row_ok = ii < n
        qm = mean_rows(Means, gn, ii, row_ok, HEAD_DIM)
        dco = mean_rows(DCoarse, gn, ii, row_ok, HEAD_DIM)
        lse = tl.load(Stats + gn + ii, mask=row_ok, other=float("inf"))       # past n: a = 0
        delta = tl.load(Stats + G * n + gn + ii, mask=row_ok, other=0.0)
        s_t = tl.dot(km, tl.trans(qm), input_precision=DOT) * c              # (key, query) blocks
        a_t = tl.math.exp2(s_t - lse[None, :])
        dp_t = tl.dot(vm, tl.trans(dco), input_precision=DOT)
        dvm += tl.dot(a_t, dco, input_precision=DOT)
        dkm += tl.dot(a_t * (dp_t - delta[None, :]), qm, input_precision=DOT)
    L = tl.load(Lens + jj, mask=ok, other=1).to(tl.float32)
    inv = 1.0 / L
    out = (gn + jj)[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    tl.store(Out + part + out, dkm * (scale * inv)[:, None], mask=ok[:, None])
    tl.store(Out + 2 * part + out, dvm * inv[:, None], mask=ok[:, None])


__all__ = ["MAX_BLOCKS", "coarse_kernels_pay", "coarse_kernels_usable", "fused_coarse_row_grads", "coarse_rows_kernel", "coarse_cols_kernel"]
