"""The ``triton`` backend: launcher for the fused block-index kernel (``kernel.py``).

Importing this module never imports Triton; the kernel module is loaded on the
first forward call, and a missing Triton is reported as a reason instead.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass, replace
from typing import List, Optional

import torch

from ...validation import BLOCK, Problem
from ..base import ALL_FEATURES, Backend

#: environment variable that opts in to running the kernel on Intel XPUs
XPU_OPT_IN = "SOLATTN_TRITON_XPU"


#: allowed values per KernelConfig field: what the shipped kernel was built and measured with
#: on the H200 (benchmarks/notes_triton.md); other values are untested or measured slower
KERNEL_CONFIG_CHOICES = {
    "kv_per_iter": (1,),
    "num_warps": (4, 8),
    "num_stages": (2, 3, 4),
    "tma": (False, True),
}
_CHOICE_WHY = {
    "kv_per_iter": "the kernel consumes one 64-key block per loop step",
    "num_warps": "warps per 64-row query block",
    "num_stages": "software-pipeline depth of the key loop",
    "tma": "load K/V through (B, T, H, D) TMA descriptors where the inputs allow it",
}


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of the kernel; every field is checked on construction.

    - ``kv_per_iter``: 64-key blocks per loop step (only 1 ships; 2 lost to register pressure).
    - ``num_warps``: warps per program (4 or 8; 4 is the fast one for 64-row tiles).
    - ``num_stages``: pipeline depth of the key loop (2, 3 or 4).
    - ``tma``: load key/value blocks through ``(B, T, H, D)`` TMA tensor descriptors where the
      inputs allow it (sm_90+, last dim contiguous, 16-byte aligned strides, no block_len);
      elsewhere, and with ``False``, pointer loads.
    """

    kv_per_iter: int = 1
    num_warps: int = 4
    num_stages: int = 3
    tma: bool = False

    def __post_init__(self):
        for field, allowed in KERNEL_CONFIG_CHOICES.items():
            value = getattr(self, field)
            if not isinstance(value, int) or (isinstance(value, bool) and field != "tma"):
                wanted = "a bool" if field == "tma" else "an int"
                raise TypeError(f"KernelConfig: argument '{field}' received {value!r} of type "
                                f"{type(value).__name__}; allowed: {wanted}, one of {allowed}")
            if value not in allowed:
                raise ValueError(f"KernelConfig: argument '{field}' received {value!r}; allowed: "
                                 f"{', '.join(map(str, allowed))} ({_CHOICE_WHY[field]})")
        object.__setattr__(self, "tma", bool(self.tma))


#: chosen from the H200 sweeps (benchmarks/notes_triton.md): one key block per step, 4 warps,
#: 3 stages, K/V through (B, T, H, D) TMA descriptors (1.46x faster than pointer loads at H3)
DEFAULT_CONFIGS = {d: KernelConfig(1, 4, 3, tma=True) for d in (16, 32, 64, 128)}

#: below this many programs (B * H * n) the default config uses pointer loads: a host-side
#: TMA descriptor costs a fixed ~0.1 ms per launch, more than small problems take (H200 T sweep)
TMA_MIN_PROGRAMS = 2048


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _install_hint(device_type: str, platform: str) -> str:
    """What would get Triton onto this machine: the official wheels are Linux-only, and on
    Intel GPUs Triton comes with PyTorch's XPU builds."""
    if device_type == "xpu":
        return "triton not installed (PyTorch's XPU builds bring it as pytorch-triton-xpu)"
    if platform.startswith("linux"):
        return "triton not installed (pip install triton)"
    if platform == "win32":
        return ("triton not installed, and Triton publishes no Windows wheels (the community build "
                "'pip install triton-windows' may work, untested with solattn)")
    name = "macOS" if platform == "darwin" else platform
    return f"triton not installed, and Triton publishes no wheels for {name} (Linux only)"


def _plan_tensor(t: Optional[torch.Tensor], dtype: torch.dtype, fallback: torch.Tensor) -> torch.Tensor:
    """A plan field as a contiguous tensor of ``dtype`` (a dummy pointer when the field is unused)."""
    if t is None:
        return fallback
    return t.detach().to(dtype).contiguous()


