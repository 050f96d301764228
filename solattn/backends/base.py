"""What every backend declares, and the generic capability check built on it."""

from __future__ import annotations

from typing import ClassVar, FrozenSet, List, Optional

import torch

from ..validation import Problem

ALL_FEATURES = frozenset({"tau", "topk", "tail", "key_bias", "block_len", "coarse_gate",
                          "sink_blocks", "sink_q", "autograd"})


class Backend:
    """A way to run ``sol_attn``.

    Subclasses set the capability attributes; :meth:`not_supported_reasons`
    turns them into human-readable reasons, and subclasses add their own
    (memory budgets, missing packages) by extending it. An empty list means
    the backend can run the problem.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    #: device types (``torch.device.type``) the backend is registered for
    devices: ClassVar[FrozenSet[str]] = frozenset()
    dtypes: ClassVar[FrozenSet[torch.dtype]] = frozenset({torch.bfloat16, torch.float16, torch.float32})
    #: supported head dims; ``None`` means any
    head_dims: ClassVar[Optional[FrozenSet[int]]] = None
    features: ClassVar[FrozenSet[str]] = ALL_FEATURES
    #: consumes a routing plan (``solattn.routing.Plan``); the reference does not
    uses_plan: ClassVar[bool] = True

    def availability_reasons(self, device_type: str) -> List[str]:
        """Reasons the backend cannot run at all on this device type (imports, hardware)."""
        if device_type not in self.devices:
            return [f"device type '{device_type}' not supported (supports {sorted(self.devices)})"]
        return []

    def not_supported_reasons(self, problem: Problem) -> List[str]:
        reasons = list(self.availability_reasons(problem.device.type))
        if problem.dtype not in self.dtypes:
            names = sorted(str(d).replace("torch.", "") for d in self.dtypes)
            reasons.append(f"dtype {str(problem.dtype).replace('torch.', '')} not supported (supports {names})")
        if self.head_dims is not None and problem.D not in self.head_dims:
            reasons.append(f"head dim {problem.D} not supported (supports {sorted(self.head_dims)})")
        missing = sorted(problem.features - self.features)
        if missing:
            reasons.append(f"feature(s) not supported: {', '.join(missing)}")
        return reasons

    def forward(self, problem: Problem, plan=None) -> torch.Tensor:
        """Compute the ``(B, T, H, D)`` output (v's dtype, contiguous)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<solattn backend {self.name!r}>"
