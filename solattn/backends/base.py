"""What every backend declares, and the one capability check built on it."""

from __future__ import annotations

from typing import ClassVar, FrozenSet, List, Optional, Tuple, Union

import torch

from ..validation import Problem

ALL_FEATURES = frozenset({"tau", "topk", "tail", "key_bias", "block_len", "coarse_gate",
                          "sink_blocks", "sink_q", "autograd"})

DeviceLike = Union[str, torch.device]


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
    #: on CUDA devices, the oldest compute capability the backend runs on, e.g. ``(8, 0)``
    min_compute_capability: ClassVar[Optional[Tuple[int, int]]] = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for final, hook in (("availability_reasons", "device_reasons"),
                            ("not_supported_reasons", "problem_reasons")):
            if final in vars(cls):
                raise TypeError(f"backend class {cls.__name__} overrides Backend.{final}; the generic "
                                f"capability checks live there once: override {hook} to add reasons")

    # ------------------------------------------------------------------ hooks for subclasses

    def device_reasons(self, device: torch.device) -> List[str]:
        """Backend-specific reasons it cannot run on ``device`` at all (packages, opt-ins).
        Called only when the generic device checks pass."""
        return []

    def problem_reasons(self, problem: Problem) -> List[str]:
        """Backend-specific reasons it cannot run ``problem`` (memory budgets, ...)."""
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

    def forward(self, problem: Problem, plan=None) -> torch.Tensor:
        """Compute the ``(B, T, H, D)`` output (v's dtype, contiguous)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<solattn backend {self.name!r}>"


def _compute_capability_reasons(dev: torch.device, need: Tuple[int, int]) -> List[str]:
    """Reasons a CUDA device (the current one when ``dev`` has no index) is missing or too old."""
    if not torch.cuda.is_available():
        return ["no CUDA device available (torch.cuda.is_available() is False)"]
    have = tuple(torch.cuda.get_device_capability(dev if dev.index is not None else None))
    if have < tuple(need):
        return [f"needs a GPU of compute capability {need[0]}.{need[1]} or newer (sm_{need[0]}{need[1]}+); "
                f"{dev} is {have[0]}.{have[1]}"]
    return []
