"""The routing plan of ``sol_attn`` in six Triton kernels (GPU inference path), and of
``video_sparse_attn`` through the same kernels with VSA's :class:`Rule` (:func:`vsa_rule`).

The torch plan (:func:`.plan.assemble_plan`) is a few dozen small operations plus one host
synchronisation (the width of ``kv_indices``); on a GPU at small T it is launch-bound and
costs more than the attention kernel. Here the same plan takes at most six launches (five
without the tail and coarse terms, three in tau mode without them and with IEEE products) and no
sync:

1. :func:`.fused_kernels.means_kernel`, one program per (block, batch * head): fp32 means of q, k, v over
   the live rows of the block, and the live lengths ``L_j``.
2. :func:`.fused_kernels.centroid_kernel`, ``D / 32`` programs per batch * head: the key centroid ``m``
   and, in tau mode, the population variance of the centred key means over blocks.
3. :func:`.fused_kernels.scores_kernel`, one program per (64 x 64 tile of block pairs, batch *
   head): the routing scores ``scale log2(e) qm_i . (km_j - m)`` (``m = 0`` under VSA's rule) into
   an ``(n, n)`` fp32 scratch per batch * head. A tiled GEMM reads the key means once per 64
   query blocks; recomputed inside the select kernel for every 16 query blocks they cost
   0.43 ms at H3 on an H200, as a separate kernel 0.13 ms. (With IEEE products the select kernel writes them instead.)
4. (top-k) :func:`.fused_kernels.kth_kernel`, one single-warp program per query-block row and
   batch * head: the k-th largest score of the row (bisection over order-preserving int32 keys,
   ties kept like ``cand >= theta``), stored for the next kernels. In a kernel of its own: at H3
   on an H200 0.08 ms, where inside the select kernel's 4 warps the search (probing the keys'
   midpoint only) took 0.2 ms.
5. :func:`.fused_kernels.select_kernel`, one program per (tile of query-block rows, batch * head),
   reading the scratch: the threshold (tau, stored for the next kernel) or the k-th largest
   score's key, the forced blocks, ``kv_num_blocks``, ``kv_indices`` (ascending, 0-padded) and
   ``touches_dead``.
6. :func:`.fused_kernels.pooled_kernel` (tail or coarse branch only), one program per (16
   query-block rows, batch * head): the tail and coarse terms by an online softmax over key-block
   chunks of the scratch, with the select kernel's stored thresholds deciding (through the same
   :func:`.fused_kernels.exact_blocks`) which blocks are pooled.

``kv_indices`` is ``(B, H, n, n)``: its width is fixed at n rather than the largest count, so
no count has to reach the host before it is allocated (ties at a top-k threshold can select
more than k blocks, so no smaller width is safe). Only consumers that read ``kv_num_blocks``
entries of each row and take the width from the tensor (the ``triton`` backend) ask for this
plan; see :func:`fused_plan_usable` for when it applies.

The kernels are ``JITFunction``\\ s launched through :func:`solattn.triton_runtime.jit.compiled`, so
the same source runs under ``TRITON_INTERPRET=1`` on the CPU (tests). Triton is imported only
when a fused plan is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import FrozenSet, NamedTuple, Optional

import torch

from ..budget import current_budget
from ..config import Tuning, current_tuning
from ..triton_runtime import cuda_capability, device_constant, interpret_on, interpretable, on_device, pow2, triton_runs_on
from ..validation import BLOCK, Problem, fail
from .plan import CallPlan
from .select import topk_count

#: rows of the (rows, n) score tile the top-k bisection keeps in registers at a time, times n:
#: 4 of H3's 1024-wide (padded) rows took 0.29-0.30 ms in the select kernel on an H200 against
#: 0.32-0.33 ms with 8 and 0.42 ms with 16 (three runs, commits b1a67c1, fd08fec, 35a8db0)
_SELECT_TILE_ELEMS = 4096

#: keys per thread of the top-k bisection in :func:`.fused_kernels.kth_kernel`, counted on rows
#: padded to a power of two (the kernel holds no more: NA + NB lanes), in one warp while they fit,
#: one row of H3's per program. At H3 on an
#: H200 the kernel took 0.079-0.083 ms so, against 0.083-0.088 ms with 2 rows, 0.11-0.12 with 4
#: (1 or 2 warps) and 0.10-0.11 ms with one row in 2 warps (commit 134c0ec)
_KTH_KEYS_PER_THREAD = 32

#: ``tl.dot`` precisions of the fp32 products (:attr:`FusedPlanTuning.dot_precision`)
DOT_PRECISIONS = ("ieee", "tf32", "tf32x3")

#: :class:`FusedPlanTuning`'s launch overrides (None: the launch chooses; see :func:`_fused_plan`)
_LAUNCH_FIELDS = ("means_warps", "centroid_bd", "block_i", "bj", "rb", "select_warps", "select_stages",
                  "kth_rb", "kth_warps", "scores_tile", "scores_warps", "scores_bk", "scores_stages",
                  "pool_bi", "pool_bj", "pool_warps", "pool_stages")


@dataclass(frozen=True)
class FusedPlanTuning(Tuning):
    """The fused plan's settings in force (:func:`solattn.config.tuning`).

    - ``dot_precision``: ``tl.dot`` precision of the fp32 products (scores, tail and coarse sums).
      None: "tf32x3" (three TF32 tensor-core passes with the operands split in high and low parts,
      about fp32 accuracy) on NVIDIA GPUs with TF32 (compute capability 8.0 and up), else "ieee"
      (fp32 FMA, exact products). On an H200 at H3 the fused plan took 0.85 ms with tf32x3 and
      2.7-3.1 ms with IEEE products, and both selections matched the torch plan's (0-3 and 0-1 rows
      of 32648 differ; plain "tf32": 561).
    - ``max_fused_blocks``: largest n (key blocks) the fused plan takes (8192: T = 524288 tokens);
      beyond it the torch plan chunks the work. The select kernel's bisection holds whole rows of
      n scores (padded to a power of two) in tiles of ``_SELECT_TILE_ELEMS`` scores, fewer rows as
      n grows, and at least one whole row: past 4096 blocks one row of up to 8192 scores. Run on an
      H200 up to n = 583 (H3, 1024-wide rows).
    - launch overrides, None for the measured choice: ``means_warps``, ``centroid_bd`` (head dims
      per centroid program), ``block_i`` (query-block rows per select program), ``bj`` (key blocks
      per column chunk), ``rb`` (rows per bisection tile), ``select_warps``, ``select_stages``,
      ``kth_rb``, ``kth_warps`` (rows per program and warps of the top-k bisection),
      ``scores_tile``, ``scores_warps``, ``scores_bk`` (head dims per step of the scores GEMM),
      ``scores_stages``, ``scores_here`` (the select kernel computes the scores instead of the
      scores kernel), and for the pooled-terms kernel ``pool_bi`` (query-block rows per program),
      ``pool_bj`` (key blocks per chunk), ``pool_warps``, ``pool_stages`` and ``pool_dot``
      (``tl.dot`` precision of the tail and coarse sums alone).
    """

    dot_precision: Optional[str] = None
    max_fused_blocks: int = 8192
    means_warps: Optional[int] = None
    centroid_bd: Optional[int] = None
    block_i: Optional[int] = None
    bj: Optional[int] = None
    rb: Optional[int] = None
    select_warps: Optional[int] = None
    select_stages: Optional[int] = None
    kth_rb: Optional[int] = None
    kth_warps: Optional[int] = None
    scores_tile: Optional[int] = None
    scores_warps: Optional[int] = None
    scores_bk: Optional[int] = None
    scores_stages: Optional[int] = None
    scores_here: Optional[bool] = None
    pool_bi: Optional[int] = None
    pool_bj: Optional[int] = None
    pool_warps: Optional[int] = None
    pool_stages: Optional[int] = None
    pool_dot: Optional[str] = None

    def __post_init__(self):
        for name in ("dot_precision", "pool_dot"):
            value = getattr(self, name)
            if value is not None and value not in DOT_PRECISIONS:
                fail("FusedPlanTuning", name, repr(value), f"None or one of {DOT_PRECISIONS}")
        for name in ("max_fused_blocks",) + _LAUNCH_FIELDS:
            value = getattr(self, name)
            if value is None and name != "max_fused_blocks":
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                fail("FusedPlanTuning", name, f"{value!r} of type {type(value).__name__}",
                     "None or an int >= 1", TypeError)
            if value < 1:
                fail("FusedPlanTuning", name, repr(value), "None or an int >= 1")
        if self.scores_here is not None and not isinstance(self.scores_here, bool):
            fail("FusedPlanTuning", "scores_here", repr(self.scores_here), "None, True or False", TypeError)

    def overrides(self) -> dict:
        """The launch overrides that are set, by name."""
        names = _LAUNCH_FIELDS + ("scores_here", "pool_dot")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


def dot_precision(device: torch.device) -> str:
    """The ``tl.dot`` precision the fused plan uses on ``device`` (see
    :attr:`FusedPlanTuning.dot_precision`)."""
    chosen = current_tuning(FusedPlanTuning).dot_precision
    if chosen is not None:
        return chosen
    # ROCm builds report AMD GPUs as "cuda" too; Triton's AMD backend has no tf32x3
    if device.type == "cuda" and torch.version.hip is None and cuda_capability(device)[0] >= 8:
        return "tf32x3"
    return "ieee"


def fused_plan_bytes(problem: Problem) -> int:
    """Device bytes the fused plan allocates beyond its fp32 means: ``kv_indices`` at width n
    and the fp32 scores scratch of the same size."""
    G, n = problem.B * problem.H, problem.n
    return G * n * n * 8


def fused_plan_usable(problem: Problem) -> bool:
    """Whether :func:`fused_plan` can build ``problem``'s plan: a CUDA device (or the CPU under
    ``TRITON_INTERPRET=1``, for tests), Triton importable, no autograd graph to record (the
    tail and coarse terms are differentiable on the torch path only), a power-of-two head dim
    in 16..256, at most :attr:`FusedPlanTuning.max_fused_blocks` blocks, the width-n ``kv_indices`` (plus
    the top-k scratch) within the ``sdpa`` memory budget.

    On an H200 the fused plan is the faster one at every size measured (bf16, D=128): at the seed
    shape (B=2, T=4056, H=16) its kernels take 0.05-0.07 ms of GPU time against the torch plan's
    1.0 ms of mostly launch-bound work, and at H3 (B=1, T=37296, H=56) 0.72 ms (top-k) and
    0.87 ms (tau with the tail) against 2.5-3.1 ms (``python benchmarks/run.py plan``; docs/kernel-notes.md)."""
    if problem.requires_grad or not triton_runs_on(problem.device):
        return False
    D = problem.D
    if D < 16 or D > 256 or D & (D - 1):
        return False
    return problem.n <= current_tuning(FusedPlanTuning).max_fused_blocks and fused_plan_bytes(problem) <= current_budget("sdpa")


class Rule(NamedTuple):
    """What the select and pooled-terms kernels select (see :func:`.fused_kernels.exact_blocks`):
    ``sel`` 0 tau, 1 top-k (the ``kk`` largest scores outside the sink key blocks, ties kept), 2
    forced blocks only; forced: sink key blocks ``[s0, s1)``, sink query blocks ``[q0, q1)`` and,
    with ``near``, ``|i - j| <= 1``. ``centre``: the scores are ``qm . (km - m)`` (sol_attn's, whose
    tau threshold needs them) rather than ``qm . km`` (VSA's ``S``: the same order per row, and a
    non-finite key tile then spoils its own column only, not every row through ``m``)."""
    sel: int
    kk: int
    s0: int
    s1: int
    q0: int
    q1: int
    near: bool
    centre: bool = True


def sol_attn_rule(problem: Problem) -> Rule:
    """``sol_attn``'s selection of ``problem`` (tau or top-k, sinks, neighbours)."""
    s0, s1 = problem.sink_blocks or (0, 0)
    q0, q1 = problem.sink_q or (0, 0)
    if problem.topk_ratio == 0.0:
        return Rule(0, 0, s0, s1, q0, q1, True)
    kk = topk_count(problem.topk_ratio, problem.n - (s1 - s0))
    return Rule(1 if kk > 0 else 2, kk, s0, s1, q0, q1, True)


