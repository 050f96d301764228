"""The routing plan: pooled statistics and block selection, computed once per call.

Everything here works at block granularity: block means are ``(B, H, n, D)``,
routing scores ``(B, H, n, n)``. Nothing of size ``T x n`` or ``T x T`` is
formed. Backends that consume a :class:`Plan` (``sdpa``, ``triton``) never
re-derive selection; the ``reference`` backend does not import this module.

The selection is computed without gradients (it is piecewise constant); the
tail and coarse terms keep their autograd graph so that gradients of q, k, v
flow through them.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Optional

import torch

from .validation import BLOCK, Problem

TOPK_METHODS = ("topk", "sort")

#: fp32 bytes of one block-mean chunk; bounds the upcast copy made while pooling
_POOL_CHUNK_BYTES = 256 << 20


@dataclass(frozen=True, eq=False)
class BlockStats:
    """fp32 block means over live rows, ``(B, H, n, D)``, and the key centroid ``m`` ``(B, H, 1, D)``."""

    qm: torch.Tensor
    km: torch.Tensor
    vm: torch.Tensor
    m: torch.Tensor
    L: torch.Tensor  # (n,) int32 live rows per block


@dataclass(frozen=True, eq=False)
class Plan:
    """Which key blocks each query block attends exactly, plus what the tail and coarse branch need.

    - ``kv_num_blocks``: ``(B, H, n)`` int32, number of exact key blocks per query block.
    - ``kv_indices``: ``(B, H, n, M)`` int32, the exact key blocks in ascending order in the first
      ``kv_num_blocks`` entries, then 0 (padding). ``M`` is the largest count. This is the form
      FlexAttention's ``BlockMask.from_kv_blocks`` and block-index kernels consume.
    - ``exact``: ``(B, H, n, n)`` bool, the same selection as a dense block mask.
    - ``block_len``: ``(n,)`` int32 live rows per block (``L_j``).
    - ``key_mean``: ``(B, H, 1, D)`` fp32 centroid ``m`` of the key block means; exact keys are ``k - m``.
    - ``tail_lse``: ``(B, H, n)`` fp32 ``log sum_{j not in E_i} L_j exp(p_ij)`` (``-inf`` when the tail
      is empty) or ``None`` when ``tail=False``.
    - ``tail_value``: ``(B, H, n, D)`` fp32 weighted mean of ``vm_j`` over that tail, or ``None``.
    - ``coarse``: ``(B, H, n, D)`` fp32 ``sum_j softmax_j(scale qm_i . km_j) vm_j``, or ``None``.
    """

    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    exact: torch.Tensor
    block_len: torch.Tensor
    key_mean: torch.Tensor
    tail_lse: Optional[torch.Tensor]
    tail_value: Optional[torch.Tensor]
    coarse: Optional[torch.Tensor]

    @property
    def n(self) -> int:
        return self.exact.shape[-1]

    @property
    def kept_fraction(self) -> float:
        """Fraction of (query block, key block) pairs attended exactly."""
        return float(self.kv_num_blocks.double().mean().item()) / self.n


def live_lengths(problem: Problem) -> torch.Tensor:
    """``L_j`` (SPEC.md, "Blocks") as an ``(n,)`` int32 tensor on the problem's device."""
    n, T = problem.n, problem.T
    if problem.block_len is None:
        return _full_lengths(T, problem.device).clone()   # the plan exposes it: never share it
    L = problem.block_len.clamp(1, BLOCK).to(torch.int32)
    last = torch.full((1,), T - BLOCK * (n - 1), dtype=torch.int32, device=problem.device)
    return torch.cat([L[:-1], torch.minimum(L[-1:], last)])


