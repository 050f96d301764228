"""The flex backend on the CPU: sol_attn and video_sparse_attn against dense SDPA, side by side.

    python benchmarks/bench_flex_cpu.py                              # the default problems, quiet then loaded
    python benchmarks/bench_flex_cpu.py --T 4096 --H 2 --vsa 4,32,32 --repeats 3   # a smaller run
    ONEDNN_MAX_CPU_ISA=AVX512_CORE python benchmarks/bench_flex_cpu.py   # the same CPU without AMX
    OMP_NUM_THREADS=16 python benchmarks/bench_flex_cpu.py --preset amx --out-dir DIR   # one bounded run
    python benchmarks/bench_flex_cpu.py --preset amx --quick --out-dir DIR   # the same, on tiny shapes
    python benchmarks/bench_flex_cpu.py --no-sol --vsa 8,64,64 --contenders dense,sdpa,flex   # VSA rows only

The contenders (dense ``F.scaled_dot_product_attention``, ``sol_attn`` with the automatic
choice, the ``sdpa`` backend, as is, under other ``SdpaTuning`` and on inputs in ``(B, H, T, D)``
memory (``sdpa-heads``: keys and values gathered in place), and ``flex`` by name;
``--contenders``) run in rounds of rotating order. A row gives each one's median time, its
ratio to dense in the same rounds (median of per-round ratios), flex's first call (compilation
included, in a fresh compile cache unless ``--warm-cache``) and every output's error to the
reference on the first heads (VSA: the ``sdpa`` backend on fp32 copies, which the tests check
against the reference); a second table gives the FLOPs and modelled bytes
(``solattn.bench.models``) and what each contender achieved. A flex call that does not compile
(the backend then runs it elsewhere, with a warning) or a contender that raises is reported in
its row with the reason, and the run goes on. The table is measured quiet, then "loaded" (a
busy loop on one core). ``--profile`` appends ``torch.profiler`` tables of the first problem;
``--probe`` times single SDPA calls shaped as the ``sdpa`` backend's against the dense call;
``--time-limit`` lists problems not started by then as skipped. Progress goes to stderr; the
Markdown (``--out``, or ``flex.md`` in ``--out-dir``) is rewritten after every row.

``--preset amx``: B=1, T=8192, H=16, D=128 bf16 (top-k 10 %, 20 %, tau 1 with tail) and VSA on
8x64x64 and 16x64x64 grids (32768 and 65536 tokens); dense, sdpa, sdpa-q32, sdpa-par and flex;
3 rounds, 1 reference head, quiet only, probe and profile, no problem started after 160 s. ``--quick``: tiny shapes.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings

if "--warm-cache" not in sys.argv:       # before torch is imported: a cold compile is what users see first
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="solattn-flex-inductor-"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import solattn  # noqa: E402
import solattn.backends.flex as flex  # noqa: E402
from solattn import dispatch  # noqa: E402
from solattn.backends.sdpa import SdpaTuning  # noqa: E402
from solattn.bench.models import bytes_moved, flop_count  # noqa: E402
from solattn.config import tuning  # noqa: E402
from solattn.testing import block_structured_qkv, rel_l2  # noqa: E402
from solattn.validation import validate  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sdpa_probe import probe_lines  # noqa: E402

CONTENDERS = ("dense", "auto", "sdpa", "sdpa-q32", "sdpa-par", "sdpa-heads", "flex")
#: the sdpa backend under other settings (SdpaTuning): items of 32 query rows (no per-call
#: repack of keys and values on AMX), and every op on all threads (the former thread use)
SDPA_VARIANTS = {"sdpa-q32": SdpaTuning(query_rows=32),
                 "sdpa-par": SdpaTuning(parallel_bytes=0, parallel_flops=0, chunk_threads=1)}
PRESETS = {"amx": dict(T=8192, H=16, D=128, dtype="bfloat16", vsa=["8,64,64", "16,64,64"], repeats=3,
                       ref_heads=1, no_loaded=True, contenders="dense,sdpa,sdpa-q32,sdpa-par,flex", probe=True,
                       profile=True, time_limit=160.0)}
#: sol_attn's problems at T (label, keyword arguments)
SOL_PROBLEMS = (("top-k 10 %", dict(topk_ratio=0.1, tail=False)),
                ("top-k 20 %", dict(topk_ratio=0.2, tail=False)),
                ("tau 1, tail", dict(tau=1.0, tail=True)))
QUICK = dict(T=512, H=2, D=64, vsa=["2,16,16", "4,16,16"], repeats=2)
_START = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _START:6.1f} s] {msg}", file=sys.stderr, flush=True)


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def _inputs(B, T, H, D, dtype, seed=0):
    return block_structured_qkv(B, T, H, D, dtype, "cpu", seed=seed, spread=3.0, key_offset=4.0, normalise=True)


def _layouts(args, *xs):
    """``[as given, the same values in (B, H, T, D) memory viewed as (B, T, H, D)]``, the second
    (hosts that attend in that layout pass their tensors so) only for the sdpa-heads contender."""
    return [xs, tuple(x.transpose(1, 2).contiguous().transpose(1, 2) for x in xs)
            if "sdpa-heads" in args.contenders else None]


def _sol_problems(args, B, H, D, dt, h):
    """:func:`problems`' sol_attn problems at ``args.T`` (:data:`SOL_PROBLEMS`), on one set of inputs."""
    T = args.T
    q, k, v = _inputs(B, T, H, D, dt)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    qkv = _layouts(args, q, k, v)
    for label, kw in SOL_PROBLEMS:
        def call(name, heads=False, kw=kw):
            return solattn.sol_attn(*qkv[heads], backend=name, **kw)

        def ref(kw=kw):
            return solattn.sol_attn(*(x[:, :, :h].float() for x in (q, k, v)), backend="reference", **kw)
        yield dict(label=f"B=1 T={T} H={H} D={D} {args.dtype}, {label}", call=call,
                   dense=lambda: F.scaled_dot_product_attention(qt, kt, vt), ref=ref, shape=(B, T, H, D), h=h,
                   plan=lambda kw=kw: solattn.plan(q, k, v, backend="sdpa", **kw))


