"""What every backend declares, and the one capability check built on it."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import ClassVar, Dict, FrozenSet, List, NamedTuple, Optional, Tuple, Union

import torch

from ..triton_runtime import cuda_capability
from ..validation import BLOCK, Problem

#: ``"autograd"``: the backend's forward records torch autograd, so a backward pass can
#: differentiate a recomputation through it (see :attr:`Backend.differentiation`)
ALL_FEATURES = frozenset({"tau", "topk", "tail", "key_bias", "block_len", "coarse_gate",
                          "sink_blocks", "sink_q", "autograd"})

#: the ways a backend differentiates, see :attr:`Backend.differentiation`
DIFFERENTIATION = ("recompute", "own")

DeviceLike = Union[str, torch.device]


class Declined(RuntimeError):
    """Raised by a backend's ``forward`` for a call it accepted and then could not run (the flex
    backend when its compiler fails on a shape). The op layer runs the call on the backend the
    dispatcher chooses next, with a warning that gives this message; the backend makes sure it is
    not chosen again for that call (so no loop)."""


class BackwardBuffers(NamedTuple):
    """What the forward of a backend with its own backward keeps for that backward. The op layer
    allocates both when a backward may follow; the backend's :meth:`Backend.forward_for_backward`
    writes them and its :meth:`Backend.backward` reads them (their meaning is the backend's)."""

    #: fp32 ``(B, H, n * 64)``: one value per row of every query block (e.g. a log-sum-exp)
    lse: torch.Tensor
    #: ``(B, T, H, D)`` of v's dtype, contiguous (e.g. the output's rounding residual)
    resid: torch.Tensor


@dataclass
class Gradients:
    """What :meth:`Backend.backward` returns. Token-level gradients in the inputs' dtypes and
    layout, taken with the plan's terms held constant; the plan's differentiable block terms get
    their gradients in :attr:`plan`, and the op layer carries those on to q, k and v."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    #: the coarse gate's gradient when the problem has one
    dgate: Optional[torch.Tensor] = None
    #: fp32 ``(B, T)``, summed over heads, when a float key bias's gradient was asked for
    dbias: Optional[torch.Tensor] = None
    #: gradients of plan terms by field name (``tail_lse``, ``tail_value``, ``coarse``, ``key_mean``)
    plan: Dict[str, torch.Tensor] = field(default_factory=dict)


class Backend:
    """A way to run ``sol_attn``; subclass it to add one (``solattn.register_backend``).

    Subclasses declare their capabilities as class attributes. The checks built on them live
    here, once: :meth:`availability_reasons` (device type, compute capability on CUDA) and
    :meth:`not_supported_reasons` (those, then dtype, head dim, features). A backend adds
    its own reasons by overriding the hooks :meth:`device_reasons` (missing packages, opt-ins)
    and :meth:`problem_reasons` (memory budgets); it cannot replace or reword the generic
    checks. An empty list means the backend can run.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    #: device types (``torch.device.type``) the backend runs on; ``None`` means any
    devices: ClassVar[Optional[FrozenSet[str]]] = frozenset()
    dtypes: ClassVar[FrozenSet[torch.dtype]] = frozenset({torch.bfloat16, torch.float16, torch.float32})
    #: supported head dims; ``None`` means any
    head_dims: ClassVar[Optional[FrozenSet[int]]] = None
    features: ClassVar[FrozenSet[str]] = ALL_FEATURES
    #: consumes a routing plan (``solattn.routing.Plan``); the reference does not
    uses_plan: ClassVar[bool] = True
    #: takes a plan whose ``kv_indices`` may be wider than the largest count (0-padded), so the
    #: GPU routing plan can be built without a host synchronisation (``build_plan(fused=True)``)
    fused_plan: ClassVar[bool] = False
    #: runs a problem with a row table (``Problem.rows``: VSA's tiled layout read straight from the
    #: caller's token order, the output written back in that order), so the op layer makes no
    #: tiled copies for it in the forward; other backends get the tiled copies, and every own
    #: backward gets them too (a problem with a row table never reaches ``backward``)
    row_table: ClassVar[bool] = False
    #: on CUDA devices, the oldest compute capability the backend runs on, e.g. ``(8, 0)``
    min_compute_capability: ClassVar[Optional[Tuple[int, int]]] = None
    #: how a backward pass differentiates the backend's output:
    #:
    #: - ``"recompute"``: the forward runs again with autograd recording, through this backend
    #:   when it declares the ``"autograd"`` feature, else through the device's first one that does;
    #: - ``"own"``: the backend's own backward: :meth:`forward_for_backward` fills
    #:   :class:`BackwardBuffers` while computing the output, :meth:`backward` returns the
    #:   :class:`Gradients`. The selection is treated as constant either way.
    differentiation: ClassVar[str] = "recompute"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for final, hook in (("availability_reasons", "device_reasons"),
                            ("not_supported_reasons", "problem_reasons")):
            if final in vars(cls):
                raise TypeError(f"backend class {cls.__name__} overrides Backend.{final}; the generic "
                                f"capability checks live there once: override {hook} to add reasons")
        if cls.differentiation not in DIFFERENTIATION:
            raise TypeError(f"backend class {cls.__name__}: attribute 'differentiation' received "
                            f"{cls.differentiation!r}; allowed: one of {DIFFERENTIATION}")
        missing = [m for m in ("forward_for_backward", "backward") if getattr(cls, m) is getattr(Backend, m)]
        if cls.differentiation == "own" and missing:
            raise TypeError(f"backend class {cls.__name__} declares differentiation='own' and does not "
                            f"define {' and '.join(missing)}")

    # ------------------------------------------------------------------ hooks for subclasses

    def device_reasons(self, device: torch.device) -> List[str]:
        """Backend-specific reasons it cannot run on ``device`` at all (packages, opt-ins).
        Called only when the generic device checks pass."""
        return []

    def problem_reasons(self, problem: Problem) -> List[str]:
        """Backend-specific reasons it cannot run ``problem`` (memory budgets, ...)."""
        return []

    def automatic(self, device_type: str) -> bool:
        """Whether the automatic choice may take this backend on ``device_type`` where the device
        type's built-in order lists it (False: it runs there only when asked for by name)."""
        return True

    def automatic_reasons(self, problem: Problem) -> List[str]:
        """Reasons the automatic choice passes this backend over for ``problem`` although it could
        run it when asked for by name (a compile that would not pay for itself, ...)."""
        return []

    def automatic_notes(self, device: DeviceLike) -> List[str]:
        """What :meth:`automatic_reasons` holds on ``device`` for many calls, shown by ``list_backends``."""
        return []

    # ------------------------------------------------------------------ the generic checks

    def availability_reasons(self, device: DeviceLike) -> List[str]:
        """Reasons the backend cannot run at all on ``device`` (a ``torch.device`` or a device
        string such as ``"cuda"`` or ``"cuda:1"``); empty when it can."""
        dev = torch.device(device)
        if self.devices is not None and dev.type not in self.devices:
            return [f"device type '{dev.type}' not supported (supports {sorted(self.devices)})"]
        if dev.type == "cuda" and self.min_compute_capability is not None:
            reasons = _compute_capability_reasons(dev, self.min_compute_capability)
            if reasons:
                return reasons
        return list(self.device_reasons(dev))

    def not_supported_reasons(self, problem: Problem) -> List[str]:
        """Every reason the backend cannot run ``problem``; empty when it can."""
        reasons = self.availability_reasons(problem.device)
        if problem.dtype not in self.dtypes:
            names = sorted(str(d).replace("torch.", "") for d in self.dtypes)
            reasons.append(f"dtype {str(problem.dtype).replace('torch.', '')} not supported (supports {names})")
        if self.head_dims is not None and problem.D not in self.head_dims:
            reasons.append(f"head dim {problem.D} not supported (supports {sorted(self.head_dims)})")
        missing = sorted(problem.features - self.features)
        if missing:
            reasons.append(f"feature(s) not supported: {', '.join(missing)}")
        return reasons + list(self.problem_reasons(problem))

    def plan_extras(self, problem: Problem) -> FrozenSet[str]:
        """With ``fused_plan``: what this backend's forward of ``problem`` reads that the fused plan's
        kernels can make on the way (``solattn.routing.fused.PLAN_EXTRAS``), taken from the plan
        with ``Plan.take``; a plan without them still runs (the backend then makes them)."""
        return frozenset()

    def tiled_copies(self, xs: List[torch.Tensor], rows: torch.Tensor, block_len: torch.Tensor,
                     T: int) -> Optional[List[torch.Tensor]]:
        """With ``row_table``: contiguous copies of the ``(B, T_in, H, D)`` tensors ``xs`` in the tiled
        layout of the row table ``rows`` (int64 ``(T,)``; dead rows, by ``block_len``, hold zeros),
        as ``solattn.tiling.to_tiled`` makes them, if the backend makes them at once (its own
        backward's inputs); None: the op layer gathers them one by one."""
        return None

    def forward(self, problem: Problem, plan=None) -> torch.Tensor:
        """Compute the ``(B, T, H, D)`` output (v's dtype, contiguous)."""
        raise NotImplementedError

    def forward_for_backward(self, problem: Problem, plan, buffers: BackwardBuffers) -> torch.Tensor:
        """With ``differentiation = "own"``: :meth:`forward`'s output, and fill ``buffers`` with
        what :meth:`backward` needs. Runs under ``torch.no_grad``."""
        raise NotImplementedError

    def backward(self, problem: Problem, plan, out: torch.Tensor, buffers: BackwardBuffers,
                 grad_out: torch.Tensor, bias_grad: bool, rows: Optional[torch.Tensor] = None) -> Gradients:
        """With ``differentiation = "own"``: the :class:`Gradients` of the forward that returned
        ``out`` and filled ``buffers``, given the output's gradient ``grad_out`` (any strides).
        ``plan`` selects what the forward's did; its tail / coarse / key-mean terms may record
        autograd, which the backend leaves alone (it returns their gradients in ``plan``).
        ``bias_grad``: return a float key bias's gradient. ``rows`` (backends with ``row_table``
        only): the problem's rows are a tiled layout of the caller's tokens, row ``r`` token
        ``rows[r]`` where it is live (``Problem.block_len``); then ``out`` is in the caller's token
        order, and so are the token-level gradients returned (dead rows have none)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<solattn backend {self.name!r}>"


def _compute_capability_reasons(dev: torch.device, need: Tuple[int, int]) -> List[str]:
    """Reasons a CUDA device (the current one when ``dev`` has no index) is missing or too old."""
    if not torch.cuda.is_available():
        return ["no CUDA device available (torch.cuda.is_available() is False)"]
    have = cuda_capability(dev)
    if have < tuple(need):
        return [f"needs a GPU of compute capability {need[0]}.{need[1]} or newer (sm_{need[0]}{need[1]}+); "
                f"{dev} is {have[0]}.{have[1]}"]
    return []


def add_coarse(out: torch.Tensor, gate: torch.Tensor, coarse: torch.Tensor, rows: int,
               grad: bool = False, threads=None) -> torch.Tensor:
    """SPEC.md's ``cast(fine) + cast(gate * coarse_of_block)``: ``out`` ``(B, T, H, D)`` (the
    cast fine branch), ``gate`` of its shape, ``coarse`` ``(B, H, n, D)`` fp32, one row per
    64-row block. Every row's block term is broadcast from ``coarse`` (never gathered into a
    token-sized copy) over chunks of about ``rows`` rows (whole blocks), so the fp32 working
    memory is one chunk. In place in inference; with autograd recording (``grad``) out of place,
    the chunks concatenated (an in-place add into a slice would record CopySlices).
    ``threads(chunk_bytes)``: a context to run each chunk in (the CPU thread policy), or None."""
    B, T, H, D = out.shape
    step = max(BLOCK, rows // BLOCK * BLOCK)
    cb = coarse.permute(0, 2, 1, 3).unsqueeze(2)             # (B, n, 1, H, D), a view
    parts = []
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        b0, nb = t0 // BLOCK, -(-(t1 - t0) // BLOCK)
        pad = nb * BLOCK - (t1 - t0)                           # rows of a ragged last block
        g = gate[:, t0:t1]
        if pad:
            g = torch.nn.functional.pad(g, (0, 0, 0, 0, 0, pad))
        with (threads(B * (t1 - t0) * H * D * 4) if threads is not None else contextlib.nullcontext()):
            add = (g.reshape(B, nb, BLOCK, H, D).to(torch.float32) * cb[:, b0:b0 + nb])
            add = add.to(out.dtype).reshape(B, nb * BLOCK, H, D)[:, :t1 - t0]
            if grad:
                parts.append(out[:, t0:t1] + add)
            else:
                out[:, t0:t1] += add
    return torch.cat(parts, dim=1) if grad else out
