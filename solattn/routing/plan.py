"""The routing plan: the one contract between routing and backends, and its assembly.

A :class:`Plan` is a selection, per (batch, head, query block): the exact key blocks in ordered
form (``kv_num_blocks`` / ``kv_indices``, as FlexAttention's ``BlockMask`` keeps them), with the
block lengths and sequence length it covers. It holds no value of any call, so a plan built once
serves any call of its shape (FlashInfer's plan/run split). What a backend runs is a
:class:`CallPlan`: a selection plus the terms one call computes from its own block means (the key
centroid, the pooled tail, the coarse term). :func:`assemble_plan` builds it from block statistics
and a selection rule (``sol_attn``'s in :mod:`.select`, VSA's in :mod:`.vsa`), chunk by chunk over
heads and query-block rows, so that the ``(rows, n)`` score temporaries of one chunk fit in the
``sdpa`` memory budget whatever T and H are; :func:`plan_with_values` computes a call's terms
with a given selection held. The dense ``(B, H, n, n)`` mask is never stored;
:meth:`Plan.dense_mask` derives it.

The selection is computed without gradients (it is piecewise constant); the tail and coarse
terms keep their autograd graph so that gradients of q, k, v flow through them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from ..budget import current_budget
from ..triton_runtime import device_constant, triton_runs_on
from ..validation import BLOCK, Problem, fail
from .stats import BlockStats, block_means, block_stats, live_lengths, serial_cpu

#: Selection rule of one chunk: ``select(g0, g1, i0, i1)`` -> ``(g1 - g0, i1 - i0, n)`` bool,
#: the exact key blocks of query blocks ``[i0, i1)`` of the flattened (batch, head) groups ``[g0, g1)``.
Selector = Callable[[int, int, int, int], torch.Tensor]

#: Bytes of temporaries per routing-score element of a chunk (fp32 scores, a top-k or sort of
#: them, bool masks, int32/int64 positions while ordering, fp32 tail and coarse logits). The
#: largest is ordering the selection (bool + int32 cumsum + int64 index, 13 B) or a full sort
#: (fp32 values + int64 indices next to the scores, 16 B + 4 B); 32 leaves room for the
#: allocator's rounding.
BYTES_PER_SCORE = 32

#: Score elements of a chunk below which its CPU ops run with one intra-op thread
_SERIAL_SCORES = 1 << 22


@dataclass(frozen=True, eq=False)
class Plan:
    """A selection: which key blocks each query block attends exactly. No value of any call.

    - ``kv_num_blocks``: ``(B, H, n)`` int32, number of exact key blocks per query block.
    - ``kv_indices``: ``(B, H, n, M)`` int32, the exact key blocks in ascending order in the first
      ``kv_num_blocks`` entries, then 0 (padding). ``M`` is the largest count (n in the fused GPU
      plan that ``build_plan(..., fused=True)`` gives the ``triton`` backend). This is the form
      FlexAttention's ``BlockMask.from_kv_blocks`` and block-index kernels consume.
    - ``block_len``: ``(n,)`` int32 live rows per block (``L_j``) of the call it was built from
      (:meth:`to_block_mask`'s live keys). A call that runs the plan uses its own ``block_len``.
    - ``touches_dead``: ``(B, H, n)`` bool, True where some exact key block of query block i has
      dead rows (``L_j < 64``), i.e. where the exact keys need a mask.
    - ``seq_len``: T, the tokens the plan covers (``n = ceil(T / block_size)``).
    - ``block_size``: tokens per routing block (64, :data:`solattn.BLOCK`).

    Route once, run many: ``sol_attn(q, k, v, ..., plan=p)`` computes the definition with ``p``'s
    exact sets held and every other term (tail, coarse, centring, block means) from its own
    tensors, so one plan serves the layers that share a layout or the steps that reuse a mask.
    ``p[b, h]`` (ints or slices) is the plan of those batch entries and heads (dimensions kept).

    Derived forms are computed on demand: the selection as a dense ``(B, H, n, n)`` bool mask
    (:meth:`dense_mask`), transposed for a backward pass that walks key blocks
    (:meth:`query_lists`, computed once per plan and kept), as a FlexAttention ``BlockMask``
    (:meth:`to_block_mask`). A plan is immutable: its tensors must not be written to.
    """

    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    block_len: torch.Tensor
    touches_dead: torch.Tensor
    seq_len: int
    block_size: int = BLOCK
    #: what the plan derives and keeps (see :meth:`query_lists`); not part of its identity
    _derived: Dict[str, object] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def n(self) -> int:
        """Query (and key) blocks: ``ceil(seq_len / block_size)``."""
        return self.block_len.shape[0]

    @property
    def batch(self) -> int:
        return self.kv_num_blocks.shape[0]

    @property
    def heads(self) -> int:
        return self.kv_num_blocks.shape[1]

    @property
    def device(self) -> torch.device:
        return self.kv_indices.device

    @property
    def kept_fraction(self) -> float:
        """Fraction of (query block, key block) pairs attended exactly (one host sync)."""
        return float(self.kv_num_blocks.double().mean().item()) / self.n

    def sparsity(self) -> float:
        """Fraction of (query block, key block) pairs not attended exactly, in ``[0, 1]``
        (``1 - kept_fraction``; one host sync)."""
        return 1.0 - self.kept_fraction

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(batch={self.batch}, heads={self.heads}, seq_len={self.seq_len}, "
                f"block_size={self.block_size}, blocks={self.n}, sparsity={100 * self.sparsity():.1f}%)")

    def __getitem__(self, index) -> "Plan":
        """The selection of some batch entries and heads: ``p[b]``, ``p[b, h]``, ``p[:, h0:h1]``
        (ints or slices over batch, then heads; an int keeps its dimension, of size 1)."""
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > 2 or not all(isinstance(i, (int, slice)) and not isinstance(i, bool) for i in index):
            fail("Plan[...]", "index", repr(index), "ints or slices over (batch, heads), at most two")
        sizes = (self.batch, self.heads)
        keys = []
        for i, size in zip(index, sizes):
            if isinstance(i, int):
                if not -size <= i < size:
                    fail("Plan[...]", "index", repr(index), f"indices within (batch, heads) = {sizes}", IndexError)
                i = slice(i % size, i % size + 1)
            keys.append(i)
        key = tuple(keys)
        return Plan(kv_num_blocks=self.kv_num_blocks[key], kv_indices=self.kv_indices[key],
                    block_len=self.block_len, touches_dead=self.touches_dead[key], seq_len=self.seq_len,
                    block_size=self.block_size)

    def selection(self) -> "Plan":
        """The selection alone (a :class:`Plan` holds nothing else; see :class:`CallPlan`)."""
        return self

    #: the tensor fields in the order of :meth:`tensors`
    TENSOR_FIELDS = ("kv_num_blocks", "kv_indices", "block_len", "touches_dead")

    def tensors(self) -> List[torch.Tensor]:
        """The selection's tensors in :data:`TENSOR_FIELDS` order: how a plan travels as an
        argument of the ``solattn::sol_attn`` custom op."""
        return [getattr(self, name) for name in self.TENSOR_FIELDS]

    @classmethod
    def from_tensors(cls, tensors, seq_len: int) -> "Plan":
        """The selection whose :meth:`tensors` are ``tensors``, covering ``seq_len`` tokens."""
        return Plan(**dict(zip(Plan.TENSOR_FIELDS, tensors)), seq_len=seq_len)

    def keep(self, name: str, value: object) -> None:
        """Hold ``value`` for the backend that runs the plan, until it is taken (:meth:`take`):
        what the plan's builder made on the way for the backend's forward kernel
        (:data:`solattn.routing.fused.PLAN_EXTRAS`)."""
        self._derived["extra:" + name] = value

    def take(self, name: str) -> Optional[object]:
        """What :meth:`keep` holds under ``name``, or None; the plan lets go of it (a plan kept for
        a backward does not keep a forward's copies alive)."""
        return self._derived.pop("extra:" + name, None)

    def dense_mask(self) -> torch.Tensor:
        """The selection as a ``(B, H, n, n)`` bool block mask (allocated on each call)."""
        return _mask_of_lists(self.kv_num_blocks, self.kv_indices, self.n)

    def query_lists(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """The selection transposed, for a backward pass that walks key blocks: for each key block
        j, the query blocks i whose list holds j, as ``(q_num_blocks (B, H, n), q_indices
        (B, H, n, Mq))`` int32, ascending, 0-padded, contiguous. Built on the first call only;
        later calls return the same tensors. ``Mq`` is n when ``kv_indices`` is n wide (the fused
        plan: no host sync anywhere; one Triton kernel where Triton runs, :mod:`.list_kernels`),
        else the largest count (:func:`indices_from_mask`: one sync)."""
        lists = self._derived.get("query_lists")
        if lists is None:
            wide = self.kv_indices.shape[-1] == self.n
            if wide and triton_runs_on(self.device):
                from .list_kernels import query_lists  # imports Triton
                lists = query_lists(self.kv_num_blocks, self.kv_indices)
            else:
                counts, idx = _indices_from_mask(self.dense_mask().transpose(-1, -2), width=self.n if wide else None)
                lists = (counts, idx.contiguous())
            self._derived["query_lists"] = lists
        return lists

    def to_block_mask(self, tail_slots: bool = False, for_backward: bool = True):
        """The exact branch's selection as a FlexAttention ``BlockMask`` over ``(B, H, T, T)``
        (``torch.nn.attention.flex_attention``): query token t attends key token u when u's block
        is listed for t's block and u is live (``u mod block_size < L_j``, ``block_len``). Listed
        blocks whose rows are all live are full blocks (no ``mask_mod`` call in a compiled
        kernel), the others partial; the ``mask_mod`` holds the whole rule, as eager
        ``flex_attention`` needs. The pooled tail, the coarse branch and ``key_bias`` are not
        part of it: ``flex_attention(q, k, v, block_mask=...)`` on ``(B, H, T, D)`` tensors is
        ``sol_attn`` with ``tail=False``, no ``key_bias`` and no ``coarse_gate`` (a row whose
        selection holds no live key gives 0). Built on each call, without a host sync; the lists
        have a fixed width, so a compiled kernel taking the mask never traces again for a new
        selection.

        ``tail_slots``: the keys are ``n`` blocks (``n * block_size`` rows, the last block's rows
        past T dead) followed by ``ceil(n / block_size)`` blocks of slots, one per query block:
        query block i also sees slot ``n * block_size + i`` (in key block ``n + i // block_size``,
        listed as partial after its exact blocks) and no other. A backend puts the pooled tail
        there, as one extra key per query block whose logit and value it supplies (the ``flex``
        backend, through its ``score_mod``). ``for_backward=False`` skips the transposed (query)
        lists that only a backward pass reads (a forward-only caller's saving)."""
        from torch.nn.attention.flex_attention import BlockMask

        size, n = self.block_size, self.n
        live = self.block_len.to(torch.int32)
        selected = self.dense_mask()
        whole = live == size
        keys = self.seq_len
        if tail_slots:
            extra = -(-n // size)
            keys, first_slot = (n + extra) * size, n * size
            own = torch.arange(n + extra, device=live.device) == n + _arange(n, live.device)[:, None] // size
            selected = torch.cat([selected, own[:, n:].expand(*selected.shape[:2], n, extra)], dim=-1)
            whole = torch.cat([whole, whole.new_zeros(extra)])
            live = torch.cat([live, live.new_zeros(extra)])

            def selected_live_keys(b, h, q_idx, kv_idx):
                j = kv_idx // size
                in_block = torch.where(kv_idx < first_slot, kv_idx % size < live[j],
                                       kv_idx - first_slot == q_idx // size)
                return selected[b, h, q_idx // size, j] & in_block
        else:
            def selected_live_keys(b, h, q_idx, kv_idx):
                return selected[b, h, q_idx // size, kv_idx // size] & (kv_idx % size < live[kv_idx // size])

        # a BlockMask reads the number of key blocks from the width of its lists: every key block
        width = selected.shape[-1]
        partial = _indices_from_mask(selected & ~whole, width=width)
        full = _indices_from_mask(selected & whole, width=width)
        return BlockMask.from_kv_blocks(partial[0], partial[1].contiguous(), full[0], full[1].contiguous(),
                                        BLOCK_SIZE=size, mask_mod=selected_live_keys,
                                        seq_lengths=(self.seq_len, keys), compute_q_blocks=for_backward)


@dataclass(frozen=True, eq=False, repr=False)
class CallPlan(Plan):
    """A selection plus the terms one call computes from its own block means: what a backend
    runs. Built per call (:func:`assemble_plan`, :func:`plan_with_values`, the fused plan); the
    public :func:`solattn.plan` hands out its :meth:`selection` only.

    - ``key_mean``: ``(B, H, 1, D)`` fp32 centroid ``m`` of the key block means; exact keys are ``k - m``.
    - ``tail_lse``: ``(B, H, n)`` fp32 ``log sum_{j not in E_i} L_j exp(p_ij)`` (``-inf`` when the tail
      is empty) or ``None`` when ``tail=False``.
    - ``tail_value``: ``(B, H, n, D)`` fp32 weighted mean of ``vm_j`` over that tail, or ``None``.
    - ``coarse``: ``(B, H, n, D)`` fp32 ``sum_j softmax_j(scale qm_i . km_j) vm_j``, or ``None``;
      a backend adds ``gate_t * coarse_i`` to every row t of query block i.
    """

    key_mean: Optional[torch.Tensor] = None
    tail_lse: Optional[torch.Tensor] = None
    tail_value: Optional[torch.Tensor] = None
    coarse: Optional[torch.Tensor] = None

    @property
    def head_dim(self) -> int:
        return self.key_mean.shape[-1]

    def selection(self) -> Plan:
        """The selection alone, sharing this plan's tensors (and its transposed lists, once built)."""
        plan = Plan(kv_num_blocks=self.kv_num_blocks, kv_indices=self.kv_indices, block_len=self.block_len,
                    touches_dead=self.touches_dead, seq_len=self.seq_len, block_size=self.block_size)
        if "query_lists" in self._derived:
            plan._derived["query_lists"] = self._derived["query_lists"]
        return plan


def _describe(batch: int, heads: int, seq_len: int, block_size: int, device) -> str:
    return f"B={batch} H={heads} T={seq_len}, {block_size}-token blocks, on {device}"


def check_plan(fn: str, plan, B: int, H: int, T: int, device: torch.device) -> Plan:
    """The selection of ``plan`` when it covers a call of these shapes (``T``: the rows the
    backend runs on), 64-token blocks and ``device``; else a ``TypeError`` / ``ValueError`` naming
    ``fn``'s argument ``plan``, what it holds and what the call needs. Only the selection is
    taken: every other term is the call's own. Metadata only: no host sync."""
    if not isinstance(plan, Plan):
        fail(fn, "plan", type(plan).__name__, "None or a solattn Plan (solattn.plan(...))", TypeError)
    want = _describe(B, H, T, BLOCK, torch.device(device))
    got = _describe(plan.batch, plan.heads, plan.seq_len, plan.block_size, plan.device)
    if got != want:
        fail(fn, "plan", f"a selection of {got}", f"a selection for this call: {want}")
    return plan.selection()


def coarse_rows(qm: torch.Tensor, km: torch.Tensor, vm: torch.Tensor, scale: float) -> torch.Tensor:
    """The coarse branch of query-block rows ``qm`` ``(..., r, D)`` against all blocks ``km``, ``vm``
    ``(..., n, D)``: ``softmax_j(scale qm_i . km_j) vm_j`` (uncentred means), ``(..., r, D)`` fp32."""
    return torch.softmax(scale * (qm @ km.transpose(-1, -2)), dim=-1) @ vm


def tail_rows(qm: torch.Tensor, kmc: torch.Tensor, vm: torch.Tensor, logL: torch.Tensor, scale: float,
              exact: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The pooled tail of query-block rows ``qm`` ``(..., r, D)`` over the blocks not in ``exact``
    ``(..., r, n)``: ``(tail_lse (..., r), tail_value (..., r, D))`` with centred means ``kmc``."""
    logw = (scale * (qm @ kmc.transpose(-1, -2)) + logL).masked_fill_(exact, -math.inf)
    # One exp serves both terms: w = exp(logw - mx) with mx the row max (0 for an empty tail,
    # whose weights are then all 0); sum(w) >= 1 otherwise (the max term is exp(0)). The result
    # does not depend on mx, so it carries no gradient.
    mx = logw.detach().amax(dim=-1, keepdim=True)
    mx = mx.masked_fill_(torch.isneginf(mx), 0.0)
    w = torch.exp(logw - mx)
    total = w.sum(dim=-1, keepdim=True)
    lse = (torch.log(total) + mx).squeeze(-1)                             # -inf for an empty tail
    # An empty tail (total 0) divides by 1 (value 0). A select, not total.clamp_min(1.0): a tail
    # of one block has total exactly 1, on the clamp's bound, where torch defines no gradient
    # (torch <= 2.13 passed it, 2.14 gives 0 there and so lost the tail value's gradient in q, k).
    divisor = torch.where(total > 0, total, torch.ones((), dtype=total.dtype, device=total.device))
    return lse, (w @ vm) / divisor                                    # value 0 for an empty tail


def indices_from_mask(exact: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Dense ``(..., n)`` bool block mask -> ``(kv_num_blocks, kv_indices)`` int32, ascending, 0-padded.

    Each selected block j goes to column ``cumsum - 1`` of its row (elementwise, no sort);
    unselected blocks go to a scratch column that is dropped. One host sync (the width M).
    """
    counts, idx = _indices_from_mask(exact)
    return counts, idx.contiguous()


def _indices_from_mask(exact: torch.Tensor, width: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`indices_from_mask` with the indices as a view (the caller copies them into place).
    Selected block j goes to column ``cumsum_j`` (1-based), unselected ones to scratch column 0.
    ``width``: the lists' width when the caller knows one that holds every count (n): no host sync."""
    n = exact.shape[-1]
    counts = exact.sum(dim=-1, dtype=torch.int32)
    if width is not None:
        M = width
    else:
        M = max(1, int(counts.max().item())) if counts.numel() else 1
    pos = exact.cumsum(dim=-1).mul_(exact)                                # int64; 0 where unselected
    idx = torch.zeros(*exact.shape[:-1], M + 1, dtype=torch.int32, device=exact.device)
    idx.scatter_(-1, pos, _arange(n, exact.device).expand_as(exact))
    return counts, idx[..., 1:]


@device_constant
def _arange(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n)`` int32, shared read-only (a scatter source, and the padding test of
    :meth:`Plan.dense_mask`)."""
    return torch.arange(n, device=device, dtype=torch.int32)


def plan_chunks(groups: int, n: int, nbytes: int) -> Iterator[Tuple[int, int, int, int]]:
    """``(g0, g1, i0, i1)`` chunks covering ``groups x n`` query-block rows such that one chunk's
    ``(g1 - g0) * (i1 - i0) * n`` score elements take at most ``nbytes`` at :data:`BYTES_PER_SCORE`
    (at least one row of one group per chunk)."""
    elems = max(n, nbytes // BYTES_PER_SCORE)
    if elems >= n * n:                                   # whole groups per chunk
        step = min(groups, elems // (n * n))
        for g0 in range(0, groups, step):
            yield g0, min(groups, g0 + step), 0, n
    else:                                                # one group, a band of rows per chunk
        rows = max(1, elems // n)
        for g0 in range(groups):
            for i0 in range(0, n, rows):
                yield g0, g0 + 1, i0, min(n, i0 + rows)


def assemble_plan(problem: Problem, stats: BlockStats, select: Selector, tail: bool, coarse: bool,
                  nbytes: Optional[int] = None) -> CallPlan:
    """Build a :class:`CallPlan` from block statistics and a selection rule, chunk by chunk.

    ``select`` gives the exact key blocks of a chunk (see :data:`Selector`; it runs without
    gradients). For each chunk the selection is turned into ordered indices and, when asked,
    the tail terms (centred means, over the blocks outside the selection) and the coarse term
    (uncentred means, over all blocks). ``nbytes`` bounds one chunk's temporaries (default: the
    ``sdpa`` memory budget in force), so the plan's working memory is that budget plus its own
    outputs, at any T and H. With gradients enabled, autograd keeps each chunk's tail and coarse
    intermediates for the backward pass, outside that bound.
    """
    B, H, n, D = stats.qm.shape
    nbytes = current_budget("sdpa") if nbytes is None else nbytes
    chunks = list(plan_chunks(B * H, n, nbytes))
    g0, g1, i0, i1 = chunks[0]
    # A chunk below _SERIAL_SCORES scores is a few ms of single-threaded work split over dozens of
    # small ops: on the CPU they run with one intra-op thread (see serial_cpu); larger chunks
    # keep the default threads, their ops being long enough to pay for a parallel region.
    small = (g1 - g0) * (i1 - i0) * n < _SERIAL_SCORES
    with serial_cpu(stats.qm.device.type == "cpu" and small):
        return _assemble(problem, stats, select, tail, coarse, chunks)


def _assemble(problem: Problem, stats: BlockStats, select: Selector, tail: bool, coarse: bool,
              chunks: List[Tuple[int, int, int, int]]) -> CallPlan:
    """:func:`assemble_plan` over the given chunks (in :func:`plan_chunks` order)."""
    B, H, n, D = stats.qm.shape
    G, dev = B * H, stats.qm.device
    qm, km, vm = (x.reshape(G, n, D) for x in (stats.qm, stats.km, stats.vm))
    kmc = (stats.km - stats.m).reshape(G, n, D) if tail else None
    logL = torch.log(stats.L.to(torch.float32)) if tail else None
    dead_block = stats.L < BLOCK
    any_dead = bool(dead_block.any())

    def bh(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if x is None else x.view(B, H, *x.shape[1:])

    if len(chunks) == 1:                                 # the whole plan at once: no staging
        with torch.no_grad():
            exact = select(0, G, 0, n)
            touches = ((exact & dead_block).any(dim=-1) if any_dead
                       else torch.zeros(G, n, dtype=torch.bool, device=dev))
            counts, idx = _indices_from_mask(exact)
            idx = idx.contiguous()
        lse = tv = part = None
        if tail:
            lse, tv = tail_rows(qm, kmc, vm, logL, problem.scale, exact)
        del exact
        if coarse:
            part = coarse_rows(qm, km, vm, problem.scale)
        return CallPlan(kv_num_blocks=bh(counts), kv_indices=bh(idx), block_len=stats.L, key_mean=stats.m,
                    tail_lse=bh(lse), tail_value=bh(tv), coarse=bh(part), touches_dead=bh(touches),
                    seq_len=problem.T)

    # Everything that outlives a chunk is allocated before the loop and written in place: on the
    # CPU, small long-lived allocations made between the chunks' large temporaries pin glibc's
    # heap, which then grows chunk after chunk (measured: +420 MiB over 32 chunks of 8 MiB).
    kv_num_blocks = torch.empty(G, n, dtype=torch.int32, device=dev)
    kv_indices = torch.zeros(G, n, 1, dtype=torch.int32, device=dev)  # widened as counts grow
    touches = torch.zeros(G, n, dtype=torch.bool, device=dev)
    graph = torch.is_grad_enabled() and any(x.requires_grad for x in (stats.qm, stats.km, stats.vm))
    if graph:                                            # autograd: differentiable concatenation
        lse_parts: List[torch.Tensor] = []
        tv_parts: List[torch.Tensor] = []
        coarse_parts: List[torch.Tensor] = []
    else:
        tail_lse = torch.empty(G, n, dtype=torch.float32, device=dev) if tail else None
        tail_value = torch.empty(G, n, D, dtype=torch.float32, device=dev) if tail else None
        coarse_out = torch.empty(G, n, D, dtype=torch.float32, device=dev) if coarse else None
    M = 1
    for g0, g1, i0, i1 in chunks:
        with torch.no_grad():
            exact = select(g0, g1, i0, i1)
            if any_dead:
                touches[g0:g1, i0:i1] = (exact & dead_block).any(dim=-1)
            counts, idx = _indices_from_mask(exact)
            kv_num_blocks[g0:g1, i0:i1] = counts
            if idx.shape[-1] > kv_indices.shape[-1]:     # widen (doubling: few reallocations)
                wider = torch.zeros(G, n, min(n, max(idx.shape[-1], 2 * kv_indices.shape[-1])),
                                    dtype=torch.int32, device=dev)
                wider[..., :kv_indices.shape[-1]] = kv_indices
                kv_indices = wider
            kv_indices[g0:g1, i0:i1, :idx.shape[-1]] = idx
            M = max(M, idx.shape[-1])
            del counts, idx
        if tail:
            lse, tv = tail_rows(qm[g0:g1, i0:i1], kmc[g0:g1], vm[g0:g1], logL, problem.scale, exact)
            if graph:
                lse_parts.append(lse)
                tv_parts.append(tv)
            else:
                tail_lse[g0:g1, i0:i1] = lse
                tail_value[g0:g1, i0:i1] = tv
            del lse, tv
        del exact
        if coarse:
            part = coarse_rows(qm[g0:g1, i0:i1], km[g0:g1], vm[g0:g1], problem.scale)
            if graph:
                coarse_parts.append(part)
            else:
                coarse_out[g0:g1, i0:i1] = part
            del part
    if kv_indices.shape[-1] != M:
        kv_indices = kv_indices[..., :M].contiguous()
    if graph:
        def joined(parts: List[torch.Tensor]) -> torch.Tensor:
            """Chunk results in ``plan_chunks`` order -> ``(G, n, ...)``: rows first, then groups."""
            groups, row = [], []
            for (_, _, _, i1), part in zip(chunks, parts):
                row.append(part)
                if i1 == n:
                    groups.append(torch.cat(row, dim=1) if len(row) > 1 else row[0])
                    row = []
            return torch.cat(groups, dim=0) if len(groups) > 1 else groups[0]

        tail_lse = joined(lse_parts) if tail else None
        tail_value = joined(tv_parts) if tail else None
        coarse_out = joined(coarse_parts) if coarse else None

    return CallPlan(kv_num_blocks=bh(kv_num_blocks), kv_indices=bh(kv_indices), block_len=stats.L,
                key_mean=stats.m, tail_lse=bh(tail_lse), tail_value=bh(tail_value), coarse=bh(coarse_out),
                touches_dead=bh(touches), seq_len=problem.T)


def plan_with_values(problem: Problem, selection: Plan, nbytes: Optional[int] = None) -> CallPlan:
    """``problem``'s :class:`CallPlan` with ``selection``'s exact sets held: the key centroid, the
    tail terms (when ``problem.tail``) and the coarse term (with a ``coarse_gate``) from
    ``problem``'s own block means and live lengths, as :func:`assemble_plan` computes them for a
    selection of its own. ``selection`` must cover the problem's batch, heads and rows
    (:func:`check_plan`). No host synchronisation (a CUDA graph may capture it); chunked as
    :func:`assemble_plan` is (``nbytes``); with gradients enabled the terms record autograd."""
    B, H, n, T = problem.B, problem.H, problem.n, problem.T
    G, D, dev = B * H, problem.D, problem.device
    tail, coarse = problem.tail, problem.coarse_gate is not None
    if tail or coarse:
        stats = block_stats(problem)
        L, m = stats.L, stats.m
    else:                                   # the centroid alone: the key means
        L = live_lengths(problem)
        km = block_means(problem.k, L, problem.block_len is None or problem.dead_rows_zero)
        m = km.mean(dim=2, keepdim=True)
    kv_num, kv_idx = selection.kv_num_blocks, selection.kv_indices
    M = kv_idx.shape[-1]
    listed = _arange(M, dev) < kv_num[..., None]                          # (B, H, n, M)
    touches = ((L < BLOCK)[kv_idx.long()] & listed).any(dim=-1)
    lse = tv = part = None
    if tail or coarse:
        nbytes = current_budget("sdpa") if nbytes is None else nbytes
        qm, km, vm = (x.reshape(G, n, D) for x in (stats.qm, stats.km, stats.vm))
        kmc = (stats.km - m).reshape(G, n, D) if tail else None
        logL = torch.log(L.to(torch.float32)) if tail else None
        cnt, idx = kv_num.reshape(G, n), kv_idx.reshape(G, n, M)
        lse_parts, tv_parts, coarse_parts, chunks = [], [], [], list(plan_chunks(G, n, nbytes))
        for g0, g1, i0, i1 in chunks:
            if tail:
                with torch.no_grad():
                    exact = _mask_of_lists(cnt[g0:g1, i0:i1], idx[g0:g1, i0:i1], n)
                l, t = tail_rows(qm[g0:g1, i0:i1], kmc[g0:g1], vm[g0:g1], logL, problem.scale, exact)
                lse_parts.append(l)
                tv_parts.append(t)
                del exact
            if coarse:
                coarse_parts.append(coarse_rows(qm[g0:g1, i0:i1], km[g0:g1], vm[g0:g1], problem.scale))

        def joined(parts: List[torch.Tensor]) -> torch.Tensor:
            """Chunk results in ``plan_chunks`` order -> ``(B, H, n, ...)``: rows first, then groups."""
            groups, row = [], []
            for (_, _, _, i1), piece in zip(chunks, parts):
                row.append(piece)
                if i1 == n:
                    groups.append(torch.cat(row, dim=1) if len(row) > 1 else row[0])
                    row = []
            whole = torch.cat(groups, dim=0) if len(groups) > 1 else groups[0]
            return whole.view(B, H, *whole.shape[1:])

        lse = joined(lse_parts) if tail else None
        tv = joined(tv_parts) if tail else None
        part = joined(coarse_parts) if coarse else None
    return CallPlan(kv_num_blocks=kv_num, kv_indices=kv_idx, block_len=L, touches_dead=touches, seq_len=T,
                    key_mean=m, tail_lse=lse, tail_value=tv, coarse=part)


def _mask_of_lists(counts: torch.Tensor, indices: torch.Tensor, n: int) -> torch.Tensor:
    """``(..., n)`` bool mask of the first ``counts`` entries of ``indices`` ``(..., M)`` (no host sync)."""
    padding = _arange(indices.shape[-1], indices.device) >= counts[..., None]
    cols = indices.long().masked_fill(padding, n)                        # padding -> scratch column n
    mask = torch.zeros(*counts.shape, n + 1, dtype=torch.bool, device=indices.device)
    return mask.scatter_(-1, cols, True)[..., :n]
