"""Launch settings of the ``triton`` backend's kernels: :class:`KernelConfig` (the forward),
:class:`BackwardConfig` (the two backward kernels) and :class:`TritonTuning`, the scoped setting
(:mod:`solattn.config`) that holds both and the forward's choice between pointer and TMA loads.
Plain Python: importing this module does not import Triton."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional

from ...config import Tuning

#: allowed values per KernelConfig field: what the shipped kernel was built and measured with on
#: the H200; other values are untested or measured slower
KERNEL_CONFIG_CHOICES = {
    "num_warps": (4, 8),
    "num_stages": (2, 3, 4),
    "tma": (False, True),
}
_CHOICE_WHY = {
    "num_warps": "warps per 64-row query block",
    "num_stages": "software-pipeline depth of the key loop",
    "tma": "load K/V through (B, T, H, D) TMA descriptors where the inputs allow it",
}


def _check_choice(kind: str, name: str, value, allowed, why: str = "") -> None:
    """``value`` is one of ``allowed`` (ints, or bools that also take 0 and 1)."""
    flag = isinstance(allowed[0], bool)
    if not isinstance(value, int) or (isinstance(value, bool) and not flag):
        raise TypeError(f"{kind}: argument '{name}' received {value!r} of type {type(value).__name__}; "
                        f"allowed: {'a bool' if flag else 'an int'}, one of {allowed}")
    if value not in allowed:
        raise ValueError(f"{kind}: argument '{name}' received {value!r}; allowed: "
                         f"{', '.join(map(str, allowed))}{f' ({why})' if why else ''}")


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of the forward kernel; every field is checked on construction.

    - ``num_warps``: warps per program (4 or 8; 4 is the fast one for 64-row tiles).
    - ``num_stages``: pipeline depth of the key loop (2, 3 or 4).
    - ``tma``: load key/value blocks through ``(B, T, H, D)`` TMA tensor descriptors where the
      inputs allow it (sm_90+, last dim contiguous, 16-byte aligned strides, no block_len);
      elsewhere, and with ``False``, pointer loads.

    The kernel consumes one 64-key block per loop step (two lost on an H200: to register pressure
    with pointer loads, to one program per SM instead of two with TMA loads).
    """

    num_warps: int = 4
    num_stages: int = 3
    tma: bool = False

    def __post_init__(self):
        for name, allowed in KERNEL_CONFIG_CHOICES.items():
            _check_choice("KernelConfig", name, getattr(self, name), allowed, _CHOICE_WHY[name])
        object.__setattr__(self, "tma", bool(self.tma))


#: chosen from the H200 sweeps: 4 warps, 3 stages, K/V through (B, T, H, D) TMA descriptors
#: (1.46x faster than pointer loads at H3)
DEFAULT_CONFIGS = {d: KernelConfig(4, 3, tma=True) for d in (16, 32, 64, 128)}

@dataclass(frozen=True)
class BackwardConfig:
    """Launch parameters of the two backward kernels (warps, pipeline stages). The defaults were
    measured on an H200 at H3 (top-k 10 %, kernels only): 4 warps and 2 stages in both kernels
    took 44.6 ms, 8 warps 70.2 ms (every warp/stage pairing was timed; 4/2 won). The dq kernel
    takes delta_t = dO_t . O_t from the forward's output plus its saved rounding residual (O to
    about 2^-16); summing it inside the dq loop instead cost one more 64 x 64 x D product per key
    block pair (H200 at H3 top-k 10 %: 44.2 ms of kernels against 34.2 ms). With TMA loads (the
    default, ``tma``) the two kernels took 12.7 + 14.1 ms at H3 top-k 10 % against 14.4 + 16.5 ms
    with pointer loads, and 12.7 + 13.7 against 14.0 + 16.9 ms for VSA at 16x48x48 with 58 of
    576 tiles; 3 stages were slower with TMA too. Two listed blocks per inner step (64 x 128
    products) spilled registers: 1.4x slower in dq, 2x (8 warps) to 6x (4 warps) in dkdv."""

    dq_warps: int = 4
    dq_stages: int = 2
    dkdv_warps: int = 4
    dkdv_stages: int = 2
    #: the inner loops' block loads (k, v in the dq kernel; q, dO in the dkdv kernel) through
    #: ``(B, T, H, D)`` TMA descriptors where the forward would take them (sm_90+, dead rows known
    #: to hold zeros, aligned strides, enough programs); else pointer loads
    tma: bool = True

    def __post_init__(self):
        for name in ("dq_warps", "dkdv_warps"):
            _check_choice("BackwardConfig", name, getattr(self, name), (2, 4, 8))
        for name in ("dq_stages", "dkdv_stages"):
            _check_choice("BackwardConfig", name, getattr(self, name), (1, 2, 3, 4, 5))
        _check_choice("BackwardConfig", "tma", self.tma, (False, True))
        object.__setattr__(self, "tma", bool(self.tma))