def problems(args):
    """Dicts: label, call(backend name or None, heads=False) -> output, dense call, reference
    call, plan, (B, T, H, D), heads compared."""
    B, H, D, dt = 1, args.H, args.D, getattr(torch, args.dtype)
    h = min(H, args.ref_heads)
    if not args.no_sol:
        yield from _sol_problems(args, B, H, D, dt, h)
    for grid in args.vsa:
        Tv = grid[0] * grid[1] * grid[2]
        qv, kv, vv = _inputs(B, Tv, H, D, dt, seed=1)
        gate = torch.randn(B, Tv, H, D, generator=torch.Generator().manual_seed(2)).to(dt)
        qvt, kvt, vvt = (x.transpose(1, 2) for x in (qv, kv, vv))

        def call(name, heads=False, qkv=_layouts(args, qv, kv, vv), gate=gate, grid=grid):
            return solattn.video_sparse_attn(*qkv[heads], grid, sparsity=0.9, gate=gate, backend=name)

        def ref(q=qv, k=kv, v=vv, gate=gate, grid=grid):
            q32, k32, v32, g32 = (x[:, :, :h].float() for x in (q, k, v, gate))
            return solattn.video_sparse_attn(q32, k32, v32, grid, sparsity=0.9, gate=g32, backend="sdpa")

        yield dict(label=f"VSA {grid[0]}x{grid[1]}x{grid[2]} (T={Tv}) H={H} D={D} {args.dtype}, sparsity 0.9, gate",
                   call=call, dense=lambda qt=qvt, kt=kvt, vt=vvt: F.scaled_dot_product_attention(qt, kt, vt),
                   ref=ref, shape=(B, Tv, H, D), h=h,
                   plan=lambda q=qv, k=kv, v=vv, gate=gate, grid=grid: solattn.video_plan(
                       q, k, v, grid, sparsity=0.9, gate=gate, backend="sdpa"))


def run(pb, name: str):
    """One call of contender ``name`` (not dense) on problem ``pb``."""
    if name in SDPA_VARIANTS:
        with tuning(SDPA_VARIANTS[name]):
            return pb["call"]("sdpa")
    if name == "sdpa-heads":
        return pb["call"]("sdpa", heads=True)
    return pb["call"](None if name == "auto" else name)


def _why(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text[:200]}"


