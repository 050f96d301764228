"""The routing plan as FlexAttention's ``BlockMask``, and the compiled call that runs it.

One compiled function per call shape (:class:`Key`) computes SPEC.md's output from the plan:

- exact keys: the plan's own ``BlockMask`` (:meth:`Plan.to_block_mask`, 64 x 64 blocks, the one
  conversion of a plan in the project), built outside the compiled function and passed in.
  Blocks whose rows are all live run without a mask ("full" blocks); blocks with dead rows
  (``block_len``, the ragged last block) and the tail block are "partial" and run the ``mask_mod``.
- ``key_bias`` is the ``score_mod`` ``score + bias[b, key]``.
- the pooled tail enters the same softmax as extra keys, one per query block, rather than
  through a log-sum-exp merge (torch.compile's CPU flex_attention returns no log-sum-exp in
  torch 2.13): the keys are extended by ``ceil(n / 64)`` blocks of zero keys (the mask's
  ``tail_slots``), the value of slot ``i`` is query block ``i``'s tail value, the mask shows slot
  ``i`` only to query block ``i``, and it gets the logit ``tail_lse_i + scale q_t . m``: on the
  CPU as the product of q and k widened by :data:`TAIL_DIMS` dims (:func:`_tail_in_dims`), so
  the exact blocks run no ``score_mod``; elsewhere, and on the CPU at a scale below
  :data:`DIMS_SCALE_FLOOR` (0 included), from the ``score_mod``, in fp32.
  The exact keys are used uncentred: every exact logit of row t is then ``scale q_t . m``
  larger than SPEC.md's centred one, and the tail's logit carries the same shift, so the
  softmax is SPEC.md's. Each query block attends one extra key block (its tail slot's).
- the coarse branch is added after the cast to v's dtype, outside the compiled graph (eagerly,
  on the compiled call's output): fused into the graph it becomes an epilogue of the attention,
  which torch's CPU lowering refuses ("Unsupported for epilogue_nodes in
  CppFlexAttentionTemplate", seen with torch 2.13).

Compiled functions are cached per :class:`Key`, so a call with new tensors of a cached shape runs
without tracing again. Each holds its own copy of the traced code, but torch.compile (2.11 and
later) enters every compiled function through one shared wrapper frame, whose recompile limit
(8 by default) would then count every shape of the process: the compiled calls run with that
limit raised (:func:`_shape_limit`), so any number of shapes compiles, each once.

On CUDA the kernel's tile sizes are set to divide the 64 x 64 blocks of the mask
(:data:`CUDA_KERNEL_OPTIONS`): torch's defaults on recent GPUs use 128-row tiles, which a
64 x 64 ``BlockMask`` refuses to lower with.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from ...routing import Plan
from ...routing.stats import serial_cpu
from ...validation import BLOCK, Problem
from ..base import add_coarse

#: compiled functions kept (least recently used dropped first)
CACHE_SIZE = 32
#: recompile limit of the compiled calls' shared entry frame while they run: far above any
#: number of shapes one process sees (evicted keys compile again and count again)
RECOMPILE_LIMIT = 100_000
#: on the CPU, query and key dims appended to carry the tail slot's logit (4 used, the rest zero
#: so rows stay 32-byte aligned), instead of a ``score_mod`` evaluated on every score
TAIL_DIMS = 16
#: smallest ``|scale|`` at which the appended dims carry the tail's logit: they hold
#: ``tail_lse / scale`` in the input dtype, split over two dims and scaled by a power of two
#: (:func:`_unit`), which fp16 holds up to about 2.7e8 (``tail_lse`` up to 6.6e4 at 2^-12) and bf16
#: or fp32 up to their range; below it (``scale=0`` included: uniform attention) the tail's
#: logit comes from the ``score_mod``, in fp32, whatever the scale
DIMS_SCALE_FLOOR = {torch.float16: 2.0 ** -12, torch.bfloat16: 2.0 ** -40, torch.float32: 2.0 ** -40}
#: fp32 working memory of the coarse branch's add, bytes (it runs in chunks of whole blocks)
COARSE_BYTES = 256 << 20
#: flex_attention tile sizes on CUDA (forward BLOCK_M x BLOCK_N, backward M1 x N1 for dK/dV and
#: M2 x N2 for dQ), each dividing the mask's 64 x 64 blocks
CUDA_KERNEL_OPTIONS = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_M1": 32, "BLOCK_N1": 64,
                       "BLOCK_M2": 64, "BLOCK_N2": 32}


@dataclass(frozen=True)
class Key:
    """Everything a compiled function is specialised on."""

    device: str
    dtype: torch.dtype
    B: int
    T: int
    H: int
    D: int
    bias_rows: int          # 0 (no key_bias), 1 or B
    tail: bool
    scale: float

    @property
    def n(self) -> int:
        return -(-self.T // BLOCK)

    @property
    def tail_blocks(self) -> int:
        """Key blocks holding the tail slots (one slot per query block)."""
        return -(-self.n // BLOCK) if self.tail else 0

    @property
    def tail_dims(self) -> int:
        """Dims appended to q and k for the tail slot's logit (:data:`TAIL_DIMS` on the CPU, with the
        tail, at a scale of at least :data:`DIMS_SCALE_FLOOR`), else 0 (the ``score_mod`` gives it)."""
        if not (self.tail and self.device.startswith("cpu")):
            return 0
        return TAIL_DIMS if abs(self.scale) >= DIMS_SCALE_FLOOR[self.dtype] else 0

    @property
    def key_len(self) -> int:
        """Keys the kernel sees: T, or every block padded to 64 plus the tail slots."""
        return self.n * BLOCK + self.tail_blocks * BLOCK if self.tail else self.T


def call_key(p: Problem, plan: Optional[Plan] = None) -> Key:
    """The compiled function's key of a call (its plan has tail terms exactly when ``p.tail``)."""
    return Key(device=str(p.device), dtype=p.dtype, B=p.B, T=p.T, H=p.H, D=p.D,
               bias_rows=0 if p.key_bias is None else p.key_bias.shape[0], tail=p.tail, scale=p.scale)