# Small per-shape constants are cached: on a GPU the routing plan is launch-bound at small T,
# and these tensors depend only on (T or n, sinks, device). Cached tensors are never handed out:
# lengths are cloned, forced masks only enter new tensors.
@functools.lru_cache(maxsize=64)
def _full_lengths(T: int, device: torch.device) -> torch.Tensor:
    n = (T + BLOCK - 1) // BLOCK
    L = torch.full((n,), BLOCK, dtype=torch.int32, device=device)
    L[-1] = T - BLOCK * (n - 1)
    return L


def live_token_mask(L: torch.Tensor) -> torch.Tensor:
    """``(n, 64)`` bool: row ``r`` of block ``j`` is live when ``r < L_j``."""
    return torch.arange(BLOCK, device=L.device)[None, :] < L[:, None]


def block_means(x: torch.Tensor, L: torch.Tensor, all_live: bool = False) -> torch.Tensor:
    """Mean over the live rows of each 64-token block.

    ``x``: ``(B, T, H, D)`` any float dtype and strides; ``L``: ``(n,)`` int32; ``all_live``:
    the caller knows every row before T is live (no ``block_len``), so no mask is applied.
    Returns ``(B, H, n, D)`` fp32. Sums read x in its own dtype and accumulate in fp32
    (``sum(dtype=float32)``); masking (dead rows) works chunk by chunk, so at most
    ``_POOL_CHUNK_BYTES`` of temporaries exist at a time. No host synchronisation.
    """
    B, T, H, D = x.shape
    n = L.shape[0]
    if x.device.type == "cpu" and not (torch.is_grad_enabled() and x.requires_grad):
        return _block_means_cpu(x, L, all_live)
    full = T // BLOCK                                                     # blocks with 64 rows in x
    sums = []
    if all_live:
        if full:
            sums.append(x[:, :full * BLOCK].unflatten(1, (full, BLOCK)).sum(dim=2, dtype=torch.float32))
        if full < n:                                                      # ragged last block
            sums.append(x[:, full * BLOCK:].sum(dim=1, keepdim=True, dtype=torch.float32))
    else:
        live = live_token_mask(L)                                         # (n, 64)
        step = max(1, _POOL_CHUNK_BYTES // (B * BLOCK * H * D * 4))
        for b0 in range(0, n, step):
            b1 = min(n, b0 + step)
            xs = x[:, b0 * BLOCK:min(b1 * BLOCK, T)]
            pad = (b1 - b0) * BLOCK - xs.shape[1]
            if pad:                                                       # ragged last block
                xs = torch.nn.functional.pad(xs, (0, 0, 0, 0, 0, pad))
            keep = live[b0:b1][None, :, :, None, None]                    # dead rows contribute 0,
            xs = torch.where(keep, xs.unflatten(1, (b1 - b0, BLOCK)), 0)  # even if they hold NaN
            sums.append(xs.sum(dim=2, dtype=torch.float32))
    return _means_from_sums(sums, L)


def _means_from_sums(sums, L: torch.Tensor) -> torch.Tensor:
    """Per-chunk ``(B, blocks, H, D)`` fp32 sums of live rows -> ``(B, H, n, D)`` means."""
    total = torch.cat(sums, dim=1) if len(sums) > 1 else sums[0]
    return (total / L.to(torch.float32)[None, :, None, None]).permute(0, 2, 1, 3)


#: fp32 staging buffer of the CPU block means (stays in cache; reused chunk after chunk)
_CPU_POOL_CHUNK_BYTES = 8 << 20


def _block_means_cpu(x: torch.Tensor, L: torch.Tensor, all_live: bool) -> torch.Tensor:
    """CPU inference path of :func:`block_means`: each chunk of blocks is converted to fp32 into
    one reused buffer, then summed. On a 2-core CPU ``sum(dtype=float32)`` over bf16 ran at
    ~2 ns per element (32 ms for 16.8 M elements); converting into a cached buffer and summing
    fp32 took 4.6 ms for the same tensor, with identical fp32 results."""
    B, T, H, D = x.shape
    n = L.shape[0]
    step = max(1, _CPU_POOL_CHUNK_BYTES // (B * BLOCK * H * D * 4))
    buf = torch.empty(B, min(step, n) * BLOCK, H, D, dtype=torch.float32)
    live = None if all_live else live_token_mask(L)
    sums = []
    for b0 in range(0, n, step):
        b1 = min(n, b0 + step)
        rows = min(b1 * BLOCK, T) - b0 * BLOCK
        view = buf[:, :(b1 - b0) * BLOCK]
        view[:, :rows].copy_(x[:, b0 * BLOCK:b0 * BLOCK + rows])
        view[:, rows:].zero_()                                            # past T (ragged block)
        blocks = view.unflatten(1, (b1 - b0, BLOCK))
        if live is not None:                                              # dead rows: 0, even NaN
            blocks.masked_fill_(~live[b0:b1][None, :, :, None, None], 0.0)
        sums.append(blocks.sum(dim=2))
    return _means_from_sums(sums, L)


def block_stats(problem: Problem) -> BlockStats:
    L = live_lengths(problem)
    all_live = problem.block_len is None
    qm = block_means(problem.q, L, all_live)
    km = block_means(problem.k, L, all_live)
    vm = block_means(problem.v, L, all_live)
    return BlockStats(qm=qm, km=km, vm=vm, m=km.mean(dim=2, keepdim=True), L=L)


def default_topk_method(device: torch.device, n: int) -> str:
    """How to find the k-th largest routing score on this device.

    ``torch.topk`` is reported to crash on XPU (torch 2.13) above 2048 elements in
    bf16/fp32 and to fail above 4096 fp32 elements elsewhere, so XPU and rows
    longer than 4096 blocks use a full sort (exact, same result). The environment
    variable ``SOLATTN_TOPK=topk|sort`` overrides the choice.
    """
    env = os.environ.get("SOLATTN_TOPK", "").strip().lower()
    if env:
        if env not in TOPK_METHODS:
            raise ValueError(f"SOLATTN_TOPK received {env!r}; allowed: one of {TOPK_METHODS}")
        return env
    if device.type == "xpu" or n > 4096:
        return "sort"
    return "topk"


def kth_largest(scores: torch.Tensor, kk: int, method: str) -> torch.Tensor:
    """The ``kk``-th largest value along the last dim (``kk >= 1``), by ``torch.topk`` or by a sort."""
    if method == "topk":
        return scores.topk(kk, dim=-1).values[..., kk - 1]
    if method == "sort":
        return scores.sort(dim=-1, descending=True).values[..., kk - 1]
    raise ValueError(f"kth_largest: argument 'method' received {method!r}; allowed: one of {TOPK_METHODS}")


def topk_count(topk_ratio: float, n_eff: int) -> int:
    """SPEC.md's ``kk``: 0 when ``n_eff <= 1``, else ``clamp(round(r n_eff), 1, n_eff - 1)``."""
    if n_eff <= 1:
        return 0
    return min(max(round(topk_ratio * n_eff), 1), n_eff - 1)


def sink_mask(rng, n: int, device) -> torch.Tensor:
    """``(n,)`` bool, True inside the clipped ``[start, end)`` range (all False for ``None``)."""
    mask = torch.zeros(n, dtype=torch.bool, device=device)
    if rng is not None:
        mask[rng[0]:rng[1]] = True
    return mask


@torch.no_grad()
def select_exact(problem: Problem, stats: BlockStats, topk_method: Optional[str] = None) -> torch.Tensor:
    """The sets ``E_i`` of SPEC.md as a ``(B, H, n, n)`` bool mask (tau or top-k, plus forced blocks)."""
    n, dev = problem.n, problem.device
    c = problem.scale * math.log2(math.e)
    kmc = stats.km - stats.m
    R = c * (stats.qm @ kmc.transpose(-1, -2))
    if problem.topk_ratio == 0.0:
        var = kmc.pow(2).mean(dim=2)  # population variance over blocks, (B, H, D)
        thr = problem.tau * torch.sqrt(c * c * (stats.qm.pow(2) * var[:, :, None, :]).sum(-1) + 1e-6)
        exact = R > thr[..., None]
    else:
        sinks = sink_mask(problem.sink_blocks, n, dev)
        n_sinks = problem.sink_blocks[1] - problem.sink_blocks[0] if problem.sink_blocks else 0
        kk = topk_count(problem.topk_ratio, n - n_sinks)
        if kk > 0:
            cand = R.masked_fill(sinks, -math.inf)
            theta = kth_largest(cand, kk, topk_method or default_topk_method(dev, n))
            exact = (cand >= theta[..., None]) & ~sinks
        else:
            exact = torch.zeros_like(R, dtype=torch.bool)
    return exact | forced_blocks(problem, n, dev)


def forced_blocks(problem: Problem, n: int, device) -> torch.Tensor:
    """``(n, n)`` bool: neighbours ``|i - j| <= 1``, sink key blocks, and every key for sink_q rows."""
    key = (n, problem.sink_blocks, problem.sink_q, torch.device(device))
    # only small masks are cached (n = 2048 is 4 MiB), so the cache stays small
    return _forced_blocks(*key) if n <= 2048 else _forced_blocks.__wrapped__(*key)


@functools.lru_cache(maxsize=16)
def _forced_blocks(n: int, sink_blocks, sink_q, device: torch.device) -> torch.Tensor:
    ii = torch.arange(n, device=device)
    forced = (ii[:, None] - ii[None, :]).abs() <= 1
    forced |= sink_mask(sink_blocks, n, device)[None, :]
    forced |= sink_mask(sink_q, n, device)[:, None]
    return forced


def indices_from_mask(exact: torch.Tensor):
    """Dense ``(..., n)`` bool block mask -> ``(kv_num_blocks, kv_indices)`` int32, ascending, 0-padded.

    Each selected block j goes to column ``cumsum - 1`` of its row (elementwise, no sort);
    unselected blocks go to a scratch column that is dropped. One host sync (the width M).
    """
    n = exact.shape[-1]
    counts = exact.sum(dim=-1, dtype=torch.int32)
    M = max(1, int(counts.max().item())) if counts.numel() else 1
    pos = torch.where(exact, exact.cumsum(dim=-1) - 1, M)                  # scratch column M
    cols = torch.arange(n, device=exact.device, dtype=torch.int32).expand_as(exact)
    idx = torch.zeros(*exact.shape[:-1], M + 1, dtype=torch.int32, device=exact.device)
    idx.scatter_(-1, pos, cols)
    return counts, idx[..., :M].contiguous()


def make_plan(problem: Problem, stats: BlockStats, exact: torch.Tensor, tail: bool,
              coarse: bool) -> Plan:
    """Assemble a :class:`Plan` from a selection; shared by ``sol_attn`` and the VSA entry point."""
    kv_num_blocks, kv_indices = indices_from_mask(exact)
    tail_lse = tail_value = coarse_out = None
    if tail:
        kmc = stats.km - stats.m
        logw = problem.scale * (stats.qm @ kmc.transpose(-1, -2)) + torch.log(stats.L.to(torch.float32))
        logw = logw.masked_fill(exact, -math.inf)
        tail_lse = torch.logsumexp(logw, dim=-1)                       # (B, H, n)
        safe = torch.where(torch.isneginf(tail_lse), torch.zeros_like(tail_lse), tail_lse)
        tail_value = torch.exp(logw - safe[..., None]) @ stats.vm      # (B, H, n, D); 0 for empty tails
    if coarse:
        a = torch.softmax(problem.scale * (stats.qm @ stats.km.transpose(-1, -2)), dim=-1)
        coarse_out = a @ stats.vm
    return Plan(kv_num_blocks=kv_num_blocks, kv_indices=kv_indices, exact=exact, block_len=stats.L,
                key_mean=stats.m, tail_lse=tail_lse, tail_value=tail_value, coarse=coarse_out)


def build_plan(problem: Problem, topk_method: Optional[str] = None) -> Plan:
    """The routing plan of a ``sol_attn`` call (SPEC.md, "The routing plan")."""
    stats = block_stats(problem)
    exact = select_exact(problem, stats, topk_method)
    return make_plan(problem, stats, exact, tail=problem.tail, coarse=problem.coarse_gate is not None)


# --- VSA (video sparse attention) selection ------------------------------------------------------
# The VSA entry point (solattn.video) lays a video out as optional prefix blocks (text, audio)
# followed by 4x4x4 cube blocks, and selects per query cube the top-k key cubes by the
# uncentred pooled score qm_i . km_j: no neighbours, no tail. Prefix blocks are sinks both
# ways (every query attends them exactly; they attend every key exactly).


def vsa_topk_from_sparsity(sparsity: float, n: int) -> int:
    """``clamp(ceil((1 - sparsity) n), 1, n)`` computed exactly.

    ``sparsity`` is read as the decimal it prints as (Python's shortest ``repr``), so ``0.95``
    means 95/100 exactly: with plain float arithmetic ``(1 - 0.95) * 20`` is ``1.0000000000000009``
    and would round up to 2 instead of 1.
    """
    from fractions import Fraction

    exact = (1 - Fraction(repr(float(sparsity)))) * n
    return min(max(math.ceil(exact), 1), n)


@torch.no_grad()
def select_vsa(stats: BlockStats, topk: int, num_prefix_blocks: int = 0,
               topk_method: Optional[str] = None) -> torch.Tensor:
    """VSA's selection as a ``(B, H, n, n)`` bool block mask.

    Blocks ``[0, num_prefix_blocks)`` are prefix blocks, the rest video cubes (``n_v`` of them).
    For each query cube, the key cubes whose score ``qm_i . km_j`` (fp32, uncentred, unscaled)
    is ``>=`` the ``topk``-th largest score of its row are selected, so a tie at the boundary
    keeps the whole tied group (as ``sol_attn``'s top-k mode does). Prefix key blocks are
    selected for every query block and prefix query blocks select every key block.
    ``1 <= topk <= n_v``.
    """
    B, H, n, _ = stats.qm.shape
    n_prefix = int(num_prefix_blocks)
    n_video = n - n_prefix
    if not 0 <= n_prefix < n:
        raise ValueError(f"select_vsa: argument 'num_prefix_blocks' received {num_prefix_blocks!r}; "
                         f"allowed: an int 0 <= num_prefix_blocks < n = {n}")
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= n_video:
        raise ValueError(f"select_vsa: argument 'topk' received {topk!r}; "
                         f"allowed: an int 1 <= topk <= {n_video} (the number of video cubes)")
    qm = stats.qm[:, :, n_prefix:]
    km = stats.km[:, :, n_prefix:]
    scores = qm @ km.transpose(-1, -2)                                   # (B, H, n_v, n_v)
    theta = kth_largest(scores, topk, topk_method or default_topk_method(scores.device, n_video))
    exact = torch.ones(B, H, n, n, dtype=torch.bool, device=scores.device)
    exact[:, :, n_prefix:, n_prefix:] = scores >= theta[..., None]
    return exact


def build_vsa_plan(problem: Problem, topk: int, num_prefix_blocks: int = 0,
                   topk_method: Optional[str] = None):
    """The routing plan of a VSA call, and the block statistics it was built from.

    ``problem`` is the tiled layout (prefix blocks, then cube blocks, ``block_len`` set).
    The plan has no tail and no coarse term (the VSA entry point adds its own coarse branch,
    over video cubes only). Returns ``(plan, stats)``.
    """
    stats = block_stats(problem)
    exact = select_vsa(stats, topk, num_prefix_blocks, topk_method)
    return make_plan(problem, stats, exact, tail=False, coarse=False), stats
