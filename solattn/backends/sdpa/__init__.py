"""The ``sdpa`` (portable) backend: gather the kept key blocks, let the device's SDPA do the arithmetic.

Query blocks are grouped by how many exact key blocks they keep (:mod:`.grouping`); each group
runs as batched ``F.scaled_dot_product_attention`` calls (oneDNN on XPU, flash on CPU,
cuDNN/flash on CUDA, Metal on MPS) over keys and values gathered straight from the caller's
tensors (:mod:`.layout`), in chunks sized by one memory model (:mod:`.memory`) so that working
memory stays within the budget plus a small constant at any T and H (:mod:`.forward`).
Equal counts need no padding and, when nothing needs masking, no mask, so the device's fastest
kernel runs.

- Exact keys are used as given, not centred: a softmax row is unchanged by a per-row shift, so
  the exact logits ``scale q_t . k_u + bias_u`` keep the inputs' own precision. Only the pooled
  tail's logit carries the centroid, ``tail_lse_i + scale q_t . m``: the centroid rounded to the
  input dtype is the tail's key, and the rounding residual, which varies per query row, rides in
  the mask, which then has one row per query row (:func:`.tail.append_tail`).
- ``block_len``, ragged last blocks and ``key_bias`` become an additive key mask, only for the
  query blocks that need it. Finite entries are clamped to ``±1e30`` (fp16 masks: ``±65504``),
  so fused kernels that scale logits by ``log2(e)`` in fp32 never overflow them to ``-inf``.
  With fp16 inputs on a device whose SDPA takes the mask in fp16 (CUDA, XPU, MPS), a bias below
  -65504 on every key of a row therefore acts as a constant shift, and the row is the unbiased
  softmax (the exact value; an fp32 computation instead rounds ``logit + bias`` to ``bias`` and
  averages uniformly).
- With gradients every op is an ordinary differentiable torch op: autograd flows through q, k,
  v, a float ``key_bias`` and coarse_gate, with the selection held constant.
"""

from __future__ import annotations

from typing import List

import torch

import torch.nn.functional as F

from ...routing import Plan
from ...validation import BLOCK, Problem
from ..base import ALL_FEATURES, Backend
from .forward import budget, sdpa_forward
from .memory import floor_bytes
from .tuning import SdpaTuning

__all__ = ["SdpaBackend", "SdpaTuning", "budget", "sdpa_forward"]


class SdpaBackend(Backend):
    name = "sdpa"
    description = ("portable: gathers kept key blocks, runs F.scaled_dot_product_attention "
                   "(oneDNN on XPU, flash on CPU/CUDA, Metal on MPS); memory bounded by a budget")
    devices = frozenset({"cpu", "cuda", "xpu", "mps"})
    features = ALL_FEATURES

    def device_reasons(self, device: torch.device) -> List[str]:
        if not hasattr(F, "scaled_dot_product_attention"):
            return ["torch.nn.functional.scaled_dot_product_attention missing (torch too old)"]
        return []

    def problem_reasons(self, problem: Problem) -> List[str]:
        """A memory budget below the call's floor (:func:`.memory.floor_bytes`): what the routing
        plan and the per-call tables hold whatever the chunk sizes."""
        need, have = floor_bytes_of(problem), budget.bytes
        if have >= need:
            return []
        return [f"the memory budget of {_mib(have)} (solattn.memory_budget / set_memory_budget / "
                f"SOLATTN_SDPA_BUDGET) is below the {_mib(need)} this call needs whatever its chunk sizes "
                f"(the routing plan's block means and outputs and the per-call tables, which grow as "
                f"B*H*T at B={problem.B} T={problem.T} H={problem.H} D={problem.D}); allowed: a budget of at "
                f"least {_mib(need)}"]

    def forward(self, problem: Problem, plan: Plan) -> torch.Tensor:
        return sdpa_forward(problem, plan)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def floor_bytes_of(problem: Problem) -> int:
    """:func:`.memory.floor_bytes` of a call, the index lists at their narrowest (the neighbours,
    the top-k count and the sink blocks)."""
    from ...routing.select import topk_count
    n = problem.n
    width = 3
    if problem.topk_ratio > 0:
        width = max(width, topk_count(problem.topk_ratio, n))
    if problem.sink_blocks is not None:
        width += max(0, min(n, problem.sink_blocks[1]) - problem.sink_blocks[0])
    masked = problem.key_bias is not None or problem.block_len is not None or problem.T % BLOCK != 0
    return floor_bytes(problem.B, problem.T, problem.H, problem.D, problem.tail, problem.coarse_gate is not None,
                       0 if problem.key_bias is None else problem.key_bias.shape[0], masked, min(n, width))
