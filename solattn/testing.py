"""Helpers for testing a solattn backend against the reference: inputs, error metric, tolerances,
devices, and the backend x device x feature matrix generated from the registry.

solattn's own test suite, ``python -m solattn check`` and the benchmarks use these; a peer
backend registered with ``solattn.register_backend`` can use them to test itself the same way::

    from solattn import testing
    for case in testing.backend_cases():
        q, k, v = testing.make_qkv(1, 300, 2, 64, torch.bfloat16, case.device)
        got = case.run(q, k, v, topk_ratio=0.3)
        want = solattn.sol_attn(q, k, v, topk_ratio=0.3, backend="reference")
        assert testing.rel_l2(got, want) < testing.tolerance(torch.bfloat16)

The error metric is the relative L2 norm; the tolerances are the ones the spec states
(fp32 about 1e-5, bf16 and fp16 about 1e-2).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from . import devices, dispatch
from .validation import BLOCK

__all__ = ["TOLERANCE", "tolerance", "rel_l2", "assert_close", "device_types", "block_structured_qkv",
           "make_qkv", "dense_attention", "dense_gradient_error", "live_rows", "assert_selection_clear",
           "triton_interpretable", "interpreter",
           "BackendCase", "backend_cases", "ORACLE"]

#: the backend every other backend is compared with (SPEC's definition in plain torch ops)
ORACLE = "reference"

#: largest relative L2 error against the reference for an output in each dtype
TOLERANCE: Dict[torch.dtype, float] = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def tolerance(dtype: torch.dtype) -> float:
    """The relative L2 tolerance for outputs in ``dtype`` (see :data:`TOLERANCE`)."""
    if dtype not in TOLERANCE:
        raise ValueError(f"argument 'dtype' received {dtype}; allowed: one of {sorted(map(str, TOLERANCE))}")
    return TOLERANCE[dtype]


def rel_l2(out: torch.Tensor, basis: torch.Tensor) -> float:
    """``||out - basis|| / ||basis||`` in float64 on the CPU (``||out - basis||`` when the basis
    is zero). NaN or inf in ``out`` give a NaN or inf error, which no tolerance accepts."""
    a, b = out.detach().double().cpu(), basis.detach().double().cpu()
    den = b.norm().item()
    return (a - b).norm().item() / (den if den > 0 else 1.0)


def assert_close(out: torch.Tensor, want: torch.Tensor, tol: Optional[float] = None, what: str = "") -> float:
    """Assert ``out`` is finite and within ``tol`` (default: :func:`tolerance` of ``out``'s dtype)
    of ``want`` in relative L2; returns the error."""
    tol = tolerance(out.dtype) if tol is None else tol
    assert torch.isfinite(out).all(), f"non-finite values in the output {what}".rstrip()
    err = rel_l2(out, want)
    assert err < tol, f"relative L2 error {err:.3e} >= {tol:g} {what}".rstrip()
    return err


def device_types() -> List[str]:
    """Device types present here (``cpu`` first), from :func:`solattn.devices.present_devices`."""
    return list(dict.fromkeys(d.split(":")[0] for d in devices.present_devices()))


# ----------------------------------------------------------------------------- inputs

def block_structured_qkv(B: int, T: int, H: int, D: int, dtype: torch.dtype = torch.float32,
                         device="cpu", seed: int = 0, spread: float = 2.0, key_offset: float = 0.0,
                         normalise: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v ``(B, T, H, D)``: ``0.5 * randn`` per token plus ``spread * randn`` per 64-token
    block; k also gets ``key_offset * randn`` per head (a common key offset, which dense attention
    and the spec's key centring both ignore). ``normalise`` multiplies by ``D ** -0.25`` so logits
    keep their size across head dims. Drawn on the CPU from a seeded generator, then moved.

    Random tokens alone give routing scores that all sit near each other, so a selection would
    hinge on rounding; the per-block offsets spread the block means, as real attention inputs
    do, and make the selection unambiguous at every dtype."""
    n = math.ceil(T / BLOCK)
    g = torch.Generator().manual_seed(seed)
    out = []
    for which in range(3):
        x = torch.randn(B, T, H, D, generator=g).mul_(0.5)
        x.add_(torch.randn(B, n, H, D, generator=g).mul_(spread).repeat_interleave(BLOCK, dim=1)[:, :T])
        if which == 1 and key_offset:
            x.add_(torch.randn(1, 1, H, D, generator=g).mul_(key_offset))
        if normalise:
            x.mul_(D ** -0.25)
        out.append(x.to(dtype=dtype, device=device))
    return tuple(out)


def make_qkv(B: int, T: int, H: int, D: int, dtype: torch.dtype = torch.float32, device="cpu",
             seed: int = 0, spread: float = 3.0, key_offset: float = 4.0):
    """The inputs tests compare backends on: :func:`block_structured_qkv` with well separated
    blocks (selection unambiguous at every dtype), logits of a size independent of ``D``, and a
    common key offset per head, as real models' keys have (a backend that rounds the key
    centroid shows up as a larger error)."""
    return block_structured_qkv(B, T, H, D, dtype, device, seed=seed, spread=spread,
                                key_offset=key_offset, normalise=True)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
    """Plain dense attention for ``(B, T, H, D)`` inputs, in fp32; what every backend must equal
    when every block is exact."""
    o = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2), scale=scale)
    return o.transpose(1, 2)


