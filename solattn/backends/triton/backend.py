"""The ``triton`` backend: launcher for the fused block-index kernel (``kernel.py``).

Importing this module never imports Triton; the kernel module is loaded on the
first forward call, and a missing Triton is reported as a reason instead.
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional, Sequence, Tuple

import torch

from ...config import current_tuning, graph_recording
from ...triton_runtime import interpret_on, interpreting, on_device
from ...triton_runtime import triton_installed as _triton_installed
from ...validation import BLOCK, Problem
from ..base import ALL_FEATURES, Backend, BackwardBuffers, Gradients
from .operands import KernelOperands, kernel_operands, tma_descriptors, tma_ok  # noqa: F401 (KernelOperands: re-exported)
from .tuning import DEFAULT_CONFIGS, KernelConfig, TritonTuning  # noqa: F401 (DEFAULT_CONFIGS: re-exported)

#: environment variable that opts in to running the kernel on Intel XPUs
XPU_OPT_IN = "SOLATTN_TRITON_XPU"


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


def launch(problem: Problem, plan, config: Optional[KernelConfig] = None,
           out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None,
           resid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Run the kernel on ``problem`` with the selection in ``plan``; returns ``(B, T, H, D)`` contiguous
    (with a row table, ``Problem.rows``: q's shape, in q's token order).

    ``config`` defaults to the :class:`~.tuning.TritonTuning` in force (:func:`solattn.config.tuning`):
    its ``forward`` config, else ``DEFAULT_CONFIGS`` for the head dim with pointer loads below
    ``tma_min_programs`` programs, unless a CUDA graph is being recorded and ``tma_in_graphs``.
    ``out``, when given, must be a contiguous tensor of that shape, of v's dtype on q's device;
    the kernel writes every element of it (tests poison it first).
    ``lse`` and ``resid``, given together, receive what the fused backward needs: ``lse`` a
    contiguous fp32 ``(B, H, n * 64)`` tensor, each row's base-2 log-sum-exp (see
    :func:`solattn.backends.triton.backward.lse_shape`); ``resid`` a contiguous ``(B, T, H, D)``
    tensor of v's dtype (``T`` the problem's rows), the output's rounding residual (output +
    residual = the unrounded attention output, see ``kernel.write_rows``).
    """
    if config is not None and not isinstance(config, KernelConfig):
        raise TypeError(f"triton backend: argument 'config' received {type(config).__name__}; "
                        f"allowed: None or a KernelConfig")
    cfg = config
    if cfg is None:
        cfg = _forward_config(problem)
    return run_kernel(problem, plan, cfg, out, lse=lse, resid=resid)


def _forward_config(problem: Problem) -> KernelConfig:
    """The forward's config in force for ``problem`` (see :func:`launch`)."""
    return current_tuning(TritonTuning).forward_config(problem.B * problem.H * problem.n, graph_recording(),
                                                       problem.D)


def _reads(problem: Problem, cfg: KernelConfig, interpret: bool) -> Tuple[bool, bool, bool]:
    """``(use_tma, tiled_kv, len_code)``: whether the forward kernel with ``cfg`` takes TMA loads for
    ``problem``, and so reads tiled copies of k and v (a problem with a row table) and the listed
    blocks' lengths as codes (block_len, :func:`kernel.len_codes`)."""
    use_tma = cfg.tma and tma_ok(problem, interpret)
    return (use_tma, use_tma and problem.rows is not None,
            use_tma and problem.block_len is not None and problem.n < (1 << 16))


def _check_buffer(name: str, t: Optional[torch.Tensor], shape, dtype: torch.dtype, device: torch.device):
    if t is not None and (t.shape != shape or t.dtype != dtype or t.device != device or not t.is_contiguous()):
        raise ValueError(f"triton backend: argument '{name}' received shape {tuple(t.shape)}, dtype {t.dtype}, "
                         f"device {t.device}; allowed: a contiguous {tuple(shape)} tensor of {dtype} on {device}")