def _first_flex_call(pb) -> tuple:
    """``(output or None, seconds, failure reason or None)`` of the first flex call (it compiles).
    A compilation failure inside the call is not an exception: the backend records it, warns and
    runs the call on the next backend; that output is not flex's and is dropped."""
    before = dict(flex.failures())
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            out = pb["call"]("flex")
        except Exception as err:  # noqa: BLE001 - reported in the row; the run goes on
            return None, time.perf_counter() - t0, _why(err)
    took = time.perf_counter() - t0
    why = [f"compile failed, ran elsewhere: {v}" for k, v in flex.failures().items() if before.get(k) != v]
    why += [str(w.message) for w in seen if "could not compile" in str(w.message)]
    return (None, took, why[0][:300]) if why else (out, took, None)


def measure_row(pb, args, deadline: float) -> dict:
    row = {"problem": pb["label"], "failed": {}, "ms": {}, "x": {}, "err": {}}
    plan = pb["plan"]()
    row["kept"], row["kept_pairs"] = plan.kept_fraction, int(plan.kv_num_blocks.sum().item())
    del plan
    names = [c for c in args.contenders if c != "dense"]
    outs = {}
    if "flex" in names:
        out, row["flex_first_s"], why = _first_flex_call(pb)
        if why:
            row["failed"]["flex"] = why
        else:
            outs["flex"] = out
        log(f"  flex first call {row['flex_first_s']:.1f} s" + (f" (failed: {why})" if why else ""))
    for name in names:
        if name == "flex":
            continue
        try:
            outs[name] = run(pb, name)
        except Exception as err:  # noqa: BLE001 - reported in the row; the run goes on
            row["failed"][name] = _why(err)
    if "auto" in names:
        row["auto_is"] = _auto_name(args, pb["shape"])
    want = pb["ref"]()
    for name, out in outs.items():
        row["err"][name] = rel_l2(out[:, :, :pb["h"]].float(), want)
    del outs, want
    fns = {"dense": pb["dense"]}
    fns.update({n: (lambda n=n: run(pb, n)) for n in names if n not in row["failed"]})
    order0 = [n for n in args.contenders if n in fns]
    times = {n: [] for n in order0}
    for rnd in range(args.repeats):
        if rnd and time.perf_counter() > deadline:
            log(f"  time limit: {rnd} round(s)")
            break
        order = order0[rnd % len(order0):] + order0[:rnd % len(order0)]
        for name in order:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append((time.perf_counter() - t0) * 1e3)
    row["rounds"] = len(times["dense"])
    for name in order0:
        row["ms"][name] = statistics.median(times[name])
        if name != "dense":
            row["x"][name] = statistics.median(d / t for d, t in zip(times["dense"], times[name]))
    return row


def measure(args, loaded: bool, deadline: float, on_row) -> list:
    rows = []
    stop = mp.Event()
    spinner = None
    if loaded:
        spinner = mp.Process(target=_spin, args=(stop,), daemon=True)
        spinner.start()
    try:
        count = (0 if args.no_sol else len(SOL_PROBLEMS)) + len(args.vsa)
        for i, pb in enumerate(problems(args)):          # inputs are made one problem at a time
            if time.perf_counter() > deadline:
                row = {"problem": pb["label"], "skipped": f"time limit ({args.time_limit:.0f} s) reached"}
            else:
                log(f"row {i + 1}/{count} {pb['label']}")
                try:
                    row = measure_row(pb, args, deadline)
                except Exception as err:  # noqa: BLE001 - one broken row must not lose the others
                    row = {"problem": pb["label"], "skipped": _why(err)}
            row["shape"] = pb["shape"]
            rows.append(row)
            log(f"row {i + 1}/{count} " + _line(row, args))
            on_row(rows)
            del pb
    finally:
        if spinner is not None:
            stop.set()
            spinner.join(5)
    return rows