#: bytes per element of the ``(B, H, n, key blocks)`` selection while :meth:`Plan.to_block_mask`
#: runs: two int32 lists kept (partial and full blocks), and at the peak the bool mask, its
#: partial part and the int64 positions of one list
MASK_BYTES_PER_BLOCK_PAIR = 2 * 4 + 2 * 1 + 8 + 4


def working_bytes(p: Problem) -> int:
    """An upper estimate of what a call of ``p`` allocates beyond its inputs, output and plan:
    the ``BlockMask`` (its lists are ``(B, H, n, n)`` int32 twice), the copies the tail needs
    (q widened, k and v extended by the tail slots; fp32 terms of its logit) or that dead rows
    need (zeroed copies), the padded ``key_bias``, the kernel's ``(B, H, T, D)`` output before its
    transpose, and one chunk of the coarse branch's add."""
    key = call_key(p)
    B, T, H, D, n = p.B, p.T, p.H, p.D, key.n
    es = p.dtype.itemsize
    total = B * H * n * (n + key.tail_blocks) * MASK_BYTES_PER_BLOCK_PAIR
    total += B * H * T * D * es                                       # the kernel's output, transposed after
    if key.tail:
        E = key.tail_dims
        total += B * H * (T + key.key_len) * (D + E) * es + B * H * key.key_len * D * es
        total += B * H * T * (D + 2) * 4 if E else 2 * B * H * T * 4   # fp32 terms of the tail's logit
    elif p.block_len is not None and not p.dead_rows_zero:
        total += 3 * B * H * T * D * es                                # q, k and v with dead rows zeroed
    if p.key_bias is not None:
        total += B * key.key_len * 4
    if p.coarse_gate is not None:
        total += min(COARSE_BYTES, B * T * H * D * 12)
    return total


