"""The fused routing plan and the attention kernel overlapped, one group of heads at a time.

On a large problem the two halves of a ``sol_attn`` call want different parts of the GPU: the
fused plan's kernels (block means, centroid, scores, selection; 0.9-1.3 ms at H3 on an H200)
mostly stream q, k and v from memory once, while the attention kernel (8-16 ms there) is bound by
its arithmetic and reads its keys from L2. Run one after the other, the plan's time adds to the
call's. Here the batch * head rows are split into groups: the plan of every group is launched on
a side stream of high priority, group after group, and the kernel of a group is launched as soon
as its plan is done (it waits for that group's event only), so the plan of group ``i + 1`` runs
while the kernel works on group ``i``, and only the first group's plan is paid in full.

Each plan kernel and the attention kernel take a row offset ``g0`` (their grid covers rows
``g0 .. g1``), so nothing is copied or sliced: every group writes its rows of the one plan
(:class:`solattn.routing.fused.FusedPlanLaunch`) and of the one output.

Applies to inference calls on CUDA whose plan is the fused one and whose kernel launches at least
:data:`MIN_PROGRAMS` programs (see :func:`pipeline_groups`); the result is the same as the
unpipelined call's, bit for bit (the same kernels on the same rows). Under
``TRITON_INTERPRET=1`` the groups run one after the other on the CPU (tests), with no streams.

    import torch, solattn
    q, k, v = (torch.randn(1, 37296, 56, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with torch.no_grad():
        out = solattn.sol_attn(q, k, v, topk_ratio=0.2)   # pipelined: 56 * 583 programs
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Tuple

import torch

from ...routing.fused import FusedPlanLaunch, fused_plan_usable
from ...routing.plan import Plan
from ...validation import Problem

#: attention-kernel programs (B * H * n) from which ``sol_attn`` pipelines; smaller problems are
#: launch-bound, and their plans are best captured in CUDA graphs (``solattn.graphs``)
MIN_PROGRAMS = 16384

#: groups of batch * head rows per pipelined call (fewer where there are fewer rows); None: chosen
#: by :func:`pipeline_groups`. Set to 1 to turn the pipeline off.
GROUPS: Optional[int] = None

#: the groups' kernels alternate between the caller's stream and a second one (2) or all run on
#: the caller's stream (1)
KERNEL_STREAMS = 2

#: default groups per call, from an H200 sweep at H3 (benchmarks/diag/plan_h3_fused.py pipeline)
DEFAULT_GROUPS = 4

_streams: Dict[Tuple[int, str], "torch.cuda.Stream"] = {}


def pipeline_groups(problem: Problem) -> int:
    """How many row groups ``sol_attn`` splits ``problem`` into on the ``triton`` backend (1: not
    pipelined): a CUDA device outside the interpreter, the fused plan usable, at least
    :data:`MIN_PROGRAMS` kernel programs, and :data:`GROUPS` (or :data:`DEFAULT_GROUPS`) at most
    one group per batch * head row."""
    if problem.device.type != "cuda" or not fused_plan_usable(problem):
        return 1
    G = problem.B * problem.H
    if G * problem.n < MIN_PROGRAMS:
        return 1
    return max(1, min(G, GROUPS if GROUPS is not None else DEFAULT_GROUPS))


def group_bounds(rows: int, groups: int) -> List[Tuple[int, int]]:
    """``rows`` split into ``groups`` consecutive ``(g0, g1)`` ranges of sizes differing by at most one."""
    if not 1 <= groups <= rows:
        raise ValueError(f"group_bounds: argument 'groups' received {groups}; allowed: 1 to rows = {rows}")
    edges = [rows * i // groups for i in range(groups + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _stream(device: torch.device, role: str) -> "torch.cuda.Stream":
    """One stream per (device, role), made once: "plan" at the highest priority (its blocks are
    scheduled ahead of the kernel's waiting ones), "kernel" at the default priority."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, role)
    if key not in _streams:
        _streams[key] = torch.cuda.Stream(index, priority=-100 if role == "plan" else 0)
    return _streams[key]


def pipelined_forward(problem: Problem, groups: int, config=None) -> Tuple[torch.Tensor, Plan]:
    """``problem``'s output and its (fused) plan, the plan of each of ``groups`` row groups
    overlapped with the previous group's kernel (see the module docstring). The caller checks
    :func:`solattn.routing.fused.fused_plan_usable`; ``config``: a
    :class:`~.backend.KernelConfig` (default: the backend's)."""
    from .backend import default_config, kernel_operands, run_kernel
    from . import kernel  # imports Triton

    B, T, H, D = problem.B, problem.T, problem.H, problem.D
    bounds = group_bounds(B * H, groups)
    launch = FusedPlanLaunch(problem)        # allocations only, on the caller's stream
    plan = launch.plan
    out = torch.empty((B, T, H, D), dtype=problem.v.dtype, device=problem.device)
    ops = kernel_operands(problem, plan)     # views of the plan's tensors, nothing read yet
    cfg = config or default_config(problem)
    if problem.device.type != "cuda":        # the interpreter: the same launches, one after the other
        for g0, g1 in bounds:
            launch.rows(g0, g1)
            run_kernel(kernel.sol_attn_fwd, problem, plan, cfg, out, rows=(g0, g1), ops=ops)
        return out, plan

    main = torch.cuda.current_stream(problem.device)
    side = _stream(problem.device, "plan")
    kernel_streams = [main, _stream(problem.device, "kernel")][:max(1, KERNEL_STREAMS)]
    side.wait_stream(main)                   # q, k, v as the caller's stream left them
    for i, (g0, g1) in enumerate(bounds):
        # launched in this order, a group's kernel is queued while the plan of the next is built
        # (the host's work for the kernel launch, e.g. its TMA descriptors, overlaps the GPU's)
        with torch.cuda.stream(side):
            launch.rows(g0, g1)
            ready = torch.cuda.Event()
            ready.record(side)
        stream = kernel_streams[i % len(kernel_streams)]
        stream.wait_event(ready)
        with torch.cuda.stream(stream) if stream is not main else contextlib.nullcontext():
            run_kernel(kernel.sol_attn_fwd, problem, plan, cfg, out, rows=(g0, g1), ops=ops)
    # the caller's stream goes on after every launch here (also what keeps the buffers used on the
    # other streams safe to reuse once freed: the allocator hands them to the caller's stream)
    for stream in kernel_streams[1:] + [side]:
        main.wait_stream(stream)
    return out, plan