def profile_tables(args) -> list:
    """torch.profiler's top operators (self CPU time) of one call of each backend on the first problem."""
    from torch.profiler import ProfilerActivity, profile
    pb = next(iter(problems(args)))
    lines = [f"## profile: {pb['label']}", ""]
    for name in ("sdpa", "flex"):
        if name not in args.contenders:
            continue
        try:
            pb["call"](name)                             # compiled / warm before profiling
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                t0 = time.perf_counter()
                pb["call"](name)
                wall = (time.perf_counter() - t0) * 1e3
        except Exception as err:  # noqa: BLE001 - reported instead of the table
            lines += [f"### {name}", "", f"not profiled: {_why(err)}", ""]
            continue
        table = prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=15,
                                                                    max_name_column_width=40,
                                                                    max_shapes_column_width=60)
        # wall beyond the ops' self CPU time: Python, and single-threaded stretches between ops
        lines += [f"### {name}", "", f"Wall time of the profiled call: {wall:.1f} ms.", "", "```", table.rstrip(),
                  "```", ""]
    return lines


def _auto_name(args, shape) -> str:
    q = torch.empty(*shape, dtype=getattr(torch, args.dtype))
    return dispatch.choose(validate(q, q, q, topk_ratio=0.1)).name


def _cell(r, name) -> str:
    if name in r["failed"]:
        return f"failed: {r['failed'][name]}"
    if name not in r["ms"]:
        return "-"
    extra = f", {r['auto_is']}" if name == "auto" else ""
    return f"{r['ms'][name]:.1f} ({r['x'][name]:.2f}x{extra})"


def _line(r, args) -> str:
    others = [c for c in args.contenders if c != "dense"]
    if "skipped" in r:
        return f"| {r['problem']} | skipped: {r['skipped']} |" + " |" * (len(others) + 3)
    first = f"{r['flex_first_s']:.1f} s" if "flex_first_s" in r else "-"
    errs = " / ".join(f"{r['err'][n]:.1e}" if n in r["err"] else "-" for n in others)
    return (f"| {r['problem']} | {r['kept']:.3f} | {r['ms'].get('dense', float('nan')):.1f} | "
            + " | ".join(_cell(r, n) for n in others) + f" | {first} | {errs} | {r['rounds']} |")


def _head(args) -> list:
    others = [c for c in args.contenders if c != "dense"]
    names = {n: "automatic ms (x dense, backend)" if n == "auto" else f"{n} ms (x)" for n in CONTENDERS}
    cols = ["problem", "kept", "dense ms", *(names[n] for n in others), "flex first call",
            "error " + " / ".join(others), "rounds"]
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]


def model_lines(rows, args) -> list:
    """Each row's FLOPs and modelled bytes, and what each contender achieved on them."""
    elt = torch.finfo(getattr(torch, args.dtype)).bits // 8
    out = ["| problem | GFLOP dense / sparse | MB dense / sdpa / fused | "
           + " | ".join(f"{n} GFLOP/s, GB/s" for n in args.contenders) + " |",
           "|" + "---|" * (3 + len(args.contenders))]
    for r in rows:
        if "skipped" in r:
            continue
        fd, fs = (flop_count(r["shape"], p) for p in (None, r["kept_pairs"]))
        mb = {m: bytes_moved(r["shape"], elt, r["kept_pairs"], m) for m in ("dense", "sdpa", "fused")}
        model = {"dense": "dense", "flex": "fused"}                  # flex: gather free; others gather
        cells = [f"{(fd if n == 'dense' else fs) / r['ms'][n] / 1e6:.0f}, {mb[model.get(n, 'sdpa')] / r['ms'][n] / 1e6:.1f}"
                 if n in r["ms"] else "-" for n in args.contenders]
        out.append(f"| {r['problem']} | {fd / 1e9:.0f} / {fs / 1e9:.1f} | "
                   f"{mb['dense'] / 1e6:.0f} / {mb['sdpa'] / 1e6:.0f} / {mb['fused'] / 1e6:.0f} | " + " | ".join(cells) + " |")
    return out + [""]