def vsa_rule(P: int, exempt: bool, kk: int) -> Rule:
    """VSA's selection as a :class:`Rule`, from :func:`.vsa.vsa_competition`'s ``(P, exempt,
    kk)``: prefix query tiles attend every tile (sink query blocks), exempt prefix key tiles are
    kept whole (sink key blocks), the ``kk`` largest competing tiles; no neighbours, uncentred
    scores."""
    return Rule(1, kk, 0, P if exempt else 0, 0, P, False, False)


#: what a backend's forward kernel may ask the fused plan to make while its kernels read the same
#: data (``Backend.plan_extras``), kept by the plan until the backend takes it (:meth:`Plan.take`):
#: ``"tiled_kv"``, a problem with a row table's k and v as contiguous tiled copies, zeros in the
#: dead rows (the means kernel reads those rows anyway); ``"len_codes"``, each listed key block
#: with its dead rows, ``index | (64 - L) << 16`` (the select kernel knows both)
PLAN_EXTRAS = frozenset({"tiled_kv", "len_codes"})


def fused_plan(problem: Problem, rule: Optional[Rule] = None, extras: FrozenSet[str] = frozenset()) -> CallPlan:
    """``problem``'s :class:`CallPlan` from the Triton kernels (see the module docstring); the same
    selection, tail and coarse terms as :func:`solattn.routing.build_plan`'s torch path (with
    ``rule``, e.g. :func:`vsa_rule`: that selection instead of ``sol_attn``'s, as
    :func:`solattn.routing.build_vsa_plan` makes it), except that ``kv_indices`` is ``n`` wide.
    ``extras``: what else to make for the backend (:data:`PLAN_EXTRAS`). No host
    synchronisation; no autograd graph (callers check :func:`fused_plan_usable`)."""
    unknown = set(extras) - PLAN_EXTRAS
    if unknown:
        raise ValueError(f"fused_plan: argument 'extras' received {sorted(unknown)}; allowed: a subset of "
                         f"{sorted(PLAN_EXTRAS)}")
    with on_device(problem.device):
        return _fused_plan(problem, rule=rule, extras=extras)