def _attend(key: Key, q, k, v, mask, bias, tlog):
    """The traced computation: the fine branch, ``(B, T, H, D)`` of v's dtype, contiguous. ``q``, ``k``, ``v``
    are ``(B, H, T, D)`` views; ``mask`` is the plan's ``BlockMask`` (with the tail slots when the
    tail is on); with the tail, ``k`` and ``v`` are the extended tensors and ``tlog`` the tail
    slot's ``(B, H, T)`` fp32 logit per query row (computed outside: the CPU kernel takes only
    stored tensors into its ``score_mod``)."""
    from torch.nn.attention.flex_attention import flex_attention

    Tpad, scale = key.n * BLOCK, key.scale

    def score_mod(score, b, h, q_idx, kv_idx):
        if bias is not None:
            score = score + bias[b if key.bias_rows > 1 else 0, kv_idx]
        if tlog is not None:
            score = torch.where(kv_idx >= Tpad, tlog[b, h, q_idx], score)
        return score

    mod = score_mod if (bias is not None or tlog is not None) else None
    options = dict(CUDA_KERNEL_OPTIONS) if q.device.type == "cuda" else None
    out = flex_attention(q, k, v, score_mod=mod, block_mask=mask, scale=scale, kernel_options=options)
    return out.transpose(1, 2).contiguous()


_cache: "collections.OrderedDict[Key, Callable]" = collections.OrderedDict()
_lock = threading.Lock()
#: keys whose compiled function has run once (compiled without error)
_ran: set = set()


def is_compiled(key: Key) -> bool:
    return key in _ran and key in _cache


def mark_compiled(key: Key) -> None:
    _ran.add(key)


def compile_fn(key: Key) -> Callable:
    """``torch.compile`` of :func:`_attend` bound to ``key``, through an entry function of its own
    (compiled anew here): torch.compile keeps its compiled entries and recompile count per code
    object, so each :class:`Key`'s entry holds exactly one. A seam for tests (forcing a failure)."""
    scope = {"_attend": _attend, "KEY": key}
    exec(compile("def run(*args):\n    return _attend(KEY, *args)\n", f"<solattn flex {key}>", "exec"), scope)
    return torch.compile(scope["run"], dynamic=False, fullgraph=True)


def compiled_for(key: Key) -> Callable:
    """The function of ``key``, compiled on first use."""
    with _lock:
        fn = _cache.get(key)
        if fn is None:
            fn = _cache[key] = compile_fn(key)
            while len(_cache) > CACHE_SIZE:
                _cache.popitem(last=False)
        else:
            _cache.move_to_end(key)
    return fn


def _shape_limit():
    """A context in which torch.compile's recompile limits (per entry frame and accumulated) are
    :data:`RECOMPILE_LIMIT`, under the names this torch uses."""
    from torch._dynamo import config
    pairs = (("recompile_limit", "cache_size_limit"), ("accumulated_recompile_limit", "accumulated_cache_size_limit"))
    names = [next(n for n in pair if hasattr(config, n)) for pair in pairs if any(hasattr(config, n) for n in pair)]
    return config.patch(**{n: max(getattr(config, n), RECOMPILE_LIMIT) for n in names})


def forget(key: Key) -> None:
    """Drop ``key``'s function (its compile failed: the next call by name compiles again)."""
    with _lock:
        _cache.pop(key, None)
        _ran.discard(key)


def cached_keys() -> Tuple[Key, ...]:
    return tuple(_cache)


def clear_cache() -> None:
    with _lock:
        _cache.clear()
        _ran.clear()


