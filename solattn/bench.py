"""``python -m solattn bench``: time dense SDPA and every sol_attn backend that can run, side by side.

    python -m solattn bench                       # best device present, its default problems
    python -m solattn bench --quick               # tiny problems, a few seconds on a CPU (smoke test)
    python -m solattn bench --device cpu --shapes 1,8192,16,128 --ratios 0.1 0.2
    python -m solattn bench --shapes h3 seed --backends dense sdpa triton --out results/h200

What one row is
---------------
One backend on one problem ``(B, T, H, D, dtype, topk_ratio, tail, coarse_gate)``:

- ``time_ms``: median of ``--repeats`` timed calls after ``--warmup`` untimed ones, with the
  device synchronised around each call (CUDA: events; XPU/MPS: ``synchronize`` + ``perf_counter``;
  CPU: ``perf_counter``). The timed calls are interleaved: each round runs dense, then every
  backend, once, so a drift in machine load hits all of them alike. A sparse row is the whole
  ``sol_attn(..., backend=name)`` call, routing plan included; ``plan_ms`` is the median time of
  ``build_plan`` alone (part of ``time_ms``). The dense row is ``F.scaled_dot_product_attention``
  on contiguous ``(B, H, T, D)`` copies of the same inputs (no layout copy is timed): the same
  problem without sparsity, re-timed in every (ratio, tail) group beside the sparse rows.
- ``speedup``: median over rounds of (dense time / row time) within the same round.
- ``peak_mib``: memory the call needed beyond what was held before it (the output included),
  measured on the last warm-up call. CUDA / XPU: ``max_memory_allocated`` after
  ``reset_peak_memory_stats`` minus ``memory_allocated`` before (basis ``allocator``). CPU (Linux):
  the peak of the resident set size, sampled every ~1 ms from ``/proc/self/statm`` by a background
  thread, minus the RSS before the call (freed heap is first returned to the OS with glibc's
  ``malloc_trim``); raised to ``ru_maxrss - RSS before`` when the process's high-water mark grew
  during the call (then it is exact). Sampling can miss a short spike and pages the C allocator
  still holds are reused without growing the RSS, so the CPU figure is a lower bound (basis
  ``rss>=``, printed with ``≥``). Elsewhere ``n/a``: no number that was not measured.
- ``rel_l2``: ``||out - basis|| / ||basis||`` in float64. Basis ``reference``: the reference
  backend (SPEC.md literally, fp32) on the same inputs, when its memory guard lets it run this
  problem; else ``sdpa-fp32``: the portable backend run on fp32 copies of the inputs (the copies
  are exact, so the routing is identical). The dense row's error is against the same basis: dense
  attention is a different operator, so its figure is how much the sparsity changes the output,
  not an accuracy defect (``err_basis`` says ``... (other op)``).

The two-number model
--------------------
``N = B * T * H * D`` elements per tensor, ``e`` bytes per element, ``P`` = number of exact
(query block, key block) pairs = ``plan.kv_num_blocks.sum()``, ``K = P * 64 * D`` elements of
kept keys (and as many of values), ``n = ceil(T / 64)``.

FLOPs (two matmuls, 2 FLOPs per multiply-add; ragged last blocks counted as full; the tail's
one extra key per query block and the coarse branch, under 2 % at these sizes, not counted):

    dense  = 4 * B * H * T * T * D
    sparse = 4 * P * 64 * 64 * D

Bytes moved (a model of the traffic each path implies, not a measurement):

    dense    = e * 4N                       read q, k, v; write out
    sdpa     = e * (3N + 3N + 6K + 3N)      routing reads q, k, v once (block means);
                                            q rows: source read, gathered copy written, read back by SDPA;
                                            K and V of kept blocks: source read, gathered copy
                                            written, read back by SDPA (3 x 2K);
                                            out: SDPA writes it, the scatter reads it and writes out
    fused    = e * (3N + N + 2K + N)        any other backend (a block-index kernel, no gather):
                                            routing reads, q read, kept K/V read in place, out written

``K / N ~= kept_fraction * n``, so at long T the gather traffic (6K) dominates the portable
backend's bytes while the FLOPs shrink with the kept fraction: ``gflops`` (achieved GFLOP/s on
the counted FLOPs; the tables switch to TFLOP/s when a row reaches 1 TFLOP/s) and ``gbps``
(achieved GB/s on the modelled bytes), both over the whole call, routing plan included, say which
wall a row is closer to on the device at hand; subtract ``plan_ms`` for the backend alone.

Input data: ``x = 0.5 * randn + 2 * block_offset`` (``randn`` per token, ``block_offset`` ``randn``
per 64-token block and (b, h)), fixed seed. Block-level logits then spread with a standard deviation
of about 4 whatever D is, so attention concentrates on few key blocks as in the video models the
operator serves, routing is meaningful, and a 10-20 % selection keeps most of the attention mass.

Outputs in ``--out``: ``bench.csv``, ``bench.md`` (environment, models, table) and ``bench.png``
(time against T, log-log, one line per backend / ratio / tail; skipped without matplotlib).
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import os
import platform
import resource
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from . import dispatch
from .backends import reference as reference_module
from .ops import sol_attn
from .routing import build_plan
from .synthetic import block_structured_qkv
from .validation import BLOCK, validate

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
          "float16": torch.float16, "half": torch.float16, "fp32": torch.float32,
          "float32": torch.float32, "float": torch.float32}
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

Shape = Tuple[int, int, int, int]   # (B, T, H, D)

#: named problem sets (B, T, H, D)
PRESETS: Dict[str, List[Shape]] = {
    "cpu": [(1, 2048, 16, 128), (1, 4096, 16, 128), (1, 8192, 16, 128)],
    "h3": [(1, 37296, 56, 128)],
    "seed": [(2, 4056, 16, 128)],
    "sweep": [(1, t, 24, 128) for t in (4096, 8192, 16384, 32768)],
    "quick": [(1, 256, 2, 64), (1, 512, 2, 64)],
}
PRESETS["gpu"] = PRESETS["seed"] + PRESETS["sweep"] + PRESETS["h3"]

COLUMNS = ["backend", "device", "dtype", "B", "T", "H", "D", "ratio", "tail", "coarse_gate",
           "time_ms", "plan_ms", "speedup", "peak_mib", "peak_basis", "rel_l2", "err_basis",
           "kept_fraction", "gflop", "gb_moved", "gflops", "gbps", "repeats"]

DENSE = "dense"
_T0 = time.perf_counter()


def log(msg: str) -> None:
    """One progress line on stderr with the elapsed time, flushed."""
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- device helpers

def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu":
        torch.xpu.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def time_calls(fn: Callable[[], object], device: torch.device, repeats: int) -> List[float]:
    """Milliseconds of ``repeats`` calls of ``fn``, the device synchronised around each."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            synchronize(device)
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def _rss_bytes() -> Optional[int]:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _maxrss_bytes() -> int:
    scale = 1 if sys.platform == "darwin" else 1024   # Linux reports KiB, macOS bytes
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _release_freed_heap() -> None:
    """Hand memory freed by earlier calls back to the OS (glibc ``malloc_trim``), so that this
    call's allocations show up as RSS growth instead of silently reusing resident pages."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass   # not glibc: the figure stays a lower bound, as documented


class _RssSampler:
    """Peak RSS seen by a background thread polling ``/proc/self/statm`` every ~1 ms."""

    def __init__(self) -> None:
        self.peak = _rss_bytes() or 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = _rss_bytes()
            if rss is not None and rss > self.peak:
                self.peak = rss
            self._stop.wait(0.001)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        rss = _rss_bytes()
        if rss is not None and rss > self.peak:
            self.peak = rss


def measure_peak(fn: Callable[[], torch.Tensor], device: torch.device) -> Tuple[torch.Tensor, Optional[float], str]:
    """Run ``fn`` once; return its output, the extra memory it needed (MiB, or None) and the basis."""
    kind = device.type
    if kind in ("cuda", "xpu") and hasattr(getattr(torch, kind), "max_memory_allocated"):
        mod = getattr(torch, kind)
        synchronize(device)
        mod.reset_peak_memory_stats(device)
        before = mod.memory_allocated(device)
        out = fn()
        synchronize(device)
        return out, (mod.max_memory_allocated(device) - before) / 2**20, "allocator"
    if kind == "cpu" and _rss_bytes() is not None:
        _release_freed_heap()
        before, maxrss_before = _rss_bytes(), _maxrss_bytes()
        with _RssSampler() as sampler:
            out = fn()
        peak = sampler.peak
        maxrss_after = _maxrss_bytes()
        if maxrss_after > maxrss_before:     # the process high-water mark was set inside this call
            peak = max(peak, maxrss_after)
        return out, max(0, peak - before) / 2**20, "rss>="
    out = fn()
    synchronize(device)
    return out, None, "n/a"


# --------------------------------------------------------------------------- problems and models

def make_inputs(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int = 0,
                spread: float = 2.0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v ``(B, T, H, D)`` with block structure (``solattn.synthetic``); block logits
    ``scale * qm . km`` have a std of about ``spread ** 2``."""
    return block_structured_qkv(*shape, dtype=dtype, device=device, seed=seed, spread=spread)


