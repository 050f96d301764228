"""What the ``triton`` backend's kernels read: :class:`KernelOperands`, prepared once per launch
from a problem and its plan, for the forward (``backend.py``) and the backward (``backward.py``).
Plain torch: importing this module does not import Triton."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...triton_runtime import cuda_capability, interpret_on, interpretable
from ...validation import BLOCK, Problem


@dataclass(frozen=True)
class KernelOperands:
    """What the forward and backward kernels read, prepared once per launch from a problem and
    its plan: contiguous int32 / fp32 plan tensors (an unused field points at ``key_mean``, a
    dummy the kernel never reads), the key bias as fp32 with its batch stride (0 when shared),
    and the flags of the kernels' constexprs. Under the interpreter bf16 ``q``, ``k``, ``v`` and
    ``gate`` are fp32 copies (:func:`solattn.triton_runtime.interpretable`; interpreter runs are tiny)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    gate: torch.Tensor
    kv_num: torch.Tensor
    kv_idx: torch.Tensor
    block_len: torch.Tensor
    key_mean: torch.Tensor
    tail_lse: torch.Tensor
    tail_value: torch.Tensor
    coarse: torch.Tensor
    key_bias: torch.Tensor
    bias_stride_b: int
    #: the row table (``Problem.rows``), int64; ``key_mean`` (never read) without one
    rows: torch.Tensor
    has_tail: bool
    has_coarse: bool
    has_bias: bool
    has_rows: bool
    interpret: bool


def kernel_operands(problem: Problem, plan) -> KernelOperands:
    """The :class:`KernelOperands` of ``problem`` run with ``plan``."""
    f32 = torch.float32
    B, H, n, D = problem.B, problem.H, problem.n, problem.D
    key_mean = _as(plan.key_mean, f32)
    has_tail = problem.tail and plan.tail_lse is not None
    has_coarse = problem.coarse_gate is not None
    has_bias = problem.key_bias is not None
    has_rows = problem.rows is not None
    if has_rows and has_bias:
        raise RuntimeError("triton backend: a problem with a row table (Problem.rows) has no key_bias")

    def field(t, used):
        return _as(t, f32) if used else key_mean

    coarse = field(plan.coarse, has_coarse)
    if has_coarse and coarse.shape != (B, H, n, D):
        raise RuntimeError(f"triton backend: plan.coarse has shape {tuple(coarse.shape)}, expected {(B, H, n, D)}")
    if has_bias:
        key_bias = _as(problem.key_bias, f32)
        bias_stride_b = key_bias.stride(0) if key_bias.shape[0] > 1 else 0
    else:
        key_bias, bias_stride_b = key_mean, 0
    q, k, v = problem.q, problem.k, problem.v
    gate = problem.coarse_gate if has_coarse else q
    interpret = interpret_on(q.device)
    q, k, v, gate = interpretable(interpret, q, k, v, gate)
    return KernelOperands(
        q=q, k=k, v=v, gate=gate,
        kv_num=_as(plan.kv_num_blocks, torch.int32), kv_idx=_as(plan.kv_indices, torch.int32),
        block_len=_as(plan.block_len, torch.int32), key_mean=key_mean,
        tail_lse=field(plan.tail_lse, has_tail), tail_value=field(plan.tail_value, has_tail),
        coarse=coarse, key_bias=key_bias, bias_stride_b=bias_stride_b,
        rows=_as(problem.rows, torch.int64) if has_rows else key_mean,
        has_tail=has_tail, has_coarse=has_coarse, has_bias=has_bias, has_rows=has_rows, interpret=interpret)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as a contiguous ``dtype`` tensor that records no autograd: ``t`` itself when it is one
    already (the fused plan's tensors are), with no op dispatched (each costs microseconds of host
    time per launch); else a detached contiguous copy or view."""
    if t.dtype == dtype and not t.requires_grad and t.is_contiguous():
        return t
    return t.detach().to(dtype).contiguous()


def tma_ok(problem: Problem, interpret: bool) -> bool:
    """TMA descriptors need sm_90+, a contiguous last dim and 16-byte aligned strides and bases;
    dead rows inside T (block_len) are read unmasked, so block_len keeps the pointer path unless
    they are known to hold zeros (``Problem.dead_rows_zero``: VSA's tiled layout, and the copies
    :func:`solattn.backends.triton.backend.tiled_kv` makes for a problem with a row table)."""
    if problem.block_len is not None and not (problem.dead_rows_zero or problem.rows is not None):
        return False
    if not interpret:
        if problem.device.type != "cuda" or cuda_capability(problem.device)[0] < 9:
            return False
    if problem.rows is not None:
        return True                # fresh contiguous copies (tiled_kv)
    return all(tma_layout_ok(t) for t in (problem.k, problem.v))


def tma_layout_ok(t: torch.Tensor) -> bool:
    """A TMA descriptor can read ``t``: contiguous last dim, 16-byte aligned base and strides."""
    es = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and not any((s * es) % 16 for s in t.stride()[:-1])


def tma_descriptors(*tensors):
    """``(B, T, H, D)`` TMA descriptors of ``tensors``, one 64-row block of one head per load."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    return tuple(TensorDescriptor(t, list(t.shape), list(t.stride()), [1, BLOCK, 1, t.shape[-1]]) for t in tensors)