def _keys_values(key: Key, p: Problem, plan: Plan, live_rows: Optional[torch.Tensor]):
    """``(q, k, v)`` as ``(B, H, T, D)`` (views where nothing needs writing). Dead rows of a caller's
    ``block_len`` are zeroed in copies, so nothing in them, not even a NaN, reaches the
    arithmetic; with the tail, k and v are extended by the tail slots, and q and k widened by
    :attr:`Key.tail_dims` zero dims (:func:`_tail_in_dims` fills the used ones)."""
    q, k, v = (x.transpose(1, 2) for x in (p.q, p.k, p.v))
    dead = None
    if p.block_len is not None and not p.dead_rows_zero:
        dead = ~live_rows[:p.T].view(1, 1, p.T, 1)
        q = q.masked_fill(dead, 0)
    if not key.tail:
        if dead is not None:
            k, v = k.masked_fill(dead, 0), v.masked_fill(dead, 0)
        return q, k, v
    B, H, T, D = q.shape
    E = key.tail_dims
    Tpad = key.n * BLOCK
    if E:
        q_w = q.new_zeros(B, H, T, D + E)
        q_w[..., :D] = q
        q = q_w
    k_ext, v_ext = k.new_empty(B, H, key.key_len, D + E), v.new_empty(B, H, key.key_len, D)   # one copy each
    for ext, x in ((k_ext, k), (v_ext, v)):
        ext[:, :, :T, :D] = x
        ext[:, :, T:] = 0
        if dead is not None:
            ext[:, :, :T].masked_fill_(dead, 0)
    if E:
        k_ext[:, :, :T, D:] = 0
    v_ext[:, :, Tpad:Tpad + key.n] = plan.tail_value
    return q, k_ext, v_ext


def _split(x: torch.Tensor, dtype: torch.dtype):
    """fp32 ``x`` as ``hi + lo`` in ``dtype`` (``hi`` rounded, ``lo`` the rounded rest; 0 where ``x``
    is infinite), so that an fp32 sum of the two recovers ``x`` to about ``2^-16`` relative in bf16."""
    hi = x.to(dtype)
    lo = torch.where(torch.isfinite(x), x - hi.float(), torch.zeros((), device=x.device)).to(dtype)
    return hi, lo


def _unit(a: torch.Tensor, dtype: torch.dtype) -> float:
    """A power of two ``u`` such that ``a / u`` stays well inside ``dtype``'s range (1 unless it
    would not: fp16 holds at most 65504, and ``tail_lse / scale`` passes that for logits of a few
    thousand). The query side then carries ``u`` instead of 1; a power of two keeps the product
    exact. Reads ``a``'s largest finite magnitude (a host sync: this path runs on the CPU)."""
    finite = a[torch.isfinite(a)]
    big = float(finite.abs().max()) if finite.numel() else 0.0
    limit = torch.finfo(dtype).max / 4
    return 1.0 if big <= limit else 2.0 ** math.ceil(math.log2(big / limit))


def _tail_in_dims(key: Key, p: Problem, plan: Plan, q_w: torch.Tensor, k_ext: torch.Tensor) -> None:
    """The tail slot's logit ``tail_lse_i + scale q_t . m`` as the product of the widened q and k
    (no ``score_mod``): query row t carries ``(1, 1, c_hi, c_lo)`` in the appended dims and query
    block i's slot key carries ``m`` rounded to the input dtype (``m_r``) and ``(a_hi, a_lo, 1, 1)``,
    where ``a = tail_lse_i / scale`` and ``c = q_t . (m - m_r)`` (fp32, split in two), so that
    ``scale (q_t . m_r + a + c) = scale q_t . m + tail_lse_i`` with every product exact and the sum
    in fp32 (where ``a`` or ``c`` would overflow the dtype, the side that carries 1 carries a power
    of two ``u`` instead and the other side the value divided by it, :func:`_unit`); exact keys
    carry zeros there. An empty tail (``tail_lse = -inf``) gives ``-inf``."""
    D, dt, n = p.D, q_w.dtype, key.n
    Tpad = n * BLOCK
    m = plan.key_mean[:, :, 0]                                         # (B, H, D) fp32
    m_r = m.to(dt)
    c = torch.einsum("bhtd,bhd->bht", q_w[..., :D].float(), m - m_r.float())   # dead rows of q are 0
    a = plan.tail_lse / p.scale                                      # (B, H, n) fp32
    u, uc = _unit(a, dt), _unit(c, dt)
    q_w[..., D] = u
    q_w[..., D + 1] = u
    q_w[..., D + 2], q_w[..., D + 3] = _split(c / uc, dt)
    slots = k_ext[:, :, Tpad:Tpad + n]
    slots[..., :D] = m_r[:, :, None]
    slots[..., D], slots[..., D + 1] = _split(a / u, dt)
    slots[..., D + 2] = uc
    slots[..., D + 3] = uc


