"""Argument validation: raw ``sol_attn`` arguments -> one frozen :class:`Problem`.

Everything here looks at metadata only (shapes, dtypes, devices, Python
scalars), so it runs before any arithmetic and also while ``torch.compile``
traces with fake tensors. Backends never re-validate these basics.
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings
from dataclasses import dataclass
from typing import NoReturn, Optional, Tuple

import torch

from .compiling import tracing

BLOCK = 64
"""Tokens per routing block (SPEC.md, "Blocks")."""

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DTYPE_NAMES = "torch.bfloat16, torch.float16 or torch.float32"
""":data:`SUPPORTED_DTYPES` as an error message lists them."""
TOKEN_AUG_VALUES = (0, 64, 128, 192, 256)


def num_blocks(T: int) -> int:
    """``n = ceil(T / 64)``."""
    return (T + BLOCK - 1) // BLOCK


@dataclass(frozen=True, eq=False)
class Problem:
    """A validated ``sol_attn`` call.

    Tensors keep the caller's strides; ``key_bias`` is normalised to an fp32
    ``(Bk, T)`` additive bias with ``Bk`` in ``{1, B}`` (``-inf`` = masked);
    ``sink_blocks`` / ``sink_q`` are clipped to ``[0, n]`` (``None`` when empty).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float
    tau: float
    topk_ratio: float
    tail: bool
    sink_blocks: Optional[Tuple[int, int]]
    sink_q: Optional[Tuple[int, int]]
    key_bias: Optional[torch.Tensor]
    block_len: Optional[torch.Tensor]
    coarse_gate: Optional[torch.Tensor]
    token_aug: int = 0
    #: block_len's dead rows of k and v hold zeros (VSA's tiled layout writes them), so a kernel may
    #: read them unmasked (the triton backend's TMA loads); a caller's own block_len promises nothing
    dead_rows_zero: bool = False
    #: the layout's row table, int64 ``(rows,)``: row r of the problem is token ``rows[r]`` (dim 1)
    #: of q, k, v and coarse_gate when r is live (``block_len``); its dead rows are never read. The
    #: output is then in the tensors' own token order, and ``T`` counts the rows. Only backends
    #: with ``Backend.row_table`` get such a problem (VSA's tiled layout without a gathered copy);
    #: None: row r is token r
    rows: Optional[torch.Tensor] = None

    @property
    def B(self) -> int:
        return self.q.shape[0]

    @functools.cached_property          # kept in the instance's __dict__: read many times per call
    def T(self) -> int:
        return self.q.shape[1] if self.rows is None else self.rows.shape[0]

    @property
    def H(self) -> int:
        return self.q.shape[2]

    @property
    def D(self) -> int:
        return self.q.shape[3]

    @functools.cached_property
    def n(self) -> int:
        return num_blocks(self.T)

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def mode(self) -> str:
        return "topk" if self.topk_ratio > 0 else "tau"

    @property
    def requires_grad(self) -> bool:
        ts = (self.q, self.k, self.v, self.coarse_gate)
        return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)

    @property
    def features(self) -> frozenset:
        """Names of the optional SPEC.md features this call uses."""
        f = {self.mode}
        if self.tail:
            f.add("tail")
        if self.key_bias is not None:
            f.add("key_bias")
        if self.block_len is not None:
            f.add("block_len")
        if self.coarse_gate is not None:
            f.add("coarse_gate")
        if self.sink_blocks is not None:
            f.add("sink_blocks")
        if self.sink_q is not None:
            f.add("sink_q")
        if self.requires_grad:
            f.add("autograd")
        return frozenset(f)

    def describe(self) -> str:
        return (f"B={self.B} T={self.T} H={self.H} D={self.D} {str(self.dtype).replace('torch.', '')} "
                f"on {self.device.type}, features: {', '.join(sorted(self.features))}")


# No video or language model has hundreds of heads and fewer tokens than heads, while
# SDPA's (B, H, T, D) passed as (B, T, H, D) gives exactly that: a likely layout mistake.
_LAYOUT_HEADS = 256
_layout_warned = False


def _warn_if_sdpa_layout(shape: Tuple[int, int, int, int]) -> None:
    """Warn once per process when q looks like SDPA's ``(B, H, T, D)`` layout."""
    global _layout_warned
    B, T, H, D = shape
    # while torch.compile traces, stay silent (a warning would break the graph); the custom
    # op validates again when it runs, and warns then
    if _layout_warned or not (H > _LAYOUT_HEADS and H > T) or tracing():
        return
    _layout_warned = True
    warnings.warn(
        f"sol_attn: q has shape {tuple(shape)}, read as (B, T, H, D): T={T} tokens and H={H} heads. "
        "sol_attn takes (B, T, H, D), not the (B, H, T, D) layout of "
        "torch.nn.functional.scaled_dot_product_attention; if these tensors are (B, H, T, D), "
        "pass q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2) (and transpose the output "
        "back). This warning is shown once.", UserWarning, stacklevel=4)