def dense_gradient_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor) -> float:
    """Largest relative L2 error of dense SDPA's q, k, v gradients in q's dtype against fp32, on
    q's device, for the loss ``sum(out * w)`` (on CUDA a flash backward, which rounds as a fused
    backward does): the level a low-precision backward of the sparse operator is held to."""
    grads = []
    for dt in (q.dtype, torch.float32):
        leaves = [x.detach().to(dt).transpose(1, 2).requires_grad_(True) for x in (q, k, v)]
        out = torch.nn.functional.scaled_dot_product_attention(*leaves).transpose(1, 2)
        (out.float() * w).sum().backward()
        grads.append([x.grad for x in leaves])
    return max(rel_l2(a, b) for a, b in zip(*grads))


def assert_selection_clear(problem, margin: float) -> None:
    """Fail unless no routing score of ``problem`` (a validated Problem) lies within ``margin`` of
    its threshold, so that rounding cannot flip a block: for tests that compare two paths'
    selections exactly."""
    from .routing import block_stats, sink_mask, topk_count
    stats = block_stats(problem)
    c = problem.scale * math.log2(math.e)
    kmc = stats.km - stats.m
    R = c * (stats.qm @ kmc.transpose(-1, -2))
    if problem.topk_ratio == 0.0:
        var = kmc.pow(2).mean(dim=2)
        thr = problem.tau * torch.sqrt(c * c * (stats.qm.pow(2) * var[:, :, None, :]).sum(-1) + 1e-6)
        gap = (R - thr[..., None]).abs().min().item()
    else:
        sinks = sink_mask(problem.sink_blocks, problem.n, R.device)
        kk = topk_count(problem.topk_ratio, problem.n - int(sinks.sum()))
        s = R[..., ~sinks].sort(dim=-1, descending=True).values
        gap = (s[..., kk - 1] - s[..., kk]).min().item() if 0 < kk < s.shape[-1] else 1.0
    assert gap > margin, f"test input has an ambiguous selection (gap {gap:.2e}); pick another seed"


def live_rows(T: int, block_len: torch.Tensor) -> torch.Tensor:
    """Bool ``(T,)``: the tokens ``block_len`` keeps (the first ``block_len[j]`` of block ``j``)."""
    lens = block_len.cpu().clamp(1, BLOCK)
    pos = torch.arange(T)
    return pos - (pos // BLOCK) * BLOCK < lens[pos // BLOCK]


# ----------------------------------------------------------------------------- the matrix

def triton_interpretable() -> bool:
    """Triton's CPU interpreter can run solattn's kernel here (Triton >= 3.9 installed; older
    interpreters fail on the kernel's reductions)."""
    if importlib.util.find_spec("triton") is None:
        return False
    import triton
    return tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 9)


@contextlib.contextmanager
def interpreter(on: bool = True) -> Iterator[None]:
    """Set ``TRITON_INTERPRET=1`` inside the block (when ``on``), restoring the old value after."""
    if not on:
        yield
        return
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


@dataclass(frozen=True)
class BackendCase:
    """One registered backend on one device type; ``interpreted``: a Triton kernel run by
    Triton's CPU interpreter (slow: keep those problems small)."""
    backend: str
    device: str
    interpreted: bool = False

    @property
    def id(self) -> str:
        return f"{self.backend}-{self.device}" + ("-interpreted" if self.interpreted else "")

    @property
    def declared(self):
        """The backend's registered class (its ``dtypes``, ``features``, ``head_dims``, ...)."""
        return dispatch.get_backend(self.backend)

    def run(self, *args, **kwargs) -> torch.Tensor:
        """``solattn.sol_attn(*args, backend=self.backend, **kwargs)``, under the interpreter if needed."""
        from .op import sol_attn
        with interpreter(self.interpreted):
            return sol_attn(*args, backend=self.backend, **kwargs)

    def head_dim(self, preferred: int = 32) -> int:
        """``preferred`` if the backend takes it, else its smallest supported head dim."""
        dims = self.declared.head_dims
        return preferred if dims is None or preferred in dims else min(dims)


def backend_cases(devices: Optional[Sequence[str]] = None, interpreted: bool = True,
                  include_oracle: bool = False) -> List[BackendCase]:
    """Every registered backend on every device type present (or ``devices``) that it can run
    on, from the registry; the oracle only with ``include_oracle``. With ``interpreted``, a
    backend that runs on the CPU only under ``TRITON_INTERPRET=1`` joins as an interpreted
    case when the installed Triton can interpret the kernel."""
    out = []
    for dev in devices if devices is not None else device_types():
        for name in dispatch.registered():
            if name == ORACLE and not include_oracle:
                continue
            backend = dispatch.get_backend(name)
            if not backend.availability_reasons(dev):
                out.append(BackendCase(name, dev))
            elif interpreted and dev == "cpu" and triton_interpretable():
                with interpreter():
                    if not backend.availability_reasons(dev):
                        out.append(BackendCase(name, dev, interpreted=True))
    return out