def flex_forward(p: Problem, plan: Plan) -> torch.Tensor:
    """SPEC.md's output for ``p`` from ``plan`` through ``flex_attention`` (compiled per shape)."""
    key = call_key(p)
    live_rows = None
    if p.block_len is not None:
        lengths = plan.block_len.clamp(max=BLOCK)
        live_rows = (torch.arange(BLOCK, device=p.device)[None, :] < lengths[:, None]).reshape(-1)
    poison = _nan_queries(p, live_rows)
    if poison is not None and key.tail:
        poison, plan = _tail_poison(p, plan, poison, live_rows)
    q, k, v = _keys_values(key, p, plan, live_rows)
    with serial_cpu(p.device.type == "cpu"):     # small block-level ops (see serial_cpu)
        mask = plan.to_block_mask(tail_slots=key.tail, for_backward=False)
    bias = None
    if p.key_bias is not None:
        bias = F.pad(p.key_bias.to(torch.float32), (0, key.key_len - p.T))
    tlog = None
    if key.tail_dims:
        _tail_in_dims(key, p, plan, q, k)
    elif key.tail:     # the tail slot's logit per query row: its block's tail_lse + scale q_t . m, fp32
        blocks = torch.arange(p.T, device=p.device) // BLOCK
        tlog = torch.einsum("bhtd,bhd->bht", q.float(), plan.key_mean[:, :, 0])     # dead rows of q are 0
        tlog = torch.addcmul(plan.tail_lse[:, :, blocks], tlog, torch.tensor(p.scale, device=p.device))
    fn = compiled_for(key)
    # forward only: the inputs of a training call's forward may still require grad, which the
    # inference-only lowering refuses (the mask's tensors never do)
    q, k, v, bias, tlog = (None if a is None else a.detach() for a in (q, k, v, bias, tlog))
    with _shape_limit():
        out = fn(q, k, v, mask, bias, tlog)
    if poison is not None:
        out.masked_fill_(poison[..., None], float("nan"))
    if plan.coarse is not None and p.coarse_gate is not None:     # SPEC.md: cast(fine) + gate * coarse
        out = add_coarse(out, p.coarse_gate.detach(), plan.coarse, COARSE_BYTES // (p.B * p.H * p.D * 12))
    return out


def _nan_queries(p: Problem, live_rows: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``(B, T, H)`` bool: the live query rows holding a NaN, or None when there is none (the
    common case: one reduction of q and a host sync, as this CPU path has anyway). The kernel
    would return 0 for such a row, where SPEC.md's output is NaN: the caller writes it."""
    sums = p.q.sum(-1)                  # NaN where a row holds one (or holds both infinities)
    if not bool(torch.isnan(sums).any()):
        return None
    rows = torch.isnan(p.q).any(-1)
    if live_rows is not None:
        rows &= live_rows[:p.T].view(1, p.T, 1)
    return rows if bool(rows.any()) else None


def _tail_poison(p: Problem, plan: Plan, rows: torch.Tensor, live_rows: Optional[torch.Tensor]):
    """A NaN query token makes its block's mean NaN, hence that block's tail terms when it has a
    tail (SPEC.md: every live row of the block is then NaN). The tail slots of all query blocks
    share key blocks, where one NaN value would reach every row (a zero weight times NaN), so the
    kernel gets those terms as an empty tail (``-inf``, value 0) and the block's live rows are
    added to ``rows``, which the caller fills with NaN. Returns ``(rows, plan)``."""
    bad = torch.isnan(plan.tail_lse) | torch.isnan(plan.tail_value).any(-1)           # (B, H, n)
    if not bool(bad.any()):
        return rows, plan
    plan = dataclasses.replace(plan, tail_lse=plan.tail_lse.masked_fill(bad, -math.inf),
                               tail_value=plan.tail_value.masked_fill(bad[..., None], 0))
    block_rows = bad.repeat_interleave(BLOCK, dim=-1)[..., :p.T].transpose(1, 2)       # (B, T, H)
    if live_rows is not None:
        block_rows = block_rows & live_rows[:p.T].view(1, p.T, 1)
    return rows | block_rows, plan