def environment() -> list:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    from solattn.bench.report import source_revision
    return [f"- solattn: {source_revision()}",
            f"- CPU: {cpu}, {os.cpu_count()} logical cores, torch threads {torch.get_num_threads()}, "
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '(unset)')}",
            f"- torch {torch.__version__}, ATen CPU capability {torch.backends.cpu.get_cpu_capability()}, "
            f"AMX usable: {flex.amx_usable()}, ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '(unset)')}, "
            f"ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', '(unset)')}, "
            f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', '(unset)')}",
            f"- automatic CPU order: {' > '.join(dispatch.priority('cpu'))}",
            f"- compile cache: {'warm (existing)' if '--warm-cache' in sys.argv else 'cold (fresh directory)'}"]


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), help="a fixed option set (see the module doc); "
                    "options given explicitly are not overridden")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (T=512, H=2, D=64, VSA 2x16x16 and "
                    "4x16x16, 2 rounds): checks that a command works")
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--no-sol", action="store_true", help="skip sol_attn's problems at --T (VSA rows only)")
    ap.add_argument("--vsa", default=["8,64,64", "16,64,64"], nargs="*",
                    help="VSA grids t,h,w (default 32k and 64k tokens); none to skip")
    ap.add_argument("--contenders", default="dense,auto,sdpa,flex",
                    help=f"comma-separated, from {','.join(CONTENDERS)} (dense is always timed; sdpa-q32: "
                    "SdpaTuning(query_rows=32), sdpa-par: every op of the sdpa backend on all threads, "
                    "sdpa-heads: q, k, v in (B, H, T, D) memory)")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds per problem (default 5)")
    ap.add_argument("--ref-heads", type=int, default=2, help="heads compared with the reference (default 2)")
    ap.add_argument("--no-loaded", action="store_true", help="skip the loaded pass")
    ap.add_argument("--warm-cache", action="store_true", help="keep torch's compile cache (flex's first call then "
                    "does not show a cold compilation)")
    ap.add_argument("--profile", action="store_true", help="append torch.profiler tables of the first problem's "
                    "sdpa and flex calls")
    ap.add_argument("--probe", action="store_true", help="time the sdpa backend's SDPA call shape against dense SDPA")
    ap.add_argument("--time-limit", type=float, default=0.0, help="seconds after which no new problem starts "
                    "(0: none)")
    ap.add_argument("--out", default=None, help="Markdown file (default benchmarks/results/cpu/flex.md)")
    ap.add_argument("--out-dir", default=None, help="write flex.md into this folder instead")
    raw = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(raw)
    given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in raw if a.startswith("--")}
    for source in ([PRESETS[args.preset]] if args.preset else []) + ([QUICK] if args.quick else []):
        for key, value in source.items():
            if key not in given:
                setattr(args, key, value)
    args.contenders = ["dense"] + [c for c in args.contenders.split(",") if c and c != "dense"]
    bad = [c for c in args.contenders if c not in CONTENDERS]
    if bad:
        ap.error(f"argument --contenders received {bad}; allowed: {', '.join(CONTENDERS)}")
    args.vsa = [tuple(int(x) for x in g.split(",")) for g in args.vsa if g != "none"]
    if args.out_dir:
        args.out = os.path.join(args.out_dir, "flex.md")
    args.out = args.out or os.path.join(ROOT, "benchmarks", "results", "cpu", "flex.md")
    return args, raw


def main(argv=None) -> int:
    args, raw = parse(argv)
    deadline = _START + args.time_limit if args.time_limit > 0 else float("inf")
    head = ["# flex on the CPU: sol_attn and VSA against dense SDPA", "",
            "Command: `python " + " ".join(["benchmarks/bench_flex_cpu.py", *raw]) + "`", "",
            *environment(), "",
            "Times: median of the rounds; ratios: median over rounds of dense / contender, in the same "
            "rounds. The machine may be shared: quiet means no load of ours, not an idle machine. Errors: "
            "relative L2 to the reference on the first heads.", ""]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    done = []

    def write(extra=()):
        with open(args.out, "w") as f:
            f.write("\n".join(head + done + list(extra)) + "\n")

    if args.probe:                 # first: seconds, and kept if a later row runs past an outer limit
        done += probe_lines(args, log)
        write()
    passes = [("quiet", False)] + ([] if args.no_loaded else [("loaded (a busy loop on one core)", True)])
    for title, loaded in passes:
        log(f"pass: {title}")

        def on_row(rows, title=title):
            write([f"## {title}", "", *_head(args), *(_line(r, args) for r in rows), ""])
        rows = measure(args, loaded, deadline, on_row)
        done += [f"## {title}", "", *_head(args), *(_line(r, args) for r in rows), "",
                 f"### model ({title})", "", *model_lines(rows, args)]
        write()
    if args.profile:
        log("profile")
        done += profile_tables(args)
    write()
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
