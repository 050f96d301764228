"""Command line of ``python -m solattn bench``: options, presets and the resolved :class:`Config`."""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, NoReturn, Optional, Sequence, Tuple

import torch

from .. import devices, dispatch
from .models import Shape
from .peers import PEERS, VSA_PEERS

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
          "float16": torch.float16, "half": torch.float16, "fp32": torch.float32,
          "float32": torch.float32, "float": torch.float32}
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

#: named problem sets (B, T, H, D)
PRESETS: Dict[str, List[Shape]] = {
    "cpu": [(1, 2048, 16, 128), (1, 4096, 16, 128), (1, 8192, 16, 128)],
    "h3": [(1, 37296, 56, 128)],
    "seed": [(2, 4056, 16, 128)],
    "sweep": [(1, t, 24, 128) for t in (4096, 8192, 16384, 32768)],
    "quick": [(1, 256, 2, 64), (1, 512, 2, 64)],
    # the shapes of the comparison with dense SDPA and comfy-kitchen's kernel (README)
    "peers": [(1, 37296, 56, 128), (1, 16384, 24, 128), (2, 4056, 16, 128)],
}
PRESETS["gpu"] = PRESETS["seed"] + PRESETS["sweep"] + PRESETS["h3"]

#: the name of the dense SDPA row
DENSE = "dense"
#: the backend ``--quick`` leaves out unless ``--backends`` names it (it compiles each new shape)
QUICK_LEAVES_OUT = "flex"


