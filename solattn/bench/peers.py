"""Other implementations of the same operators, timed beside solattn's when present.

- ``sol_attn``: comfy-kitchen's fused CUDA kernel (``comfy_kitchen.sol_attn`` under
  ``comfy_kitchen.use_backend("cuda")``), the kernel ComfyUI's built-in sparse node calls.
- ``video_sparse_attn``: FastVideo's VSA op (``fastvideo_kernel.video_sparse_attn``), the op
  VSA models were trained with, on its compiled sm_90 kernel and on its Triton kernel
  (``FASTVIDEO_VSA_TRITON=1``, which it reads at every call). It takes ``(B, H, S, D)`` tensors
  already in cube order: :func:`to_fastvideo` gives it the tokens tiled by :func:`solattn.tile`,
  :func:`from_fastvideo` returns its output to raw order.

A peer is imported only when the benchmark runs on a CUDA device, and a missing or incapable
install is a reason in the "not run" list, not an error.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from .. import tile, untile

#: the row name of comfy-kitchen's CUDA kernel
COMFY_KITCHEN = "comfy-kitchen"

PEERS = (COMFY_KITCHEN,)


def _comfy_kitchen(device: torch.device, dtype: torch.dtype, D: int) -> Tuple[Optional[object], str]:
    """``(module, "")`` when comfy-kitchen's CUDA sol_attn can run here, else ``(None, why)``."""
    if device.type != "cuda":
        return None, "its fused kernel runs on CUDA only"
    if importlib.util.find_spec("comfy_kitchen") is None:
        return None, "comfy_kitchen not importable (pip install comfy-kitchen)"
    try:
        import comfy_kitchen as ck
    except Exception as exc:  # a broken install must not stop the benchmark
        return None, f"import comfy_kitchen failed: {type(exc).__name__}: {exc}"
    if not ck.sol_attn_is_available(device):
        return None, "comfy_kitchen.sol_attn_is_available() is False on this GPU"
    if dtype not in (torch.bfloat16, torch.float16) or D != 128:
        return None, "its kernel takes bf16/fp16 with head_dim 128 only"
    return ck, ""


def peer_calls(device: torch.device, dtype: torch.dtype, D: int
               ) -> Tuple[Dict[str, Callable[..., torch.Tensor]], List[str]]:
    """``({name: fn(q, k, v, tau, topk_ratio, tail, coarse_gate)}, ["name: why not"])``."""
    calls, missing = {}, []
    ck, why = _comfy_kitchen(device, dtype, D)
    if ck is None:
        missing.append(f"{COMFY_KITCHEN}: {why}")
    else:
        def comfy_kitchen_cuda(q, k, v, tau, topk_ratio, tail, coarse_gate):
            with ck.use_backend("cuda"):
                return ck.sol_attn(q, k, v, tau=tau, topk_ratio=topk_ratio, tail=tail, coarse_gate=coarse_gate)
        calls[COMFY_KITCHEN] = comfy_kitchen_cuda
    return calls, missing


#: the row names of FastVideo's VSA op: its compiled sm_90 kernel, its Triton kernel
FASTVIDEO_SM90 = "fastvideo-sm90"
FASTVIDEO_TRITON = "fastvideo-triton"

VSA_PEERS = (FASTVIDEO_SM90, FASTVIDEO_TRITON)

#: FastVideo's switches of its VSA kernel, read at every call (the second is its older name)
_FORCE_TRITON = ("FASTVIDEO_VSA_TRITON", "FASTVIDEO_KERNEL_VSA_FORCE_TRITON")


def to_fastvideo(x: torch.Tensor, grid) -> Tuple[torch.Tensor, torch.Tensor]:
    """Raw video tokens ``(B, t*h*w, H, D)`` -> FastVideo's layout ``(B, H, 64 n, D)`` (cubes of
    4x4x4 in :func:`solattn.tile`'s order, dead rows zero), contiguous, and the ``(n,)`` live
    count per cube (its ``variable_block_sizes``)."""
    tiled, block_len = tile(x, grid)
    return tiled.transpose(1, 2).contiguous(), block_len


def from_fastvideo(y: torch.Tensor, grid) -> torch.Tensor:
    """Inverse of :func:`to_fastvideo`: ``(B, H, 64 n, D)`` -> ``(B, t*h*w, H, D)`` raw order."""
    return untile(y.transpose(1, 2), grid)


