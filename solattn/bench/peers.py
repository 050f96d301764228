"""Other implementations of the same operator, timed beside solattn's backends when present.

Only comfy-kitchen's fused CUDA kernel today (``comfy_kitchen.sol_attn`` under
``comfy_kitchen.use_backend("cuda")``): the kernel ComfyUI's built-in sparse node calls. It is
imported only when the benchmark runs on a CUDA device, and a missing or incapable install
is a reason in the "not run" list, not an error.
"""

from __future__ import annotations

import importlib.util
from typing import Callable, Dict, List, Optional, Tuple

import torch

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