def fail(fn: str, arg: str, received, allowed: str, exc=ValueError) -> NoReturn:
    """Raise ``exc`` (``TypeError`` for a wrong type, ``ValueError`` for a wrong value) with
    solattn's refusal message: the function, the argument, what it received, what is allowed."""
    raise exc(f"{fn}: argument '{arg}' received {received}; allowed: {allowed}")


def _fail(arg: str, received, allowed: str, exc=ValueError) -> NoReturn:
    fail("sol_attn", arg, received, allowed, exc)


def tensor_desc(t: torch.Tensor) -> str:
    """A tensor as refusal messages describe it: shape, dtype, device."""
    return f"a tensor of shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def check_qkv(fn: str, q, k, v, layout: str = "(B, T, H, D)") -> None:
    """``q``, ``k``, ``v`` are 4-D tensors of a supported dtype, ``k`` and ``v`` with q's shape,
    dtype and device; ``layout`` names the expected shape in the messages."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            fail(fn, name, type(t).__name__, f"a torch.Tensor of shape {layout}", TypeError)
        if t.dim() != 4:
            fail(fn, name, tensor_desc(t), f"a 4-D tensor of shape {layout}")
        if t.dtype not in SUPPORTED_DTYPES:
            fail(fn, name, tensor_desc(t), f"dtype {DTYPE_NAMES}", TypeError)
    if k.device == v.device != q.device:          # q is the odd one out (e.g. on the meta device)
        fail(fn, "q", tensor_desc(q), f"the device of k and v ({k.device})")
    for name, t in (("k", k), ("v", v)):
        if t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
            fail(fn, name, tensor_desc(t), f"the shape, dtype and device of q ({tensor_desc(q)})")


def check_gate(fn: str, arg: str, gate, q: torch.Tensor, shape_note: str = "") -> None:
    """``gate`` is None or a tensor of a supported dtype with q's shape and device (``shape_note``
    follows the shape in the message, e.g. how it is sharded)."""
    if gate is None:
        return
    allowed = f"None or a tensor of dtype {DTYPE_NAMES} and q's shape {tuple(q.shape)}{shape_note} on {q.device}"
    if not isinstance(gate, torch.Tensor):
        fail(fn, arg, type(gate).__name__, allowed, TypeError)
    if gate.dtype not in SUPPORTED_DTYPES:
        fail(fn, arg, tensor_desc(gate), allowed, TypeError)
    if gate.shape != q.shape or gate.device != q.device:
        fail(fn, arg, tensor_desc(gate), allowed)


FP32_MAX = torch.finfo(torch.float32).max
#: what a float argument may be: the kernels compute in fp32 at least
FINITE_FLOAT = f"a finite float of magnitude at most {FP32_MAX} (fp32's largest)"


def _check_real(name: str, value, allow_none: bool = False) -> Optional[float]:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(name, f"{value!r} of type {type(value).__name__}",
              FINITE_FLOAT + (" or None" if allow_none else ""), TypeError)
    value = float(value)
    if not finite(value):
        _fail(name, repr(value), FINITE_FLOAT + (" or None" if allow_none else ""))
    return value


def finite(value: float) -> bool:
    """Whether ``value`` is finite in fp32 (``1e39`` is finite in float64 only, and would turn
    every output non-finite), as a comparison, which torch.compile can trace when
    ``dynamic=True`` makes the value symbolic (False for nan and +-inf)."""
    return abs(value) <= FP32_MAX


def _check_range(name: str, value, n: int) -> Optional[Tuple[int, int]]:
    """``[start, end)`` block range -> clipped to ``[0, n]``; None when absent or empty."""
    if value is None:
        return None
    allowed = "None or a pair of ints [start, end) with 0 <= start <= end"
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        _fail(name, repr(value), allowed, TypeError)
    if not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in value):
        _fail(name, repr(tuple(value)), allowed, TypeError)
    s0, s1 = int(value[0]), int(value[1])
    if not (0 <= s0 <= s1):
        _fail(name, repr((s0, s1)), allowed)
    s0, s1 = min(s0, n), min(s1, n)
    return (s0, s1) if s1 > s0 else None


#: largest magnitude of a finite ``key_bias`` entry (SPEC.md): beyond it an entry acts as this
#: bound, on every backend (an fp64 1e300 would otherwise become inf in fp32)
KEY_BIAS_LIMIT = 1e30


def _normalise_key_bias(key_bias, B: int, T: int, device) -> Optional[torch.Tensor]:
    if key_bias is None:
        return None
    allowed = ("a bool or float tensor of shape (T,), (B, T), (1, T), (B, 1, 1, T) or (1, 1, 1, T) "
               f"with T={T}, B={B}, on {device}; masks varying over heads or queries are not supported")
    if not isinstance(key_bias, torch.Tensor):
        _fail("key_bias", f"{type(key_bias).__name__}", allowed, TypeError)
    if key_bias.dtype != torch.bool and not key_bias.dtype.is_floating_point:
        _fail("key_bias", tensor_desc(key_bias), allowed, TypeError)
    if key_bias.device != device:
        _fail("key_bias", tensor_desc(key_bias), allowed)
    shape = tuple(key_bias.shape)
    if len(shape) == 1 and shape == (T,):
        kb = key_bias.reshape(1, T)
    elif len(shape) == 2 and shape[1] == T and shape[0] in (1, B):
        kb = key_bias
    elif len(shape) == 4 and shape[3] == T and shape[0] in (1, B) and shape[1] == 1 and shape[2] == 1:
        kb = key_bias.reshape(shape[0], T)
    else:
        _fail("key_bias", tensor_desc(key_bias), allowed)
    if kb.dtype == torch.bool:
        zero = torch.zeros((), dtype=torch.float32, device=device)
        return torch.where(kb, zero, torch.full_like(zero, -math.inf))
    if kb.dtype != torch.float16:    # SPEC.md: finite entries beyond +-1e30 act as +-1e30 (before fp32's range)
        kb = torch.where(torch.isneginf(kb), kb, kb.clamp(-KEY_BIAS_LIMIT, KEY_BIAS_LIMIT))
    return kb.to(torch.float32)


def validate(q, k, v, tau=1.0, scale=None, sink_blocks=None, sink_q=None, key_bias=None,
             topk_ratio=0.0, tail=True, block_len=None, coarse_gate=None, token_aug=0) -> Problem:
    """Check every argument of ``sol_attn`` and return the frozen :class:`Problem`.

    Raises ``TypeError`` for a wrong type and ``ValueError`` for a wrong value;
    the message names the argument, what was received and what is allowed.
    """
    check_qkv("sol_attn", q, k, v)
    B, T, H, D = q.shape
    if min(B, T, H, D) < 1:
        _fail("q", tensor_desc(q), "B, T, H, D >= 1 (an empty sequence T = 0 is not allowed)")
    _warn_if_sdpa_layout((B, T, H, D))
    n = num_blocks(T)

    tau = _check_real("tau", tau)
    scale = _check_real("scale", scale, allow_none=True)
    if scale is None:
        scale = D ** -0.5

    if isinstance(topk_ratio, bool) or not isinstance(topk_ratio, numbers.Real):
        _fail("topk_ratio", repr(topk_ratio), "0 (tau mode) or a float 0 < r < 1 (top-k mode)", TypeError)
    topk_ratio = float(topk_ratio)
    if not (topk_ratio == 0.0 or 0.0 < topk_ratio < 1.0):
        _fail("topk_ratio", repr(topk_ratio), "0 (tau mode) or a float 0 < r < 1 (top-k mode)")

    if not isinstance(tail, (bool, int)) or isinstance(tail, numbers.Integral) and tail not in (0, 1):
        _fail("tail", repr(tail), "True or False", TypeError)

    sinks = _check_range("sink_blocks", sink_blocks, n)
    sinkq = _check_range("sink_q", sink_q, n)
    kb = _normalise_key_bias(key_bias, B, T, q.device)

    if block_len is not None:
        allowed = f"None or an int32 tensor of shape ({n},) (ceil(T/64) with T={T}) on {q.device}"
        if not isinstance(block_len, torch.Tensor):
            _fail("block_len", type(block_len).__name__, allowed, TypeError)
        if block_len.dtype != torch.int32:
            _fail("block_len", tensor_desc(block_len), allowed, TypeError)
        if tuple(block_len.shape) != (n,) or block_len.device != q.device:
            _fail("block_len", tensor_desc(block_len), allowed)

    check_gate("sol_attn", "coarse_gate", coarse_gate, q)

    if isinstance(token_aug, bool) or not isinstance(token_aug, numbers.Integral):
        _fail("token_aug", repr(token_aug), f"one of {TOKEN_AUG_VALUES}", TypeError)
    if int(token_aug) not in TOKEN_AUG_VALUES:
        _fail("token_aug", repr(token_aug), f"one of {TOKEN_AUG_VALUES}")

    return Problem(q=q, k=k, v=v, scale=scale, tau=tau, topk_ratio=topk_ratio, tail=bool(tail),
                   sink_blocks=sinks, sink_q=sinkq, key_bias=kb, block_len=block_len,
                   coarse_gate=coarse_gate, token_aug=int(token_aug))