class VSAProblem(NamedTuple):
    """One ``video_sparse_attn`` problem: ``prefix`` tokens then a ``grid`` of 4x4x4 cubes, ``topk``
    video cubes kept per query cube, with or without the coarse branch's gate."""

    B: int
    H: int
    D: int
    grid: Tuple[int, int, int]
    topk: int
    prefix: int = 0
    gate: bool = True

    @property
    def cubes(self) -> int:
        return math.prod(-(-g // 4) for g in self.grid)

    @property
    def T(self) -> int:
        return self.prefix + math.prod(self.grid)

    @property
    def label(self) -> str:
        grid = "x".join(map(str, self.grid))
        return (f"{self.prefix} + " if self.prefix else "") + f"{grid}, {self.topk} of {self.cubes}" \
            + (", gate" if self.gate else "")


#: named sets of video_sparse_attn problems (``--shapes vsa``): the VSA model's head count and
#: head dim, full cubes, top-k 10 % / 20 % of the cubes; with a 432-token prefix, H3's layout
VSA_PRESETS: Dict[str, List[VSAProblem]] = {
    "vsa": [VSAProblem(1, 56, 128, (16, 48, 48), 58), VSAProblem(1, 56, 128, (16, 48, 48), 116),
            VSAProblem(1, 56, 128, (8, 32, 32), 13), VSAProblem(1, 56, 128, (16, 48, 48), 58, prefix=432),
            VSAProblem(1, 56, 128, (16, 48, 48), 58, prefix=432, gate=False)],
    "vsa-quick": [VSAProblem(1, 2, 32, (4, 8, 16), 2), VSAProblem(1, 2, 32, (4, 8, 16), 2, prefix=70)],
}


class UsageError(ValueError):
    """A bad command-line value; the message names the option, the value and what is allowed."""


class ArgParser(argparse.ArgumentParser):
    """argparse with a one-line error: ``PROG: error: MESSAGE (PROG --help lists the options)``,
    exit status 2, no usage block and never a traceback."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


def parse_device(text: str, option: str = "--device") -> torch.device:
    """A device name -> ``torch.device``, refused with :class:`UsageError` unless it is present here."""
    present = devices.present_devices()
    allowed = f"a device present here: {', '.join(present)}"
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise UsageError(f"{option} received {text!r}, which is not a torch device name; "
                         f"allowed: {allowed}") from None
    if device.type == "cpu" and device.index == 0:
        device = torch.device("cpu")          # the one CPU device: tensors made on "cpu:0" say "cpu"
    name = str(device)
    if name in present or (device.index is None and any(d.split(":")[0] == device.type for d in present)) \
            or (not devices.entry(device.type).indexed and device.type in present and device.index in (None, 0)):
        return device
    if device.type == "cuda" and not torch.cuda.is_available():
        why = (f"this torch ({torch.__version__}) was built without CUDA" if torch.version.cuda is None
               and getattr(torch.version, "hip", None) is None else "no CUDA device is visible")
    elif any(d.split(":")[0] == device.type for d in present):
        why = f"there is no {name}"
    else:
        why = f"{device.type} is not available here"
    raise UsageError(f"{option} received {text!r}: {why}; allowed: {allowed}")


def device_arg(text: str) -> torch.device:
    """``type=`` for an argparse ``--device`` option: the full message reaches the user."""
    try:
        return parse_device(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("--device ", "", 1)) from None


def parse_shapes(tokens: Sequence[str]) -> List[Shape]:
    """``B,T,H,D`` tuples (``x`` also separates) and preset names -> unique shapes, in order."""
    shapes: List[Shape] = []
    for tok in tokens:
        for part in tok.split():
            if part.lower() in VSA_PRESETS:
                raise UsageError(f"--shapes received {part!r} (video_sparse_attn problems) with other shapes; "
                                 f"allowed: VSA presets ({', '.join(VSA_PRESETS)}) alone, or B,T,H,D shapes")
            if part.lower() in PRESETS:
                shapes.extend(PRESETS[part.lower()])
                continue
            try:
                dims = tuple(int(x) for x in part.replace("x", ",").split(","))
            except ValueError:
                dims = ()
            if len(dims) != 4 or min(dims) < 1:
                raise UsageError(
                    f"--shapes received {part!r}; allowed: B,T,H,D (four positive ints) or a preset "
                    f"({', '.join(sorted(PRESETS))})")
            shapes.append(dims)  # type: ignore[arg-type]
    return list(dict.fromkeys(shapes))


def build_parser() -> argparse.ArgumentParser:
    p = ArgParser(
        prog="python -m solattn bench",
        description="Time dense SDPA and every sol_attn backend that can run, on problems scaled to "
                    "the device; print a table (time, speed-up over dense, peak memory, error, FLOP and "
                    "byte models) and write CSV, Markdown and a PNG plot of time against T.",
        epilog="Presets for --shapes: " + "; ".join(
            f"{k}: " + " ".join(",".join(map(str, s)) for s in v) for k, v in PRESETS.items())
            + ". video_sparse_attn presets (B=1, H, D, grid[, prefix], kept cubes): " + "; ".join(
            f"{k}: H={v[0].H}, D={v[0].D}, " + ", ".join(p.label for p in v) for k, v in VSA_PRESETS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", type=device_arg, help="torch device (default: best present, cuda > xpu > mps > cpu)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="input dtype (default bf16)")
    p.add_argument("--shapes", nargs="+", action="extend", metavar="B,T,H,D|PRESET",
                   help="problems: B,T,H,D tuples and/or presets (default: 'cpu' on a CPU, 'gpu' elsewhere)")
    p.add_argument("--ratios", nargs="+", type=float, metavar="R",
                   help="top-k ratios, 0 < R < 1, or 0 for tau mode (default 0.1 0.2)")
    p.add_argument("--tau", type=float, default=1.0,
                   help="routing threshold of the tau-mode rows (--ratios 0), in sigmas (default 1)")
    p.add_argument("--tail", action=argparse.BooleanOptionalAction, default=False,
                   help="--tail adds rows with the pooled tail on (rows with it off are always run)")
    p.add_argument("--backward", action="store_true",
                   help="video_sparse_attn presets: add forward + backward rows (gradients of q, k, v, gate)")
    p.add_argument("--coarse-gate", action="store_true", help="pass a random coarse_gate (VSA coarse branch)")
    p.add_argument("--backends", nargs="+", metavar="NAME",
                   help=f"restrict to these: '{DENSE}', registered backend names and/or "
                        f"{', '.join(PEERS)} (other implementations, timed when importable; the "
                        "reference is never timed, it is the error basis)")
    p.add_argument("--repeats", type=int, help="timed calls per row, median reported "
                                                "(default 3 on a CPU, 20 elsewhere, 2 with --quick)")
    p.add_argument("--warmup", type=int, help="untimed calls first, >= 1; the last measures memory "
                                               "and gives the output for the error (default 1 on a CPU, 3 elsewhere)")
    p.add_argument("--out", help="output folder (default: $SOLATTN_BENCH_DIR, else ~/solattn-bench, "
                                 "in a subfolder <device>-<date>-<time>)")
    p.add_argument("--quick", action="store_true",
                   help="tiny problems (preset 'quick', 2 repeats), every backend but flex unless "
                        "--backends names it (flex compiles each new shape first): a smoke test, "
                        "about 10 s on a 2-core CPU")
    p.add_argument("--seed", type=int, default=0, help="input seed (default 0)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--graphs", action="store_true",
                   help="also time the backends with a sync-free plan (triton) inside "
                        "solattn.cuda_graphs() (CUDA only; rows named '<backend>+graphs': the call "
                        "replayed as a CUDA graph, output cloned)")
    return p


def default_out(device: torch.device) -> str:
    """Where results go without ``--out``: ``<base>/<device>-<date>-<time>``, ``<base>`` being
    ``$SOLATTN_BENCH_DIR`` when set, else ``solattn-bench`` in the user's home folder (never the
    current directory, which may be anyone's checkout or a read-only place)."""
    base = os.environ.get("SOLATTN_BENCH_DIR", "").strip() or os.path.join(os.path.expanduser("~"), "solattn-bench")
    return os.path.join(base, f"{device.type}-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}")


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
    tau: float = 1.0              # routing threshold of the tau-mode rows (ratio 0)
    peers: List[str] = field(default_factory=list)  # other implementations to time when present
    graphs: bool = False          # also time the triton backend through solattn.cuda_graphs()
    vsa: List[VSAProblem] = field(default_factory=list)  # video_sparse_attn problems (then no shapes)
    backward: bool = False        # VSA: forward + backward rows too
    #: "backend: why" -> the problems it was not run on
    skipped: Dict[str, List[str]] = field(default_factory=dict)

    def skip(self, what: str, tag: str) -> None:
        self.skipped.setdefault(what, []).append(tag)

    def skipped_lines(self) -> List[str]:
        return [f"{what} ({len(tags)} problem(s): {', '.join(tags) if len(tags) <= 3 else tags[0] + ', ...'})"
                for what, tags in self.skipped.items()]


def resolve(args: argparse.Namespace) -> Config:
    """The options -> a :class:`Config`; a bad value raises :class:`UsageError` before any work."""
    device = args.device if args.device is not None else devices.best_device()
    on_cpu = device.type == "cpu"
    dtype = DTYPES[args.dtype]
    vsa = _vsa_problems(args.shapes or [], args.quick)
    if vsa is not None:
        return _resolve_vsa(args, device, vsa)
    if args.backward:
        raise UsageError("--backward received without a video_sparse_attn preset; allowed: with --shapes "
                         + " or ".join(VSA_PRESETS))
    if args.shapes:
        shapes = parse_shapes(args.shapes)
    else:
        shapes = PRESETS["quick" if args.quick else ("cpu" if on_cpu else "gpu")]
    ratios = args.ratios or [0.1, 0.2]
    for r in ratios:
        if not 0.0 <= r < 1.0:
            raise UsageError(f"--ratios received {r:g}; allowed: 0 (tau mode) or 0 < r < 1")
    if not (args.tau >= 0 and args.tau == args.tau and args.tau != float("inf")):
        raise UsageError(f"--tau received {args.tau:g}; allowed: a finite number >= 0")
    registered = [n for n in dispatch.registered() if n != "reference"]
    # the device's priority order first, then the rest
    order = [n for n in dispatch.priority(device.type) if n in registered]
    order += [n for n in registered if n not in order]
    with_dense = True
    peers = list(PEERS) if device.type == "cuda" else []   # the peers' kernels are CUDA-only today
    if args.backends:
        wanted = [b.lower() for b in args.backends]
        unknown = [b for b in wanted if b != DENSE and b not in registered and b not in PEERS]
        if unknown:
            raise UsageError(f"--backends received {', '.join(unknown)}; allowed: {DENSE}, "
                             + ", ".join(registered + list(PEERS))
                             + " (the reference is the error basis, never timed)")
        with_dense = DENSE in wanted
        order = [n for n in order if n in wanted]
        peers = [n for n in PEERS if n in wanted]          # named: run, or say why not
    skipped: Dict[str, List[str]] = {}
    if args.quick and not args.backends and QUICK_LEAVES_OUT in order:
        # its first call of each shape compiles (tens of seconds on a small CPU): not a smoke test
        order.remove(QUICK_LEAVES_OUT)
        skipped[f"{QUICK_LEAVES_OUT}: left out by --quick, its first call of each shape compiles (tens of "
                f"seconds on a small CPU); name it in --backends (e.g. --backends dense sdpa {QUICK_LEAVES_OUT}) to time it"] = \
            ["x".join(map(str, s)) for s in shapes]
    repeats, warmup = _counts(args, on_cpu)
    if args.graphs and device.type != "cuda":
        raise UsageError(f"--graphs received on device {device}; allowed: a CUDA device (CUDA graphs)")
    out = args.out or default_out(device)
    return Config(device=device, dtype=dtype, shapes=shapes, ratios=ratios,
                  tails=[False, True] if args.tail else [False], coarse=args.coarse_gate,
                  backends=order, with_dense=with_dense, repeats=repeats, warmup=warmup, out=out,
                  seed=args.seed, plot=not args.no_plot, tau=args.tau, peers=peers,
                  graphs=args.graphs, skipped=skipped)


def _counts(args: argparse.Namespace, on_cpu: bool) -> Tuple[int, int]:
    """``(repeats, warmup)``: the options, or the defaults for the device."""
    repeats = args.repeats if args.repeats is not None else (2 if args.quick else (3 if on_cpu else 20))
    warmup = args.warmup if args.warmup is not None else (1 if on_cpu or args.quick else 3)
    for option, value in (("--repeats", repeats), ("--warmup", warmup)):
        if value < 1:
            raise UsageError(f"{option} received {value}; allowed: an integer >= 1")
    return repeats, warmup


def _vsa_problems(tokens: Sequence[str], quick: bool) -> Optional[List[VSAProblem]]:
    """The VSA problems when ``--shapes`` names only VSA presets, else None (mixing is refused
    by :func:`parse_shapes`)."""
    names = [part.lower() for tok in tokens for part in tok.split()]
    if not names or not all(name in VSA_PRESETS for name in names):
        return None
    if quick:
        raise UsageError(f"--quick received with --shapes {' '.join(names)}; allowed: --shapes vsa-quick "
                         "(the tiny VSA problems) without --quick")
    return list(dict.fromkeys(p for name in names for p in VSA_PRESETS[name]))


#: the video_sparse_attn row of solattn (the backend chosen as for any call)
SOLATTN = "solattn"


def _resolve_vsa(args: argparse.Namespace, device: torch.device, problems: List[VSAProblem]) -> Config:
    allowed = [DENSE, SOLATTN, *VSA_PEERS]
    wanted = [b.lower() for b in args.backends] if args.backends else allowed
    unknown = [b for b in wanted if b not in allowed]
    if unknown:
        raise UsageError(f"--backends received {', '.join(unknown)} with video_sparse_attn problems; "
                         f"allowed: {', '.join(allowed)}")
    for option, value in (("--ratios", args.ratios), ("--tail", args.tail or None),
                          ("--coarse-gate", args.coarse_gate or None), ("--graphs", args.graphs or None)):
        if value is not None:
            raise UsageError(f"{option} received with video_sparse_attn problems (--shapes "
                             f"{' '.join(args.shapes)}); allowed: sol_attn shapes only (a VSA problem sets "
                             "its kept cubes and gate)")
    repeats, warmup = _counts(args, device.type == "cpu")
    return Config(device=device, dtype=DTYPES[args.dtype], shapes=[], ratios=[], tails=[False], coarse=False,
                  backends=[SOLATTN] if SOLATTN in wanted else [], with_dense=DENSE in wanted,
                  repeats=repeats, warmup=warmup, out=args.out or default_out(device), seed=args.seed,
                  plot=False, peers=[n for n in VSA_PEERS if n in wanted], vsa=problems,
                  backward=args.backward)
