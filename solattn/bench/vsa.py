"""``python -m solattn bench --shapes vsa``: ``video_sparse_attn`` beside dense SDPA and FastVideo's VSA op.

Each problem (:class:`~solattn.bench.parsing.VSAProblem`) is timed forward and, with
``--backward``, forward + backward, the contenders in interleaved rounds
(:func:`solattn.bench.timing.paired_rounds`: order rotated each round, a GPU's L2 flushed
before each timed call) after ``--warmup`` untimed calls, the last of which gives the memory
and the output (or gradients) for the error:

- ``dense``: ``F.scaled_dot_product_attention`` on ``(B, H, T, D)`` copies of the same tokens,
  the same problem without sparsity; its backward gives q, k and v their gradients.
- ``solattn``: ``solattn.video_sparse_attn`` on the raw ``(B, T, H, D)`` tokens (tiling into
  cubes and back included), the backend chosen as for any call; its backward gives q, k, v and
  the gate their gradients.
- ``fastvideo-sm90``, ``fastvideo-triton``: ``fastvideo_kernel.video_sparse_attn`` (when
  importable on a CUDA GPU, full cubes without a prefix only: its op has no prefix segments) on
  the same tokens tiled beforehand into its ``(B, H, 64 n, D)`` layout (its calling convention:
  a model tiles once per step), with its compiled sm_90 kernel and with its Triton kernel.

Inputs: per cube, a random offset shared by its 64 tokens plus per-token noise
(:func:`solattn.testing.make_qkv` in cube order, then put in raster order), so block means
separate and the selection does not hinge on rounding; the gate is uniform in [0, 0.5).

Errors: ``rel_l2`` against ``video_sparse_attn`` on fp32 copies through the portable backend
(the definition computed in fp32; the copies are exact, so the selection is the one the bf16
inputs give): the output for forward rows; for forward + backward rows, the largest of the
gradients' errors (q, k, v and the gate; q, k, v for dense, a different operator), computed on
the first :data:`GRAD_HEADS` heads (heads are independent in VSA), where the fp32 autograd fits.
FastVideo's output and gradients return to raw order before the comparison.
"""

from __future__ import annotations

import statistics
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from .. import untile, video_sparse_attn
from ..testing import make_qkv, rel_l2
from .memory import measure_peak
from .parsing import DENSE, DTYPE_NAMES, SOLATTN, Config, VSAProblem
from .peers import from_fastvideo, to_fastvideo, vsa_peer_calls
from .timing import log, paired_rounds, synchronize

#: heads on which the gradients' error basis is computed (fp32 autograd through the portable backend)
GRAD_HEADS = 4

COLUMNS = ["problem", "pass", "backend", "device", "dtype", "B", "T", "H", "D", "grid", "prefix", "topk",
           "cubes", "gate", "time_ms", "speedup", "peak_mib", "peak_basis", "rel_l2", "err_basis", "repeats"]