@contextlib.contextmanager
def _environment(values: Dict[str, str]) -> Iterator[None]:
    old = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class FastVideoVSA:
    """``fastvideo_kernel.video_sparse_attn`` with one kernel choice: ``triton=True`` sets
    ``FASTVIDEO_VSA_TRITON=1`` around the call, ``False`` sets both of its switches to 0 (its
    default: the sm_90 kernel where it can run). The forward picks the kernel and its autograd
    node, so the backward runs the same kernel's backward."""

    def __init__(self, module, triton: bool):
        self.module, self.triton = module, triton
        flag = "1" if triton else "0"
        self.env = {name: flag for name in (_FORCE_TRITON[:1] if triton else _FORCE_TRITON)}

    def __call__(self, tq: torch.Tensor, tk: torch.Tensor, tv: torch.Tensor, block_len: torch.Tensor,
                 topk: int, tgate: Optional[torch.Tensor]) -> torch.Tensor:
        """Tiled ``(B, H, 64 n, D)`` inputs (:func:`to_fastvideo`), ``topk`` kept cubes per query cube,
        ``tgate`` the coarse branch's gate in the same layout (None: coarse added ungated)."""
        with _environment(self.env):
            return self.module.video_sparse_attn(tq, tk, tv, block_len, block_len, int(topk), (4, 4, 4), tgate)

    def raw(self, q, k, v, grid, topk: int, gate=None) -> torch.Tensor:
        """The same call on raw ``(B, t*h*w, H, D)`` tokens, tiled before and untiled after."""
        (tq, block_len), (tk, _), (tv, _) = (to_fastvideo(x, grid) for x in (q, k, v))
        tg = None if gate is None else to_fastvideo(gate, grid)[0]
        return from_fastvideo(self(tq, tk, tv, block_len, topk, tg), grid)


def load_fastvideo() -> Tuple[Optional[object], str]:
    """``(fastvideo_kernel, "")``, or ``(None, why)`` when it cannot be imported."""
    try:
        if importlib.util.find_spec("fastvideo_kernel") is None:
            return None, "fastvideo_kernel not importable (pip install fastvideo-kernel)"
    except ValueError:             # a module entry without a spec (set to None: import refused)
        pass
    try:
        return importlib.import_module("fastvideo_kernel"), ""
    except Exception as exc:  # a broken install must not stop the benchmark
        return None, f"import fastvideo_kernel failed: {type(exc).__name__}: {exc}"


def _sm90_kernel(device: torch.device) -> str:
    """"" when FastVideo's compiled sm_90 VSA kernel can run on ``device``, else why not."""
    major_minor = torch.cuda.get_device_capability(device)
    if major_minor != (9, 0):
        return f"its compiled kernel is for sm_90 (H100/H200); this GPU is sm_{major_minor[0]}{major_minor[1]}"
    try:
        ops = importlib.import_module("fastvideo_kernel._C.fastvideo_kernel_ops")
    except Exception as exc:
        return f"its compiled extension did not load: {type(exc).__name__}: {exc}"
    if getattr(ops, "block_sparse_fwd", None) is None or getattr(ops, "block_sparse_bwd", None) is None:
        return "its compiled extension has no block-sparse VSA kernel"
    return ""


def vsa_peer_calls(device: torch.device, dtype: torch.dtype) -> Tuple[Dict[str, FastVideoVSA], List[str]]:
    """``({name: FastVideoVSA}, ["name: why not"])`` for FastVideo's VSA op on ``device``."""
    if device.type != "cuda":
        return {}, [f"{name}: FastVideo's VSA kernels run on CUDA only" for name in VSA_PEERS]
    if dtype not in (torch.bfloat16, torch.float16):
        return {}, [f"{name}: FastVideo's VSA kernels take bf16/fp16 only" for name in VSA_PEERS]
    fv, why = load_fastvideo()
    if fv is None:
        return {}, [f"{name}: {why}" for name in VSA_PEERS]
    calls, missing = {FASTVIDEO_TRITON: FastVideoVSA(fv, triton=True)}, []
    why = _sm90_kernel(device)
    if why:
        missing.append(f"{FASTVIDEO_SM90}: {why}")
    else:
        calls = {FASTVIDEO_SM90: FastVideoVSA(fv, triton=False), **calls}
    return calls, missing
