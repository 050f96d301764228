"""The runner: inputs, the error basis, warm-up and memory per contender, then interleaved timed rounds."""

from __future__ import annotations

import statistics
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F

from .. import dispatch
from ..graphs import GraphCache, cuda_graphs
from ..op import sol_attn
from ..op.route import plan_for
from ..routing import build_plan
from ..routing.fused import fused_plan_usable
from ..testing import block_structured_qkv, rel_l2
from ..validation import validate
from .memory import measure_peak
from .models import Shape, bytes_moved, flop_count
from .parsing import DENSE, DTYPE_NAMES, Config
from .peers import peer_calls
from .timing import log, round_order, synchronize, time_calls


def make_inputs(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int = 0,
                spread: float = 2.0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v ``(B, T, H, D)`` with block structure (``solattn.testing``); block logits
    ``scale * qm . km`` have a std of about ``spread ** 2``."""
    return block_structured_qkv(*shape, dtype=dtype, device=device, seed=seed, spread=spread)


def _prepare(fn: Callable[[], torch.Tensor], cfg: Config):
    """Warm-up calls; the last one measures memory and keeps its output (for the error)."""
    for _ in range(cfg.warmup - 1):
        fn()
    return measure_peak(fn, cfg.device)


def graphed(call: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``call`` made inside its own :func:`solattn.graphs.cuda_graphs` scope: the first call
    captures (after a warm-up run), later calls replay; under no_grad, as every timed call is."""
    cache = GraphCache(max_graphs=1, capture_after=1)

    def run():
        with torch.no_grad(), cuda_graphs(cache=cache):
            return call()
    return run


def _shape_str(shape: Shape) -> str:
    return "x".join(map(str, shape))


def run(cfg: Config) -> List[dict]:
    """Every problem: warm-up and memory per contender, then ``repeats`` interleaved rounds.

    In each round every contender (dense first, then each backend) runs once, so a change in
    machine load during the run hits dense and sparse alike; ``speedup`` is dense's median time
    over those rounds divided by the row's median time over the same rounds.
    """
    rows: List[dict] = []
    dev, dt = cfg.device, cfg.dtype
    dname = DTYPE_NAMES[dt]
    elt = torch.finfo(dt).bits // 8
    for shape in cfg.shapes:
        B, T, H, D = shape
        log(f"{_shape_str(shape)} {dname} on {dev}: making inputs")
        q, k, v = make_inputs(shape, dt, dev, cfg.seed)
        gate = None
        if cfg.coarse:
            g = torch.Generator().manual_seed(cfg.seed + 1)
            gate = (torch.randn(B, T, H, D, generator=g) * 0.1).to(dtype=dt, device=dev)

        dense_fn = dense_out = qd = kd = vd = None
        dense_peak, dense_peak_basis = None, "n/a"
        if cfg.with_dense:
            qd, kd, vd = (x.transpose(1, 2).contiguous() for x in (q, k, v))
            dense_fn = lambda: F.scaled_dot_product_attention(qd, kd, vd)  # noqa: E731
            log(f"dense SDPA {_shape_str(shape)} {dname}: {cfg.warmup} warm-up (memory on the last)")
            o, dense_peak, dense_peak_basis = _prepare(dense_fn, cfg)
            dense_out = o.transpose(1, 2)

        peers, missing = peer_calls(dev, dt, D) if cfg.peers else ({}, [])
        for why in missing:
            if why.split(":")[0] in cfg.peers:
                cfg.skip(why, _shape_str(shape))
        tau = cfg.tau
        for tail in cfg.tails:
            for ratio in cfg.ratios:
                mode = f"r={ratio:g}" if ratio else f"tau={tau:g}"
                tag = f"{_shape_str(shape)} {dname} {mode} tail={'on' if tail else 'off'}" \
                      + (" coarse" if cfg.coarse else "")
                problem = validate(q, k, v, tau=tau, topk_ratio=ratio, tail=tail, coarse_gate=gate)

                # the error basis first: the reference where it fits, else sdpa on fp32 copies
                ref_reasons = dispatch.get_backend("reference").not_supported_reasons(problem)
                if not ref_reasons:
                    log(f"reference (error basis) {tag}")
                    basis = sol_attn(q, k, v, tau=tau, topk_ratio=ratio, tail=tail, coarse_gate=gate,
                                     backend="reference")
                    basis_name = "reference"
                else:
                    log(f"sdpa on fp32 copies (error basis; reference: {ref_reasons[0]}) {tag}")
                    q32, k32, v32 = (x.float() for x in (q, k, v))
                    g32 = gate.float() if gate is not None else None
                    basis = sol_attn(q32, k32, v32, tau=tau, topk_ratio=ratio, tail=tail, coarse_gate=g32,
                                     backend="sdpa")
                    basis_name = "sdpa-fp32"
                    del q32, k32, v32, g32
                synchronize(dev)

                plan = build_plan(problem)
                kept_pairs = int(plan.kv_num_blocks.sum().item())
                kept = plan.kept_fraction
                del plan
                plan_ms = {}   # the plan each backend runs from (the fused one where it applies)
                for name in cfg.backends:
                    backend = dispatch.get_backend(name)
                    if backend.uses_plan and not backend.not_supported_reasons(problem):
                        # one untimed call first, as for every contender: the first pays one-off
                        # costs (the fused plan's kernels compile), which a median of 1-2 calls keeps
                        plan_ms[name] = statistics.median(time_calls(
                            lambda: plan_for(backend, problem), dev, max(1, min(cfg.repeats, 5)), warmup=1))

                # contenders: name -> (fn, output of the memory call, peak, basis)
                contenders: Dict[str, tuple] = {}
                if dense_fn is not None:
                    contenders[DENSE] = (dense_fn, None, dense_peak, dense_peak_basis)
                calls = {name: (lambda name=name: sol_attn(q, k, v, tau=tau, topk_ratio=ratio, tail=tail,
                                                           coarse_gate=gate, backend=name))
                         for name in cfg.backends}
                for name in cfg.backends:
                    reasons = dispatch.get_backend(name).not_supported_reasons(problem)
                    if reasons:
                        what = f"{name}: {'; '.join(reasons)}"
                        if what not in cfg.skipped:   # said once; the summary lists the problems
                            log(f"{name} skipped at {tag} (and wherever the same holds): {'; '.join(reasons)}")
                        cfg.skip(what, tag)
                        del calls[name]
                if cfg.graphs and fused_plan_usable(problem):
                    # a call is capturable when its plan is the fused one (no host syncs)
                    for name in [n for n in calls if getattr(dispatch.get_backend(n), "fused_plan", False)]:
                        calls[f"{name}+graphs"] = graphed(calls[name])
                for name, peer in peers.items():
                    calls[name] = lambda peer=peer: peer(q, k, v, tau, ratio, tail, gate)
                for name, fn in calls.items():
                    log(f"{name} {tag}: {cfg.warmup} warm-up (memory on the last)")
                    try:
                        out, peak, peak_basis = _prepare(fn, cfg)
                    except Exception as exc:  # one failing contender must not lose the others' rows
                        log(f"{name} failed at {tag}: {type(exc).__name__}: {exc}")
                        cfg.skip(f"{name} failed: {type(exc).__name__}: {exc}", tag)
                        continue
                    contenders[name] = (fn, rel_l2(out, basis), peak, peak_basis)
                    del out

                times: Dict[str, List[float]] = {name: [] for name in contenders}
                for rnd in range(cfg.repeats):
                    for name in round_order(list(contenders), rnd):
                        times[name].extend(time_calls(contenders[name][0], dev, 1))
                    log(f"{tag} round {rnd + 1}/{cfg.repeats}: " + ", ".join(
                        f"{name} {times[name][-1]:.1f} ms" for name in contenders))

                base = dict(device=dev.type, dtype=dname, B=B, T=T, H=H, D=D, ratio=ratio,
                            tau=None if ratio else tau, tail=tail,
                            coarse_gate=cfg.coarse, repeats=cfg.repeats)
                dense_ms = statistics.median(times[DENSE]) if DENSE in times else None
                for name, (fn, err, peak, peak_basis) in contenders.items():
                    ms = statistics.median(times[name])
                    # the two medians of the same rounds, as printed side by side
                    speedup = dense_ms / ms if dense_ms is not None else None
                    if name == DENSE:
                        fl, by = flop_count(shape, None), bytes_moved(shape, elt, None, "dense")
                        rows.append(dict(base, backend=DENSE, time_ms=ms, plan_ms=None, speedup=speedup,
                                         peak_mib=peak, peak_basis=peak_basis,
                                         rel_l2=rel_l2(dense_out, basis), err_basis=f"{basis_name} (other op)",
                                         kept_fraction=1.0, gflop=fl / 1e9, gb_moved=by / 1e9,
                                         gflops=fl / ms / 1e6, gbps=by / ms / 1e6))
                        continue
                    fl = flop_count(shape, kept_pairs)
                    by = bytes_moved(shape, elt, kept_pairs, "sdpa" if name == "sdpa" else "fused")
                    rows.append(dict(base, backend=name, time_ms=ms, speedup=speedup,
                                     plan_ms=plan_ms.get(name),
                                     peak_mib=peak, peak_basis=peak_basis, rel_l2=err, err_basis=basis_name,
                                     kept_fraction=kept, gflop=fl / 1e9, gb_moved=by / 1e9,
                                     gflops=fl / ms / 1e6, gbps=by / ms / 1e6))
                    sp = f", {speedup:.2f}x dense" if speedup is not None else ""
                    log(f"  {name}: {ms:.2f} ms{sp}, rel. L2 {err:.2e} vs {basis_name}, kept {kept:.3f}")
                del basis, contenders
        # release this shape's tensors before the next shape's are made (rebound, not deleted:
        # the calls built above close over these names)
        q = k = v = gate = dense_out = dense_fn = qd = kd = vd = None
    return rows