def flop_count(shape: Shape, kept_pairs: Optional[int]) -> float:
    """Dense (``kept_pairs is None``) ``4 B H T^2 D``, sparse ``4 P 64^2 D`` (module docstring)."""
    B, T, H, D = shape
    if kept_pairs is None:
        return 4.0 * B * H * T * T * D
    return 4.0 * kept_pairs * BLOCK * BLOCK * D


def bytes_moved(shape: Shape, elt: int, kept_pairs: Optional[int], model: str) -> float:
    """Bytes moved under the model named ``model`` (``dense``, ``sdpa`` or ``fused``; docstring)."""
    B, T, H, D = shape
    N = float(B * T * H * D)
    if model == "dense":
        return elt * 4 * N
    K = float(kept_pairs) * BLOCK * D
    if model == "sdpa":
        return elt * (3 * N + 3 * N + 6 * K + 3 * N)
    return elt * (3 * N + N + 2 * K + N)


def rel_l2(out: torch.Tensor, basis: torch.Tensor) -> float:
    a, b = out.detach().double().cpu(), basis.detach().double().cpu()
    den = b.norm().item()
    return (a - b).norm().item() / (den if den > 0 else 1.0)


# --------------------------------------------------------------------------- arguments

def parse_shapes(tokens: Sequence[str]) -> List[Shape]:
    shapes: List[Shape] = []
    for tok in tokens:
        for part in tok.split():
            if part.lower() in PRESETS:
                shapes.extend(PRESETS[part.lower()])
                continue
            try:
                dims = tuple(int(x) for x in part.replace("x", ",").split(","))
            except ValueError:
                dims = ()
            if len(dims) != 4 or min(dims) < 1:
                raise argparse.ArgumentTypeError(
                    f"--shapes received {part!r}; allowed: B,T,H,D (four positive ints) or a preset "
                    f"({', '.join(sorted(PRESETS))})")
            shapes.append(dims)  # type: ignore[arg-type]
    seen, unique = set(), []
    for s in shapes:
        if s not in seen:
            seen.add(s)
            unique.append(s)
    return unique


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m solattn bench",
        description="Time dense SDPA and every sol_attn backend that can run, on problems scaled to "
                    "the device; print a table (time, speed-up over dense, peak memory, error, FLOP and "
                    "byte models) and write CSV, Markdown and a PNG plot of time against T.",
        epilog="Presets for --shapes: " + "; ".join(
            f"{k}: " + " ".join(",".join(map(str, s)) for s in v) for k, v in PRESETS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", help="torch device (default: best present, cuda > xpu > mps > cpu)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="input dtype (default bf16)")
    p.add_argument("--shapes", nargs="+", action="extend", metavar="B,T,H,D|PRESET",
                   help="problems: B,T,H,D tuples and/or presets (default: 'cpu' on a CPU, 'gpu' elsewhere)")
    p.add_argument("--ratios", nargs="+", type=float, metavar="R",
                   help="top-k ratios, 0 < R < 1 (default 0.1 0.2)")
    p.add_argument("--tail", action=argparse.BooleanOptionalAction, default=False,
                   help="--tail adds rows with the pooled tail on (rows with it off are always run)")
    p.add_argument("--coarse-gate", action="store_true", help="pass a random coarse_gate (VSA coarse branch)")
    p.add_argument("--backends", nargs="+", metavar="NAME",
                   help=f"restrict to these: '{DENSE}' and/or registered backend names "
                        "(the reference is never timed; it is the error basis)")
    p.add_argument("--repeats", type=int, help="timed calls per row, median reported "
                                                "(default 3 on a CPU, 20 elsewhere, 2 with --quick)")
    p.add_argument("--warmup", type=int, help="untimed calls first, >= 1; the last measures memory "
                                               "and gives the output for the error (default 1 on a CPU, 3 elsewhere)")
    p.add_argument("--out", help="output folder (default benchmarks/results/<device>-<date>-<time>)")
    p.add_argument("--quick", action="store_true",
                   help="tiny problems (preset 'quick', 2 repeats): a few seconds on a CPU, for CI")
    p.add_argument("--seed", type=int, default=0, help="input seed (default 0)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    return p


# --------------------------------------------------------------------------- the run

@dataclass
class Config:
    device: torch.device
    dtype: torch.dtype
    shapes: List[Shape]
    ratios: List[float]
    tails: List[bool]
    coarse: bool
    backends: List[str]           # timed sparse backends requested (may be filtered per problem)
    with_dense: bool
    repeats: int
    warmup: int
    out: str
    seed: int
    plot: bool
    #: "backend: why" -> the problems it was not run on
    skipped: Dict[str, List[str]] = field(default_factory=dict)

    def skip(self, what: str, tag: str) -> None:
        self.skipped.setdefault(what, []).append(tag)

    def skipped_lines(self) -> List[str]:
        return [f"{what} ({len(tags)} problem(s): {', '.join(tags) if len(tags) <= 3 else tags[0] + ', ...'})"
                for what, tags in self.skipped.items()]


def resolve(args: argparse.Namespace) -> Config:
    device = torch.device(args.device) if args.device else dispatch.best_device()
    on_cpu = device.type == "cpu"
    dtype = DTYPES[args.dtype]
    if args.shapes:
        shapes = parse_shapes(args.shapes)
    else:
        shapes = PRESETS["quick" if args.quick else ("cpu" if on_cpu else "gpu")]
    ratios = args.ratios or [0.1, 0.2]
    for r in ratios:
        if not 0.0 < r < 1.0:
            raise SystemExit(f"--ratios received {r}; allowed: 0 < r < 1")
    registered = [n for n in dispatch.registered() if n != "reference"]
    # the device's priority order first, then the rest
    order = [n for n in dispatch.priority(device.type) if n in registered]
    order += [n for n in registered if n not in order]
    with_dense = True
    if args.backends:
        wanted = [b.lower() for b in args.backends]
        unknown = [b for b in wanted if b != DENSE and b not in registered]
        if unknown:
            raise SystemExit(f"--backends received {unknown}; allowed: {DENSE}, " + ", ".join(registered)
                             + " (the reference is the error basis, never timed)")
        with_dense = DENSE in wanted
        order = [n for n in order if n in wanted]
    repeats = args.repeats if args.repeats is not None else (2 if args.quick else (3 if on_cpu else 20))
    warmup = args.warmup if args.warmup is not None else (1 if on_cpu or args.quick else 3)
    if repeats < 1 or warmup < 1:
        raise SystemExit("--repeats and --warmup must be >= 1")
    out = args.out or os.path.join(
        "benchmarks", "results", f"{device.type}-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}")
    return Config(device=device, dtype=dtype, shapes=shapes, ratios=ratios,
                  tails=[False, True] if args.tail else [False], coarse=args.coarse_gate,
                  backends=order, with_dense=with_dense, repeats=repeats, warmup=warmup, out=out,
                  seed=args.seed, plot=not args.no_plot)


def _prepare(fn: Callable[[], torch.Tensor], cfg: Config):
    """Warm-up calls; the last one measures memory and keeps its output (for the error)."""
    for _ in range(cfg.warmup - 1):
        fn()
    return measure_peak(fn, cfg.device)


def _shape_str(shape: Shape) -> str:
    return "x".join(map(str, shape))


def run(cfg: Config) -> List[dict]:
    """Every problem: warm-up and memory per contender, then ``repeats`` interleaved rounds.

    In each round every contender (dense first, then each backend) runs once, so a change in
    machine load during the run hits dense and sparse alike; ``speedup`` is the median over
    rounds of ``dense time / row time`` of the same round.
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

        for tail in cfg.tails:
            for ratio in cfg.ratios:
                tag = f"{_shape_str(shape)} {dname} r={ratio:g} tail={'on' if tail else 'off'}" \
                      + (" coarse" if cfg.coarse else "")
                problem = validate(q, k, v, topk_ratio=ratio, tail=tail, coarse_gate=gate)

                # the error basis first: the reference where it fits, else sdpa on fp32 copies
                ref_reasons = dispatch.get_backend("reference").not_supported_reasons(problem)
                if not ref_reasons:
                    log(f"reference (error basis) {tag}")
                    basis = sol_attn(q, k, v, topk_ratio=ratio, tail=tail, coarse_gate=gate,
                                     backend="reference")
                    basis_name = "reference"
                else:
                    log(f"sdpa on fp32 copies (error basis; reference: {ref_reasons[0]}) {tag}")
                    q32, k32, v32 = (x.float() for x in (q, k, v))
                    g32 = gate.float() if gate is not None else None
                    basis = sol_attn(q32, k32, v32, topk_ratio=ratio, tail=tail, coarse_gate=g32,
                                     backend="sdpa")
                    basis_name = "sdpa-fp32"
                    del q32, k32, v32, g32
                synchronize(dev)

                plan_times = time_calls(lambda: build_plan(problem), dev, max(1, min(cfg.repeats, 5)))
                plan = build_plan(problem)
                kept_pairs = int(plan.kv_num_blocks.sum().item())
                kept = plan.kept_fraction
                plan_ms = statistics.median(plan_times)
                del plan

                # contenders: name -> (fn, output of the memory call, peak, basis)
                contenders: Dict[str, tuple] = {}
                if dense_fn is not None:
                    contenders[DENSE] = (dense_fn, None, dense_peak, dense_peak_basis)
                for name in cfg.backends:
                    reasons = dispatch.get_backend(name).not_supported_reasons(problem)
                    if reasons:
                        log(f"{name} skipped at {tag}: {'; '.join(reasons)}")
                        cfg.skip(f"{name}: {'; '.join(reasons)}", tag)
                        continue
                    fn = lambda name=name: sol_attn(q, k, v, topk_ratio=ratio, tail=tail,  # noqa: E731
                                                    coarse_gate=gate, backend=name)
                    log(f"{name} {tag}: {cfg.warmup} warm-up (memory on the last)")
                    try:
                        out, peak, peak_basis = _prepare(fn, cfg)
                    except Exception as exc:  # one failing backend must not lose the others' rows
                        log(f"{name} failed at {tag}: {type(exc).__name__}: {exc}")
                        cfg.skip(f"{name} failed: {type(exc).__name__}: {exc}", tag)
                        continue
                    contenders[name] = (fn, rel_l2(out, basis), peak, peak_basis)
                    del out

                times: Dict[str, List[float]] = {name: [] for name in contenders}
                for rnd in range(cfg.repeats):
                    for name, (fn, *_rest) in contenders.items():
                        times[name].extend(time_calls(fn, dev, 1))
                    log(f"{tag} round {rnd + 1}/{cfg.repeats}: " + ", ".join(
                        f"{name} {times[name][-1]:.1f} ms" for name in contenders))

                base = dict(device=dev.type, dtype=dname, B=B, T=T, H=H, D=D, ratio=ratio, tail=tail,
                            coarse_gate=cfg.coarse, repeats=cfg.repeats)
                for name, (fn, err, peak, peak_basis) in contenders.items():
                    ms = statistics.median(times[name])
                    speedup = None
                    if DENSE in times:
                        speedup = statistics.median(d / t for d, t in zip(times[DENSE], times[name]))
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
                    rows.append(dict(base, backend=name, time_ms=ms, plan_ms=plan_ms, speedup=speedup,
                                     peak_mib=peak, peak_basis=peak_basis, rel_l2=err, err_basis=basis_name,
                                     kept_fraction=kept, gflop=fl / 1e9, gb_moved=by / 1e9,
                                     gflops=fl / ms / 1e6, gbps=by / ms / 1e6))
                    sp = f", {speedup:.2f}x dense" if speedup is not None else ""
                    log(f"  {name}: {ms:.2f} ms{sp}, rel. L2 {err:.2e} vs {basis_name}, kept {kept:.3f}")
                del basis, contenders
        del q, k, v, gate, dense_out, dense_fn, qd, kd, vd
    return rows


# --------------------------------------------------------------------------- output

def _fmt(col: str, value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        if col in ("rel_l2",):
            return f"{value:.2e}"
        if col in ("ratio", "kept_fraction"):
            return f"{value:.3g}"
        if col == "speedup":
            return f"{value:.2f}x"
        if col in ("gflop", "gb_moved"):
            return f"{value:.3g}"
        if col in ("time_ms", "plan_ms", "peak_mib", "gflops", "gbps"):
            return f"{value:.4g}" if value < 1000 else f"{value:.0f}"
        return f"{value:.4g}"
    return str(value)


TABLE = [("backend", "backend"), ("shape BxTxHxD", None), ("ratio", "ratio"), ("tail", "tail"),
         ("time ms", "time_ms"), ("plan ms", "plan_ms"), ("vs dense", "speedup"),
         ("peak MiB", "peak_mib"), ("rel. L2", "rel_l2"), ("error basis", "err_basis"),
         ("kept", "kept_fraction"), ("GFLOP", "gflop"), ("GB moved", "gb_moved"),
         ("GFLOP/s", "gflops"), ("GB/s", "gbps")]


def _tera(rows: List[dict]) -> bool:
    """Show FLOP/s in TFLOP/s when some row reaches 1 TFLOP/s (GPUs), else GFLOP/s."""
    return any((r.get("gflops") or 0) >= 1000 for r in rows)


def table_head(rows: List[dict]) -> List[str]:
    return [("TFLOP/s" if key == "gflops" and _tera(rows) else h) for h, key in TABLE]


def table_cells(row: dict, tera: bool = False) -> List[str]:
    cells = []
    for _, key in TABLE:
        if key is None:
            cells.append(f"{row['B']}x{row['T']}x{row['H']}x{row['D']}")
        elif key == "peak_mib" and row["peak_mib"] is not None:
            cells.append(("≥" if row["peak_basis"] == "rss>=" else "") + _fmt(key, row[key]))
        elif key == "gflops" and tera and row[key] is not None:
            cells.append(f"{row[key] / 1000:.4g}")
        else:
            cells.append(_fmt(key, row[key]))
    return cells


def text_table(rows: List[dict]) -> str:
    head = table_head(rows)
    body = [table_cells(r, _tera(rows)) for r in rows]
    widths = [max(len(head[i]), *(len(b[i]) for b in body)) if body else len(head[i]) for i in range(len(head))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def markdown_table(rows: List[dict]) -> str:
    head = table_head(rows)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(table_cells(r, _tera(rows))) + " |" for r in rows]
    return "\n".join(lines)


def write_csv(rows: List[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({c: ("" if r.get(c) is None else r.get(c)) for c in COLUMNS})


def environment(cfg: Config) -> Dict[str, str]:
    dev = cfg.device
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
    elif dev.type == "xpu":
        name = torch.xpu.get_device_name(dev)
    else:
        name = platform.processor() or platform.machine()
    env = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "device": f"{dev} ({name})",
           "torch": torch.__version__, "python": platform.python_version(),
           "cpu threads (torch)": str(torch.get_num_threads()), "cpu cores": str(os.cpu_count()),
           "dtype": DTYPE_NAMES[cfg.dtype], "repeats": f"{cfg.warmup} warm-up + {cfg.repeats} timed (median)"}
    env["solattn"] = _git_describe()
    try:
        env["load average (1, 5, 15 min) at the end"] = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        pass
    return env


def _git_describe() -> str:
    """The solattn source commit (and whether the tree differs from it), when run from a checkout."""
    import subprocess
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            raise OSError(head.stderr)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", here], cwd=here, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        from . import __version__
        return f"{__version__} (not a git checkout)"
    return f"git {head.stdout.strip()}" + (" + uncommitted changes under solattn/" if dirty else "")


def write_markdown(rows: List[dict], cfg: Config, path: str, plot_note: str) -> None:
    doc = __doc__ or ""
    model = doc[doc.index("The two-number model"):doc.index("Input data:")].strip() \
        if "The two-number model" in doc else ""
    lines = ["# solattn bench", ""]
    lines += [f"- {k}: {v}" for k, v in environment(cfg).items()]
    lines += ["", markdown_table(rows), ""]
    lines += ["Columns: time is the median per call (sparse rows: the whole `sol_attn` call, routing "
              "plan included; `plan ms` is that part alone); timed calls are interleaved in rounds (dense, "
              "then each backend). `vs dense` = median over rounds of dense time / row time. "
              "Peak MiB: extra memory of one call beyond what was held before it, output included "
              "(`≥`: CPU resident-set sampling, a lower bound). rel. L2 against the basis named; the "
              "dense row's error is against the sparse operator, i.e. what the sparsity changes.", ""]
    if cfg.skipped:
        lines += ["Not run:", ""] + [f"- {s}" for s in cfg.skipped_lines()] + [""]
    if plot_note:
        lines += [plot_note, ""]
    lines += ["## " + model.replace("--------------------\n", "\n")] if model else []
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def write_plot(rows: List[dict], path: str, cfg: Config) -> str:
    """Time against T, log-log, one line per (backend, ratio, tail[, B/H/D]); returns a note."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)."
    groups = sorted({(r["B"], r["H"], r["D"]) for r in rows})
    lines: Dict[str, Dict[int, float]] = {}
    for r in rows:
        label = "dense SDPA" if r["backend"] == DENSE else \
            f"{r['backend']} r={r['ratio']:g}" + (" tail" if r["tail"] else "")
        if len(groups) > 1:
            label += f" (B={r['B']},H={r['H']},D={r['D']})"
        lines.setdefault(label, {})[r["T"]] = r["time_ms"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, pts in sorted(lines.items()):
        ts = sorted(pts)
        ax.plot(ts, [pts[t] for t in ts], marker="o", linestyle="--" if label.startswith("dense") else "-",
                label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("T (tokens)")
    ax.set_ylabel("time per call (ms, median)")
    ax.set_title(f"solattn bench: {cfg.device.type}, {DTYPE_NAMES[cfg.dtype]}, top-k"
                 + (", coarse gate" if cfg.coarse else ""))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return ""


def main(argv: Optional[Sequence[str]] = None) -> int:
    global _T0
    _T0 = time.perf_counter()
    args = build_parser().parse_args(argv)
    cfg = resolve(args)
    log(f"device {cfg.device}, dtype {DTYPE_NAMES[cfg.dtype]}, shapes "
        + " ".join(_shape_str(s) for s in cfg.shapes) + f", ratios {cfg.ratios}, tail "
        + ("off+on" if len(cfg.tails) > 1 else "off") + ", backends "
        + ", ".join(([DENSE] if cfg.with_dense else []) + cfg.backends)
        + f", reference budget {reference_module.budget.bytes / 2**30:.1f} GiB")
    if not cfg.with_dense and not cfg.backends:
        log("nothing to time")
        return 2
    rows = run(cfg)
    os.makedirs(cfg.out, exist_ok=True)
    csv_path = os.path.join(cfg.out, "bench.csv")
    md_path = os.path.join(cfg.out, "bench.md")
    png_path = os.path.join(cfg.out, "bench.png")
    write_csv(rows, csv_path)
    note = write_plot(rows, png_path, cfg) if cfg.plot and rows else ("no plot (--no-plot)" if rows else "")
    if note:
        log(note)
    write_markdown(rows, cfg, md_path, note)
    print(text_table(rows))
    for s in cfg.skipped_lines():
        print(f"not run: {s}")
    print(f"\nwrote {csv_path}, {md_path}" + ("" if note else f", {png_path}"))
    return 0 if rows else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