def run_kernel(problem: Problem, plan, cfg: KernelConfig, out: Optional[torch.Tensor] = None,
               lse: Optional[torch.Tensor] = None, resid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Launch the forward kernel with ``cfg`` on ``problem`` and ``plan`` (see :func:`launch`)."""
    from ...triton_runtime.jit import compiled  # imports triton
    from . import kernel

    B, T, H, D, n = problem.B, problem.T, problem.H, problem.D, problem.n
    v = problem.v
    T_out = problem.q.shape[1]            # the tensors' tokens: T, or fewer with a row table
    if out is None:
        out = torch.empty((B, T_out, H, D), dtype=v.dtype, device=v.device)
    _check_buffer("out", out, (B, T_out, H, D), v.dtype, v.device)
    if (lse is None) != (resid is None):
        raise ValueError("triton backend: arguments 'lse' and 'resid' received "
                         f"{'a tensor' if lse is not None else 'None'} and {'a tensor' if resid is not None else 'None'}; "
                         "allowed: both tensors (the backward's buffers) or both None")
    _check_buffer("lse", lse, (B, H, n * BLOCK), torch.float32, v.device)
    _check_buffer("resid", resid, (B, T, H, D), v.dtype, v.device)
    ops = kernel_operands(problem, plan)
    use_tma, tile, len_code = _reads(problem, cfg, ops.interpret)
    made_kv, made_codes = plan.take("tiled_kv"), plan.take("len_codes")     # by the fused plan's kernels
    q, k_arg, v_arg = ops.q, ops.k, ops.v
    if tile:          # TMA reads a block's rows contiguous: a tiled copy
        k_arg, v_arg = made_kv or tiled_kv(ops, T)
    k_strides, v_strides = k_arg.stride(), v_arg.stride()
    if use_tma:
        k_arg, v_arg = tma_descriptors(k_arg, v_arg)
    # with TMA loads, block_len's lengths travel with the listed indices (kernel.len_codes): a
    # length loaded in the key loop kept the TMA loads two stages deep instead of three
    kv_idx = ops.kv_idx
    if len_code and made_codes is not None:
        kv_idx = made_codes
    elif len_code:
        kv_idx = torch.empty_like(ops.kv_idx)
        compiled(ops.interpret, kernel.len_codes)[(ops.kv_num.numel(),)](
            ops.kv_num, ops.kv_idx, ops.block_len, kv_idx, kv_idx.shape[-1], W=BLOCK, BLOCK=BLOCK, num_warps=1)
    # the query blocks that attend every key block (sink_q; VSA's prefix tiles) are the long
    # programs: launched first (kernel.program_ids)
    long_lo, long_hi = problem.sink_q or (0, 0)
    long_first = 0 < long_hi - long_lo < n
    grid = (n, B * H)
    compiled(ops.interpret, kernel.sol_attn_fwd)[grid](
        q, k_arg, v_arg, out, ops.gate,
        ops.kv_num, kv_idx, ops.block_len, ops.key_mean, ops.tail_lse, ops.tail_value, ops.coarse,
        ops.key_bias, ops.key_mean if lse is None else lse, out if resid is None else resid, ops.rows,
        *q.stride(), *k_strides, *v_strides, *ops.gate.stride(),
        ops.bias_stride_b,
        T, T_out, H, n, ops.kv_idx.shape[-1],
        problem.scale * kernel.LOG2E,
        long_lo, long_hi - long_lo,
        HEAD_DIM=D, BLOCK=BLOCK,
        HAS_TAIL=ops.has_tail, HAS_BIAS=ops.has_bias, HAS_COARSE=ops.has_coarse, KV_TMA=use_tma,
        # the softmax may scale raw logits in its FMA only where nothing is added to them and a
        # positive scale keeps their order (the spec allows any finite scale)
        FOLD_SCALE=not ops.has_bias and problem.scale > 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"WRITE_LSE": True} if lse is not None else {}),
        **({"TMA_LEN": True} if use_tma and problem.block_len is not None else {}),
        **({"ROWS": True, "KV_ROWS": not use_tma} if ops.has_rows else {}),
        **({"LONG_FIRST": True} if long_first else {}),
        **({"LEN_CODE": True} if len_code else {}),
    )
    return out


def tiled_kv(ops: KernelOperands, T: int):
    """Contiguous ``(B, T, H, D)`` copies of k and v in the row table's order, zeros in the dead
    rows (:func:`tiled_copies`): what TMA loads of a problem with a row table read."""
    return tiled_copies((ops.k, ops.v), ops.rows, ops.block_len, T)


def tiled_copies(xs: Sequence[torch.Tensor], rows: torch.Tensor, block_len: torch.Tensor,
                 T: int) -> List[torch.Tensor]:
    """Contiguous ``(B, T, H, D)`` copies of the ``(B, T_in, H, D)`` tensors ``xs`` in the tiled
    layout of the row table ``rows`` (int64 ``(T,)``: row r holds token ``rows[r]`` when live,
    ``r mod 64 < block_len[r // 64]``), zeros in the dead rows, as :func:`solattn.tiling.to_tiled`
    makes them: one :func:`kernel.tile_rows` launch for each run of up to five tensors that it
    reads from the first one's address (:func:`_joins`), where a gather and a fill each took a
    torch op. Launched on the current device."""
    from ...triton_runtime.jit import compiled  # imports triton
    from . import kernel

    first = xs[0]
    B, _, H, D = first.shape
    interpret = interpret_on(first.device)
    same = [x for x in xs[:kernel.TILE_ROWS_MAX] if _joins(x, first, interpret)]
    if len(same) < len(xs) and any(x is not y for x, y in zip(same, xs)):     # not a prefix: one at a time
        return [c for x in xs for c in tiled_copies((x,), rows, block_len, T)]
    out = torch.empty((len(same), B, T, H, D), dtype=first.dtype, device=first.device)
    size = first.element_size()
    offsets = [(x.data_ptr() - first.data_ptr()) // size for x in same[1:]]
    offsets += [0] * (kernel.TILE_ROWS_MAX - 1 - len(offsets))
    compiled(interpret, kernel.tile_rows)[(-(-T // BLOCK), B * H, len(same))](
        first, out, rows, block_len, *offsets, *first.stride(), T, H, HEAD_DIM=D, BLOCK=BLOCK)
    copies = list(out.unbind(0))
    return copies + (tiled_copies(xs[len(same):], rows, block_len, T) if len(same) < len(xs) else [])


def _joins(x: torch.Tensor, first: torch.Tensor, interpret: bool) -> bool:
    """Whether one :func:`kernel.tile_rows` launch reads ``x`` at an element offset from ``first``:
    the same dtype and strides, a whole number of elements apart (a tensor of foreign memory may
    sit at any byte), and real addresses: the interpreter copies a GPU tensor's storage to the
    host, so there only views of one storage keep their distance."""
    if x is first:
        return True
    if x.dtype != first.dtype or x.stride() != first.stride():
        return False
    if (x.data_ptr() - first.data_ptr()) % first.element_size():
        return False
    return not interpret or first.device.type == "cpu" or \
        x.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()


class TritonBackend(Backend):
    name = "triton"
    description = ("fused Triton kernel walking the plan's kv_indices with an online softmax "
                   "(tail and coarse branch folded in); gradients by a fused backward through sol_attn and "
                   "video_sparse_attn")
    devices = frozenset({"cuda", "xpu", "cpu"})
    dtypes = frozenset({torch.bfloat16, torch.float16})
    head_dims = frozenset({16, 32, 64, 128})
    features = ALL_FEATURES - {"autograd"}   # the kernel records no autograd: it has its own backward
    uses_plan = True
    fused_plan = True  # reads kv_num_blocks entries per row; the row stride is kv_indices' width
    row_table = True   # reads q, k, v, the gate and writes the output at a row table's tokens
    min_compute_capability = (8, 0)
    differentiation = "own"

    def device_reasons(self, device: torch.device) -> List[str]:
        # conditions that installing Triton cannot fix come first, so the advice fits the machine
        if device.type == "cpu" and not interpreting():
            return ["runs on CUDA GPUs (sm_80+); on the CPU only under TRITON_INTERPRET=1, for tests "
                    "(use the sdpa backend on the CPU)"]
        if device.type == "xpu" and os.environ.get(XPU_OPT_IN, "0") != "1":
            return [f"not yet run on real Intel hardware, so xpu needs an explicit opt-in: set {XPU_OPT_IN}=1"]
        if not _triton_installed():
            return [_install_hint(device.type, sys.platform)]
        return []

    def plan_extras(self, problem: Problem):
        """The tiled copies of k and v and the length codes, where the forward's TMA loads read them."""
        _, tile, len_code = _reads(problem, _forward_config(problem), interpret_on(problem.device))
        return frozenset(name for name, wanted in (("tiled_kv", tile), ("len_codes", len_code)) if wanted)

    def tiled_copies(self, xs, rows, block_len, T):
        """One :func:`kernel.tile_rows` launch for up to five tensors of one dtype and strides, on
        their device (the op layer's backward may run under another current device)."""
        with on_device(xs[0].device):
            return tiled_copies(xs, rows, block_len, T)

    def forward(self, problem: Problem, plan=None, config: Optional[KernelConfig] = None,
                buffers: Optional[BackwardBuffers] = None) -> torch.Tensor:
        """The output; with ``buffers`` also what :meth:`backward` needs (see :func:`launch`:
        each row's base-2 log-sum-exp and the output's rounding residual)."""
        if plan is None:
            raise ValueError("triton backend: forward needs the routing plan (solattn.routing.build_plan(problem))")
        lse, resid = buffers if buffers is not None else (None, None)
        with torch.no_grad(), on_device(problem.device):
            return launch(problem, plan, config, lse=lse, resid=resid)

    def forward_for_backward(self, problem: Problem, plan, buffers: BackwardBuffers) -> torch.Tensor:
        return self.forward(problem, plan, buffers=buffers)

    def backward(self, problem: Problem, plan, out: torch.Tensor, buffers: BackwardBuffers,
                 grad_out: torch.Tensor, bias_grad: bool, rows: Optional[torch.Tensor] = None) -> Gradients:
        """The fused backward (:mod:`solattn.backends.triton.backward`): two kernels give the
        token-level gradients (the coarse branch's included) and the block-level sums of the tail's terms."""
        from . import backward  # imports triton
        with on_device(problem.device):
            g = backward.fused_backward(problem, plan, out, buffers.lse, buffers.resid, grad_out, bias_grad=bias_grad,
                                        rows=rows)
        terms = {"tail_lse": g.dtail_lse, "tail_value": g.dtail_value, "key_mean": g.dkey_mean}
        return Gradients(dq=g.dq, dk=g.dk, dv=g.dv, dgate=g.dgate, dbias=g.dbias,
                         plan={name: t for name, t in terms.items() if t is not None})