def launch(problem: Problem, plan, config: Optional[KernelConfig] = None,
           out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Run the kernel on ``problem`` with the selection in ``plan``; returns ``(B, T, H, D)`` contiguous.

    ``config`` defaults to ``DEFAULT_CONFIGS`` for the head dim (pointer loads below
    ``TMA_MIN_PROGRAMS`` programs). ``out``, when given, must be a contiguous ``(B, T, H, D)``
    tensor of v's dtype on q's device; the kernel writes every element of it (tests poison it first).
    ``lse``, when given, a contiguous fp32 ``(B, H, n * 64)`` tensor, receives every row's base-2
    log-sum-exp (see :func:`solattn.backends.triton.backward.lse_shape`) for the fused backward.
    """
    if config is not None and not isinstance(config, KernelConfig):
        raise TypeError(f"triton backend: argument 'config' received {type(config).__name__}; "
                        f"allowed: None or a KernelConfig")
    cfg = config
    if cfg is None:
        cfg = DEFAULT_CONFIGS.get(problem.D, KernelConfig())
        if problem.B * problem.H * problem.n < TMA_MIN_PROGRAMS:
            cfg = replace(cfg, tma=False)
    from . import kernel  # imports triton
    return run_kernel(kernel.sol_attn_fwd, problem, plan, cfg, out, lse=lse)


def run_kernel(jit_kernel, problem: Problem, plan, cfg: KernelConfig,
               out: Optional[torch.Tensor] = None, constexprs: Optional[dict] = None,
               lse: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Launch ``jit_kernel``, a ``JITFunction`` with the production kernel's signature, on
    ``problem`` and ``plan``. :func:`launch` runs the production kernel through it; benchmark
    experiments (``benchmarks/kernel_variants.py``) run their variants through it too, with the
    variant's own extra ``constexprs`` (name -> value) appended to the launch."""
    from . import kernel  # imports triton

    q, k, v = problem.q, problem.k, problem.v
    B, T, H, D, n = problem.B, problem.T, problem.H, problem.D, problem.n
    if out is None:
        out = torch.empty((B, T, H, D), dtype=v.dtype, device=v.device)
    elif out.shape != (B, T, H, D) or out.dtype != v.dtype or out.device != v.device or not out.is_contiguous():
        raise ValueError(f"triton backend: argument 'out' received shape {tuple(out.shape)}, dtype {out.dtype}, "
                         f"device {out.device}; allowed: a contiguous {(B, T, H, D)} tensor of {v.dtype} on {v.device}")

    f32 = torch.float32
    if lse is not None and (lse.shape != (B, H, n * BLOCK) or lse.dtype != f32 or lse.device != q.device
                            or not lse.is_contiguous()):
        raise ValueError(f"triton backend: argument 'lse' received shape {tuple(lse.shape)}, dtype {lse.dtype}, "
                         f"device {lse.device}; allowed: a contiguous {(B, H, n * BLOCK)} fp32 tensor on {q.device}")
    kv_num = plan.kv_num_blocks.to(torch.int32).contiguous()
    kv_idx = plan.kv_indices.to(torch.int32).contiguous()
    max_blocks = kv_idx.shape[-1]
    block_len = plan.block_len.to(torch.int32).contiguous()
    key_mean = plan.key_mean.detach().to(f32).contiguous()
    has_tail = problem.tail and plan.tail_lse is not None
    has_coarse = problem.coarse_gate is not None
    has_bias = problem.key_bias is not None
    tail_lse = _plan_tensor(plan.tail_lse if has_tail else None, f32, key_mean)
    tail_value = _plan_tensor(plan.tail_value if has_tail else None, f32, key_mean)
    coarse = _plan_tensor(plan.coarse if has_coarse else None, f32, key_mean)
    if has_coarse and coarse.shape != (B, H, n, D):
        raise RuntimeError(f"triton backend: plan.coarse has shape {tuple(coarse.shape)}, expected {(B, H, n, D)}")
    gate = problem.coarse_gate if has_coarse else q
    if has_bias:
        key_bias = problem.key_bias.to(f32).contiguous()
        bias_stride_b = key_bias.stride(0) if key_bias.shape[0] > 1 else 0
    else:
        key_bias, bias_stride_b = key_mean, 0

    interpret = _interpreting() or q.device.type == "cpu"
    use_tma = cfg.tma and _tma_ok(problem, interpret)
    if interpret and q.dtype == torch.bfloat16:
        # The interpreter stores bf16 as raw uint16 bit patterns and its tl.dot multiplies those
        # as integers (fp16 is a real numpy type and works). Feeding it fp32 copies runs the same
        # kernel source with exact products; the output keeps v's dtype. Interpreter runs are tiny.
        q, k, v = (t.to(f32) for t in (q, k, v))
    k_arg, v_arg = k, v
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        k_arg, v_arg = (TensorDescriptor(t, list(t.shape), list(t.stride()), [1, BLOCK, 1, D]) for t in (k, v))
    grid = (n, B * H)
    kernel.compiled(interpret, jit_kernel)[grid](
        q, k_arg, v_arg, out, gate,
        kv_num, kv_idx, block_len, key_mean, tail_lse, tail_value, coarse, key_bias,
        key_mean if lse is None else lse,
        *q.stride(), *k.stride(), *v.stride(), *gate.stride(),
        bias_stride_b,
        T, H, n, max_blocks,
        problem.scale * kernel.LOG2E,
        HEAD_DIM=D, BLOCK=BLOCK,
        HAS_TAIL=has_tail, HAS_BIAS=has_bias, HAS_COARSE=has_coarse, KV_TMA=use_tma,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **(constexprs or {}),
        **({"WRITE_LSE": True} if lse is not None else {}),
    )
    return out


def _tma_ok(problem: Problem, interpret: bool) -> bool:
    """TMA descriptors need sm_90+, a contiguous last dim and 16-byte aligned strides and bases;
    dead rows inside T (block_len) would be read unmasked, so block_len keeps the pointer path."""
    if problem.block_len is not None:
        return False
    if not interpret:
        if problem.device.type != "cuda" or torch.cuda.get_device_capability(problem.device)[0] < 9:
            return False
    for t in (problem.k, problem.v):
        es = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any((s * es) % 16 for s in t.stride()[:-1]):
            return False
    return True


class TritonBackend(Backend):
    name = "triton"
    description = ("fused Triton kernel walking the plan's kv_indices with an online softmax "
                   "(tail and coarse branch folded in); gradients by a fused backward through sol_attn and "
                   "video_sparse_attn")
    devices = frozenset({"cuda", "xpu", "cpu"})
    dtypes = frozenset({torch.bfloat16, torch.float16})
    head_dims = frozenset({16, 32, 64, 128})
    features = ALL_FEATURES - {"autograd"}
    uses_plan = True
    fused_plan = True  # reads kv_num_blocks entries per row; the row stride is kv_indices' width
    min_compute_capability = (8, 0)

    def device_reasons(self, device: torch.device) -> List[str]:
        # conditions that installing Triton cannot fix come first, so the advice fits the machine
        if device.type == "cpu" and not _interpreting():
            return ["runs on CUDA GPUs (sm_80+); on the CPU only under TRITON_INTERPRET=1, for tests "
                    "(use the sdpa backend on the CPU)"]
        if device.type == "xpu" and os.environ.get(XPU_OPT_IN, "0") != "1":
            return [f"not yet run on real Intel hardware, so xpu needs an explicit opt-in: set {XPU_OPT_IN}=1"]
        if not _triton_installed():
            return [_install_hint(device.type, sys.platform)]
        return []

    def forward(self, problem: Problem, plan=None, config: Optional[KernelConfig] = None,
                lse: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The output; with ``lse`` (see :func:`launch`) also each row's log-sum-exp, which
        :func:`solattn.backends.triton.backward.fused_backward` needs."""
        if plan is None:
            raise ValueError("triton backend: forward needs the routing plan (solattn.routing.build_plan(problem))")
        with torch.no_grad():
            if problem.device.type == "cuda":
                with torch.cuda.device(problem.device):
                    return launch(problem, plan, config, lse=lse)
            return launch(problem, plan, config, lse=lse)