def _stages(tuning: dict, key: str) -> dict:
    """The launch's ``num_stages`` when ``tuning`` sets ``key``, else Triton's default."""
    return {"num_stages": tuning[key]} if key in tuning else {}


def _fused_plan(problem: Problem, rule: Optional[Rule] = None, extras: FrozenSet[str] = frozenset()) -> CallPlan:
    """``rule``: the selection (default :func:`sol_attn_rule`); launch parameters: the measured
    choices below, or the overrides of the :class:`FusedPlanTuning` in force."""
    tuning = current_tuning(FusedPlanTuning).overrides()
    from ..triton_runtime.jit import compiled  # imports Triton
    from . import fused_kernels as fk

    q, k, v = problem.q, problem.k, problem.v
    B, T, H, D, n = problem.B, problem.T, problem.H, problem.D, problem.n
    G, dev, f32, i32 = B * H, q.device, torch.float32, torch.int32
    interpret = interpret_on(dev)
    q, k, v = interpretable(interpret, q, k, v)

    tail, coarse = problem.tail, problem.coarse_gate is not None
    need_v = tail or coarse
    means = torch.empty(3 if need_v else 2, G, n, D, dtype=f32, device=dev)
    qm, km = means[0], means[1]
    vm = means[2] if need_v else km   # not read without the tail and coarse terms
    L = torch.empty(n, dtype=i32, device=dev)
    has_len = problem.block_len is not None
    rows = problem.rows                 # a row table: the rows are read at its tokens
    tile_kv = rows is not None and "tiled_kv" in extras
    kt, vt = ((torch.empty((B, T, H, D), dtype=x.dtype, device=dev) for x in (k, v))     # as the kernel reads them
              if tile_kv else (qm, qm))
    compiled(interpret, fk.means_kernel)[(n, G)](
        q, k, v, problem.block_len if has_len else L, L if rows is None else rows, qm, km, vm, L, kt, vt,
        *q.stride(), *k.stride(), *v.stride(), T, H, n,
        HAS_BLOCK_LEN=has_len, NEED_V=need_v, HEAD_DIM=D, BLOCK=BLOCK, num_warps=tuning.get("means_warps", 2 if D <= 128 else 4),
        **({"ROWS": True} if rows is not None else {}), **({"TILE_KV": True} if tile_kv else {}))

    rule = rule or sol_attn_rule(problem)
    sel, kk, s0, s1, q0, q1, near, centre = rule
    tau_mode = sel == 0
    # the plan's tensors are made in their final (B, H, ...) shapes (the kernels index them flat)
    m = torch.empty(B, H, 1, D, dtype=f32, device=dev)
    var = torch.empty(G, D, dtype=f32, device=dev) if tau_mode else m
    bd = tuning.get("centroid_bd", min(D, 32))
    compiled(interpret, fk.centroid_kernel)[(G, D // bd)](
        km, m, var, n, NEED_VAR=tau_mode, HEAD_DIM=D, BD=bd, BJ=max(16, min(256, pow2(n), 8192 // bd)),
        num_warps=4)

    # launch parameters from sweeps on an H200 at D=128 (sweeps kept in git history;
    # docs/kernel-notes.md): with tf32x3 products, 16-row tiles in 4 warps ran the select kernel in
    # 0.68-0.77 ms at H3 (with the tail, which it then also computed) against 0.91-1.20 ms with 32
    # rows in 8 warps; with IEEE products (FMA, no tensor cores) 4 warps took 7.8 ms in tau mode
    # with the tail, so those keep 8 warps (2.3-2.5 ms) and the 32-row tiles that halve the reads
    # of the key means where programs are plentiful.
    # 2 warps per means program read q and k at 3.8 TB/s (D <= 128; wider rows keep 4 warps).
    precision = dot_precision(dev)
    ieee = precision == "ieee"
    block_i = tuning.get("block_i", 16 if not ieee or D > 128 or interpret or G * -(-n // 32) < 264 else 32)
    bj = tuning.get("bj", 64 if D <= 64 else 32)
    NP = pow2(n)
    # a row of n scores as two power-of-two pieces (kth_keys): the largest power of two <= n, then
    # the rest padded (at least 16 wide)
    NA = 1 << (n.bit_length() - 1)
    NB = 0 if n == NA else max(16, pow2(n - NA))
    rb = tuning.get("rb", max(1, min(block_i, _SELECT_TILE_ELEMS // NP)))
    # the top-k bisection's own kernel (kth_kernel): rows per program and warps, so that each
    # thread holds at most _KTH_KEYS_PER_THREAD keys, in one warp while whole rows allow it
    kth_rb = tuning.get("kth_rb", max(1, min(NP, _KTH_KEYS_PER_THREAD * 32 // NP)))
    kth_warps = tuning.get("kth_warps", max(1, min(8, kth_rb * NP // (_KTH_KEYS_PER_THREAD * 32))))
    c = problem.scale * math.log2(math.e)
    kv_num = torch.empty(B, H, n, dtype=i32, device=dev)
    kv_idx = torch.empty(B, H, n, n, dtype=i32, device=dev)
    touch = torch.empty(B, H, n, dtype=torch.int8, device=dev)
    # The scores of every (query block, key block) pair into an (n, n) fp32 scratch per batch *
    # head, read by the select and pooled-terms kernels: by a tiled GEMM, 64 x 64 tiles in 4 warps
    # (0.13 ms at H3, against 0.34 ms with 32 x 32 tiles, 0.22 ms with 8 warps, 0.21-0.25 ms with
    # key tiles looped over in one program, 045cf55), over 32 head dims per step (0.120 against
    # 0.130-0.131 ms in one step of 128; 16 or 64 per step, 2-4 stages, 128 x 128 tiles: no
    # better, commit 04dc0ec). With IEEE products (FMA, no tensor cores:
    # ROCm, or dot_precision="ieee") that GEMM took 5.3 ms at H3 against 2.3-2.5 ms for the
    # select kernel computing the scores itself in 32-row tiles, so there the select kernel
    # writes them (SCORES_HERE).
    scores_here = bool(tuning.get("scores_here", ieee))
    centroid = m if centre else _zeros(G, D, dev)        # what the scores subtract from km
    scratch = torch.empty(G, n, n, dtype=f32, device=dev)
    if not scores_here:
        bm = tuning.get("scores_tile", 64)
        compiled(interpret, fk.scores_kernel)[(-(-n // bm), -(-n // bm), G)](
            qm, km, centroid, scratch, n, c, HEAD_DIM=D, BM=bm, BN=bm, BK=min(D, tuning.get("scores_bk", 32)),
            DOT=precision, num_warps=tuning.get("scores_warps", 4), **_stages(tuning, "scores_stages"))
    theta = torch.empty(G, n, dtype=i32, device=dev) if sel == 1 else kv_num
    thr = torch.empty(G, n, dtype=f32, device=dev) if sel == 0 else m
    if sel == 1 and not scores_here:
        compiled(interpret, fk.kth_kernel)[(-(-n // kth_rb), G)](
            scratch, theta, n, kk, s0, s1, NA=NA, NB=NB, RB=kth_rb, num_warps=kth_warps)
    codes = torch.empty(B, H, n, n, dtype=i32, device=dev) if "len_codes" in extras else kv_idx
    compiled(interpret, fk.select_kernel)[(-(-n // block_i), G)](
        qm, km, centroid, var, L, scratch, theta, thr, kv_num, kv_idx, touch, codes,
        n, c, c * c, problem.tau, kk, s0, s1, q0, q1,
        SEL=sel, NEAR=near, HEAD_DIM=D, BLOCK_I=block_i, BJ=bj, NA=NA, NB=NB, RB=rb, BLOCK=BLOCK,
        DOT=precision, SCORES_HERE=scores_here,
        num_warps=tuning.get("select_warps", 8 if ieee and D >= 128 else 4),
        **_stages(tuning, "select_stages"), **({"CODES": True} if "len_codes" in extras else {}))
    tail_lse = torch.empty(B, H, n, dtype=f32, device=dev) if tail else m
    tail_value = torch.empty(B, H, n, D, dtype=f32, device=dev) if tail else m
    coarse_out = torch.empty(B, H, n, D, dtype=f32, device=dev) if coarse else m
    if tail or coarse:
        # 16 query-block rows per program, 16 key blocks per chunk, 4 warps: at H3 in tau mode
        # with the tail (H200) 0.23 ms, against 0.32-0.33 ms with 32 or
        # 64 blocks per chunk, 0.29-0.31 ms with 2 or 8 warps or 2 stages, 0.36-0.46 ms with 32
        # rows and 0.63-0.84 ms with 64 or 128 (tf32x3 products spill at 4 warps, 8 warps hold
        # one program per SM); the select kernel then takes 0.10 ms, where with the pooled
        # terms inside it took 0.68 ms
        bi = tuning.get("pool_bi", 16)
        compiled(interpret, fk.pooled_kernel)[(-(-n // bi), G)](
            vm, L, scratch, theta, thr, tail_lse, tail_value, coarse_out, n, s0, s1, q0, q1,
            SEL=sel, NEAR=near, HAS_TAIL=tail, HAS_COARSE=coarse, HEAD_DIM=D, BI=bi, BJ=tuning.get("pool_bj", 16),
            POOL_DOT=tuning.get("pool_dot", precision), num_warps=tuning.get("pool_warps", 8 if bi >= 64 else 4),
            **_stages(tuning, "pool_stages"))

    plan = CallPlan(kv_num_blocks=kv_num, kv_indices=kv_idx, block_len=L, key_mean=m,
                tail_lse=tail_lse if tail else None, tail_value=tail_value if tail else None,
                coarse=coarse_out if coarse else None, touches_dead=touch.view(torch.bool),
                seq_len=T)
    if tile_kv:
        plan.keep("tiled_kv", (kt, vt))
    if "len_codes" in extras:
        plan.keep("len_codes", codes)
    return plan


@device_constant
def _zeros(G: int, D: int, device: torch.device) -> torch.Tensor:
    """fp32 zeros ``(G, D)``: the centroid that VSA's uncentred scores subtract (the kernels only
    read it)."""
    return torch.zeros(G, D, dtype=torch.float32, device=device)