@dataclass(frozen=True)
class TritonTuning(Tuning):
    """The ``triton`` backend's launch settings in force (:func:`solattn.config.tuning`).

    - ``forward``: the forward kernel's :class:`KernelConfig`; None: :data:`DEFAULT_CONFIGS` for
      the head dim, with pointer loads below ``tma_min_programs`` programs.
    - ``tma_min_programs``: below this many programs (B * H * n) the default config uses pointer
      loads: a host-side TMA descriptor costs a fixed ~0.1 ms per launch, more than small problems
      take (H200 T sweep; at 2048 programs, B=2 T=4056 H=16, pointer loads were faster end to end:
      0.467 against 0.477 ms at top-k 10 %, 0.523 against 0.752 ms at tau 1 with tail).
    - ``tma_in_graphs``: a call captured into a CUDA graph (:mod:`solattn.graphs`) uses TMA loads
      at every size: their descriptors' host cost is paid once, at capture, and none per replay.
    - ``backward``: the backward kernels' :class:`BackwardConfig`.
    """

    forward: Optional[KernelConfig] = None
    tma_min_programs: int = 4096
    tma_in_graphs: bool = True
    backward: BackwardConfig = field(default_factory=BackwardConfig)

    def __post_init__(self):
        if self.forward is not None and not isinstance(self.forward, KernelConfig):
            raise TypeError(f"TritonTuning: argument 'forward' received {type(self.forward).__name__}; "
                            "allowed: None or a KernelConfig")
        if isinstance(self.tma_min_programs, bool) or not isinstance(self.tma_min_programs, int) \
                or self.tma_min_programs < 0:
            raise ValueError(f"TritonTuning: argument 'tma_min_programs' received {self.tma_min_programs!r}; "
                             "allowed: an int >= 0")
        if not isinstance(self.tma_in_graphs, bool):
            raise TypeError(f"TritonTuning: argument 'tma_in_graphs' received {self.tma_in_graphs!r}; "
                            "allowed: True or False")
        if not isinstance(self.backward, BackwardConfig):
            raise TypeError(f"TritonTuning: argument 'backward' received {type(self.backward).__name__}; "
                            "allowed: a BackwardConfig")

    def forward_config(self, programs: int, recording: bool, head_dim: int) -> KernelConfig:
        """The forward's config for a launch of ``programs`` programs (``recording``: inside a CUDA
        graph's warm-up or capture)."""
        if self.forward is not None:
            return self.forward
        cfg = DEFAULT_CONFIGS.get(head_dim) or _PLAIN
        if not self.tma_pays(programs, recording):
            cfg = _pointer_loads(cfg)
        return cfg

    def tma_pays(self, programs: int, recording: bool) -> bool:
        """Whether a launch of ``programs`` programs takes TMA loads by default: enough programs
        to pay for the descriptors, or their cost paid once at a CUDA graph's capture."""
        return programs >= self.tma_min_programs or (self.tma_in_graphs and recording)


_PLAIN = KernelConfig()


@functools.lru_cache(maxsize=16)
def _pointer_loads(cfg: KernelConfig) -> KernelConfig:
    """``cfg`` with pointer loads (made once per config: a config checks its fields when made)."""
    return KernelConfig(cfg.num_warps, cfg.num_stages, tma=False)