def vsa_inputs(p: VSAProblem, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """q, k, v ``(B, T, H, D)`` and the gate (None without one): the prefix's and the cubes' rows
    block-structured, the video part put in raster order."""
    n_prefix = -(-p.prefix // 64) * 64
    rows = n_prefix + p.cubes * 64
    tensors = []
    for x in make_qkv(p.B, rows, p.H, p.D, dtype=torch.float32, seed=seed):
        video = untile(x[:, n_prefix:], p.grid)
        tensors.append(torch.cat([x[:, :p.prefix], video], dim=1).to(dtype=dtype, device=device))
    gate = None
    if p.gate:
        g = torch.Generator().manual_seed(seed + 1)
        gate = (torch.rand(p.B, p.T, p.H, p.D, generator=g) * 0.5).to(dtype=dtype, device=device)
    return (*tensors, gate)


def _solattn(p: VSAProblem):
    def call(q, k, v, gate):
        return video_sparse_attn(q, k, v, p.grid, topk=p.topk, gate=gate, prefix_len=p.prefix)
    return call


def _basis(p: VSAProblem, q, k, v, gate, dout: Optional[torch.Tensor]):
    """The fp32 definition: the output, or (``dout`` given) the gradients on the first heads."""
    def fp32(x, heads=None):
        return None if x is None else (x[:, :, :heads] if heads else x).float()

    if dout is None:
        with torch.no_grad():
            return video_sparse_attn(fp32(q), fp32(k), fp32(v), p.grid, topk=p.topk, gate=fp32(gate),
                                     prefix_len=p.prefix, backend="sdpa")
    h = min(GRAD_HEADS, p.H)
    leaves = [None if x is None else fp32(x, h).requires_grad_(True) for x in (q, k, v, gate)]
    out = video_sparse_attn(*leaves[:3], p.grid, topk=p.topk, gate=leaves[3], prefix_len=p.prefix,
                            backend="sdpa")
    out.backward(fp32(dout, h))
    return [None if x is None else x.grad for x in leaves]


def _grad_error(grads, basis) -> float:
    """The largest relative error of the gradients present in both, on the basis's heads."""
    h = basis[0].shape[2]
    return max(rel_l2(g[:, :, :h], b) for g, b in zip(grads, basis) if g is not None and b is not None)


def _contenders(p: VSAProblem, cfg: Config, q: torch.Tensor, peers) -> Dict[str, Tuple[Callable, Callable, Callable]]:
    """``{name: (prepare, call, back)}``: ``prepare`` puts a raw ``(B, T, H, D)`` tensor in the
    layout the contender takes (untimed), ``call(q, k, v, gate)`` is the timed call on prepared
    tensors, ``back`` returns its output (or a gradient) to raw order."""
    calls: Dict[str, Tuple[Callable, Callable, Callable]] = {}
    if cfg.with_dense:
        calls[DENSE] = (lambda x: x.transpose(1, 2).contiguous(),
                        lambda q, k, v, g: F.scaled_dot_product_attention(q, k, v),
                        lambda y: y.transpose(1, 2))
    if SOLATTN in cfg.backends:
        calls[SOLATTN] = (lambda x: x, _solattn(p), lambda y: y)
    block_len = to_fastvideo(q, p.grid)[1] if peers else None
    for name, peer in peers.items():
        def call(tq, tk, tv, tg, peer=peer):
            return peer(tq, tk, tv, block_len, p.topk, tg)
        calls[name] = (lambda x: to_fastvideo(x, p.grid)[0], call, lambda y: from_fastvideo(y, p.grid))
    return calls


def _pass(p: VSAProblem, cfg: Config, inputs, calls, backward: bool, tag: str) -> List[dict]:
    """One pass (forward, or forward + backward) of every contender on one problem: rows."""
    q, k, v, gate = inputs
    dout = None
    if backward:
        g = torch.Generator().manual_seed(cfg.seed + 2)
        dout = torch.randn(q.shape, generator=g).to(dtype=q.dtype, device=q.device)
    log(f"error basis (fp32 portable backend{', gradients' if backward else ''}) {tag}")
    basis = _basis(p, q, k, v, gate, dout)
    synchronize(cfg.device)
    fns, measured = {}, {}
    for name, (prepare, call, back) in calls.items():
        gate_in = None if gate is None or name == DENSE else prepare(gate)
        args = [prepare(x) for x in (q, k, v)] + [gate_in]
        if backward:
            leaves = [None if x is None else x.detach().requires_grad_(True) for x in args]
            d = prepare(dout)

            def step(call=call, leaves=leaves, d=d):
                for x in leaves:
                    if x is not None:
                        x.grad = None
                call(*leaves).backward(d)
                return leaves[0].grad
            fn = step
        else:
            def fn(call=call, args=args):
                with torch.no_grad():
                    return call(*args)
        log(f"{name} {tag}: {cfg.warmup} warm-up (memory on the last)")
        try:
            for _ in range(cfg.warmup - 1):
                fn()
            out, peak, peak_basis = measure_peak(fn, cfg.device)
            if backward:
                grads = [None if x is None else back(x.grad) for x in leaves]
                err = _grad_error(grads, basis)
            else:
                err = rel_l2(back(out), basis)
        except Exception as exc:  # one failing contender must not lose the others' rows
            log(f"{name} failed at {tag}: {type(exc).__name__}: {exc}")
            cfg.skip(f"{name} failed: {type(exc).__name__}: {str(exc)[:300]}", tag)
            continue
        fns[name], measured[name] = fn, (err, peak, peak_basis)
        del out
    del basis
    log(f"{tag}: {cfg.repeats} timed rounds")
    times = paired_rounds(fns, cfg.device, cfg.repeats, warmup=0)
    rows = []
    base = dict(problem=p.label, device=cfg.device.type, dtype=DTYPE_NAMES[cfg.dtype], B=p.B, T=p.T, H=p.H,
                D=p.D, grid="x".join(map(str, p.grid)), prefix=p.prefix, topk=p.topk, cubes=p.cubes, gate=p.gate,
                repeats=cfg.repeats, **{"pass": "forward + backward" if backward else "forward"})
    dense_ms = statistics.median(times[DENSE]) if DENSE in times else None
    for name, (err, peak, peak_basis) in measured.items():
        # the two medians over the same rounds, as printed side by side
        speedup = dense_ms / statistics.median(times[name]) if dense_ms is not None else None
        what = "sdpa-fp32" + (f" gradients, {min(GRAD_HEADS, p.H)} heads" if backward else "")
        rows.append(dict(base, backend=name, time_ms=statistics.median(times[name]), speedup=speedup,
                         peak_mib=peak, peak_basis=peak_basis, rel_l2=err,
                         err_basis=what + (" (other op)" if name == DENSE else "")))
        log(f"  {name}: {rows[-1]['time_ms']:.2f} ms" + (f", {speedup:.2f}x dense" if speedup else "")
            + f", rel. L2 {err:.2e}")
    return rows


def run_vsa(cfg: Config) -> List[dict]:
    """Every VSA problem of ``cfg``: forward rows, then forward + backward rows with ``--backward``."""
    rows: List[dict] = []
    peers, missing = vsa_peer_calls(cfg.device, cfg.dtype) if cfg.peers else ({}, [])
    peers = {n: c for n, c in peers.items() if n in cfg.peers}
    for p in cfg.vsa:
        tag = f"{p.label} H={p.H} D={p.D} {DTYPE_NAMES[cfg.dtype]}"
        for why in missing:
            if why.split(":")[0] in cfg.peers:
                cfg.skip(why, p.label)
        mine = peers
        why = "its op has no prefix segments" if p.prefix else "" if p.gate else \
            "its op always adds the coarse branch (ungated without a gate)"
        if peers and why:
            mine = {}
            for name in peers:
                cfg.skip(f"{name}: {why}", p.label)
        log(f"{tag}: making inputs")
        inputs = vsa_inputs(p, cfg.dtype, cfg.device, cfg.seed)
        calls = _contenders(p, cfg, inputs[0], mine)
        rows += _pass(p, cfg, inputs, calls, False, tag)
        if cfg.backward:
            rows += _pass(p, cfg, inputs, calls, True, tag + " fwd+bwd")
        inputs = calls = None
    return rows


def _fmt(row: dict, key: str) -> str:
    value = row.get(key)
    if value is None:
        return "n/a"
    if key == "speedup":
        return f"{value:.2f}x"
    if key == "rel_l2":
        return f"{value:.2e}"
    if key == "peak_mib":
        return ("≥" if row["peak_basis"] == "rss>=" else "") + f"{value:.4g}"
    if key == "time_ms":
        return f"{value:.4g}" if value < 1000 else f"{value:.0f}"
    return str(value)


TABLE = [("problem (grid, kept cubes)", "problem"), ("pass", "pass"), ("backend", "backend"), ("T", "T"),
         ("time ms", "time_ms"), ("vs dense", "speedup"), ("peak MiB", "peak_mib"), ("rel. L2", "rel_l2"),
         ("error basis", "err_basis")]

LEGEND = [
    ("problem", "prefix tokens + the video grid t x h x w in 4x4x4 cubes, the video cubes each query cube "
                "keeps, and whether the coarse branch is gated; B=1, H and D in the environment lines"),
    ("backend", "dense = F.scaled_dot_product_attention without sparsity; solattn = "
                "solattn.video_sparse_attn on raw tokens (tiling included); fastvideo-sm90 / fastvideo-triton "
                "= fastvideo_kernel.video_sparse_attn on tokens tiled beforehand, its compiled sm_90 kernel / "
                "its Triton kernel (FASTVIDEO_VSA_TRITON=1)"),
    ("time ms", "median over the timed rounds (each round runs every contender once, order rotated)"),
    ("vs dense", "the dense row's time ms / this row's time ms (same problem and pass), both medians "
                 "over the same rounds"),
    ("peak MiB", "extra memory one call needed beyond what was held before it"),
    ("rel. L2", "||x - basis|| / ||basis||: the output (forward), the largest of the gradients' errors "
                "(forward + backward)"),
    ("error basis", "sdpa-fp32 = video_sparse_attn on fp32 copies through the portable backend (the "
                    "definition in fp32); gradients on the first heads; (other op) on dense rows"),
]


def markdown(rows: List[dict], cfg: Config, environment: Dict[str, str]) -> str:
    lines = ["# solattn bench: video_sparse_attn", ""]
    lines += [f"- {k}: {v}" for k, v in environment.items()]
    heads = sorted({(p.H, p.D) for p in cfg.vsa})
    lines += [f"- heads, head dim: {', '.join(f'H={h}, D={d}' for h, d in heads)}", "",
              "| " + " | ".join(h for h, _ in TABLE) + " |", "|" + "---|" * len(TABLE)]
    lines += ["| " + " | ".join(_fmt(r, key) for _, key in TABLE) + " |" for r in rows]
    lines += ["", "Columns:", ""] + [f"- `{key}`: {text}" for key, text in LEGEND] + [""]
    if cfg.skipped:
        lines += ["Not run:", ""] + [f"- {s}" for s in cfg.skipped_lines()] + [""]
    return "\n".join(lines) + "\n"


def text_table(rows: List[dict]) -> str:
    head = [h for h, _ in TABLE]
    body = [[_fmt(r, key) for _, key in TABLE] for r in rows]
    widths = [max([len(head[i])] + [len(b[i]) for b in body]) for i in range(len(head))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    return "\n".join(lines + ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body])


__all__ = ["run_vsa", "vsa_inputs", "markdown", "text_table", "COLUMNS", "GRAD_HEADS"]
