"""The flex backend on the CPU: sol_attn and video_sparse_attn against dense SDPA, side by side.

    python benchmarks/bench_flex_cpu.py                              # the default problems, quiet then loaded
    python benchmarks/bench_flex_cpu.py --T 4096 --H 2 --vsa 4,32,32 --repeats 3   # a smaller run
    ONEDNN_MAX_CPU_ISA=AVX512_CORE python benchmarks/bench_flex_cpu.py   # the same CPU without AMX

For each problem the contenders (dense ``F.scaled_dot_product_attention``, ``sol_attn`` with
the automatic choice, and the ``sdpa`` and ``flex`` backends by name) run in rounds of rotating
order; a row gives each one's median time, its ratio to dense in the same rounds (median of
the per-round ratios), the backend the automatic choice took, flex's first call (compilation
included, in a fresh compile cache unless ``--warm-cache``) and the error of every output to
the reference on the first heads (``sol_attn``: the ``reference`` backend on fp32 copies; VSA:
the ``sdpa`` backend on fp32 copies, which the test suite checks against the reference).
The whole table is measured twice: quiet, then "loaded", with a busy loop spinning on one core
(on a 2-core machine: the other core). With ``--profile``, the first problem's ``sdpa`` and
``flex`` calls also run under ``torch.profiler`` and the top operators by CPU time are appended
(where the ``sdpa`` backend's time goes: gathers, SDPA calls, copies). Writes Markdown to ``--out``.
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

if "--warm-cache" not in sys.argv:       # before torch is imported: a cold compile is what users see first
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="solattn-flex-inductor-"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import solattn  # noqa: E402
import solattn.backends.flex as flex  # noqa: E402
from solattn import dispatch  # noqa: E402
from solattn.testing import block_structured_qkv, rel_l2  # noqa: E402
from solattn.validation import validate  # noqa: E402

CONTENDERS = ("dense", "auto", "sdpa", "flex")


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def _inputs(B, T, H, D, dtype, seed=0):
    return block_structured_qkv(B, T, H, D, dtype, "cpu", seed=seed, spread=3.0, key_offset=4.0, normalise=True)


def problems(args):
    """(label, call(backend name or None) -> output, dense call, reference call, kept fraction)."""
    B, T, H, D, dt = 1, args.T, args.H, args.D, getattr(torch, args.dtype)
    q, k, v = _inputs(B, T, H, D, dt)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    dense = lambda: F.scaled_dot_product_attention(qt, kt, vt)  # noqa: E731
    h = min(H, args.ref_heads)
    for label, kw in (("top-k 10 %", dict(topk_ratio=0.1, tail=False)),
                      ("top-k 20 %", dict(topk_ratio=0.2, tail=False)),
                      ("tau 1, tail", dict(tau=1.0, tail=True))):
        plan = solattn.routing.build_plan(validate(q, k, v, **kw))

        def call(name, kw=kw):
            return solattn.sol_attn(q, k, v, backend=name, **kw)

        def ref(kw=kw):
            return solattn.sol_attn(*(x[:, :, :h].float() for x in (q, k, v)), backend="reference", **kw)
        yield f"B=1 T={T} H={H} D={D} {args.dtype}, {label}", call, dense, ref, plan.kept_fraction, h
    for grid in args.vsa:
        Tv = grid[0] * grid[1] * grid[2]
        q, k, v = _inputs(B, Tv, H, D, dt, seed=1)
        gate = torch.randn(B, Tv, H, D, generator=torch.Generator().manual_seed(2)).to(dt)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def call(name, q=q, k=k, v=v, gate=gate, grid=grid):
            return solattn.video_sparse_attn(q, k, v, grid, sparsity=0.9, gate=gate, backend=name)

        def ref(q=q, k=k, v=v, gate=gate, grid=grid):
            q32, k32, v32, g32 = (x[:, :, :h].float() for x in (q, k, v, gate))
            return solattn.video_sparse_attn(q32, k32, v32, grid, sparsity=0.9, gate=g32, backend="sdpa")

        def dense_v(qt=qt, kt=kt, vt=vt):
            return F.scaled_dot_product_attention(qt, kt, vt)
        yield f"VSA {grid[0]}x{grid[1]}x{grid[2]} (T={Tv}) H={H} D={D} {args.dtype}, sparsity 0.9, gate", \
            call, dense_v, ref, 0.1, h


def measure(args, loaded: bool):
    rows = []
    stop = mp.Event()
    spinner = None
    if loaded:
        spinner = mp.Process(target=_spin, args=(stop,), daemon=True)
        spinner.start()
    try:
        for label, call, dense, ref, kept, h in problems(args):
            row = {"problem": label, "kept": kept}
            t0 = time.perf_counter()
            out = {"flex": call("flex")}
            row["flex_first_s"] = time.perf_counter() - t0
            out.update(auto=call(None), sdpa=call("sdpa"))
            row["auto_is"] = _auto_name(args)
            want = ref()
            for name in ("auto", "sdpa", "flex"):
                row[f"err_{name}"] = rel_l2(out[name][:, :, :h].float(), want)
            del out
            fns = {"dense": dense, "auto": lambda: call(None), "sdpa": lambda: call("sdpa"),
                   "flex": lambda: call("flex")}
            times = {n: [] for n in CONTENDERS}
            for rnd in range(args.repeats):
                order = CONTENDERS[rnd % len(CONTENDERS):] + CONTENDERS[:rnd % len(CONTENDERS)]
                for name in order:
                    t0 = time.perf_counter()
                    fns[name]()
                    times[name].append((time.perf_counter() - t0) * 1e3)
            for name in CONTENDERS:
                row[f"ms_{name}"] = statistics.median(times[name])
                if name != "dense":
                    row[f"x_{name}"] = statistics.median(d / t for d, t in zip(times["dense"], times[name]))
            print(_line(row), file=sys.stderr, flush=True)
            rows.append(row)
    finally:
        if spinner is not None:
            stop.set()
            spinner.join(5)
    return rows


def profile_tables(args) -> list:
    """torch.profiler's top operators (self CPU time) of one call of each backend on the first problem."""
    from torch.profiler import ProfilerActivity, profile
    label, call, *_ = next(iter(problems(args)))
    lines = [f"## profile: {label}", ""]
    for name in ("sdpa", "flex"):
        call(name)                                   # compiled / warm before profiling
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            call(name)
        table = prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=15,
                                                                    max_name_column_width=40,
                                                                    max_shapes_column_width=60)
        lines += [f"### {name}", "", "```", table.rstrip(), "```", ""]
    return lines


def _auto_name(args) -> str:
    q = torch.empty(1, args.T, args.H, args.D, dtype=getattr(torch, args.dtype))
    return dispatch.choose(validate(q, q, q, topk_ratio=0.1)).name


def _line(r) -> str:
    return (f"| {r['problem']} | {r['kept']:.3f} | {r['ms_dense']:.0f} | {r['ms_auto']:.0f} ({r['x_auto']:.2f}x, "
            f"{r['auto_is']}) | {r['ms_sdpa']:.0f} ({r['x_sdpa']:.2f}x) | {r['ms_flex']:.0f} ({r['x_flex']:.2f}x) "
            f"| {r['flex_first_s']:.1f} s | {r['err_auto']:.1e} / {r['err_sdpa']:.1e} / {r['err_flex']:.1e} |")


HEAD = ("| problem | kept | dense ms | automatic ms (x dense, backend) | sdpa ms (x) | flex ms (x) "
        "| flex first call | error auto / sdpa / flex |\n|---|---|---|---|---|---|---|---|")


def environment() -> list:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return [f"- CPU: {cpu}, {os.cpu_count()} logical cores, torch threads {torch.get_num_threads()}",
            f"- torch {torch.__version__}, ATen CPU capability {torch.backends.cpu.get_cpu_capability()}, "
            f"AMX usable: {flex.amx_usable()}, ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '(unset)')}, "
            f"ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', '(unset)')}",
            f"- automatic CPU order: {' > '.join(dispatch.priority('cpu'))}",
            f"- compile cache: {'warm (existing)' if '--warm-cache' in sys.argv else 'cold (fresh directory)'}"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--vsa", default=["8,64,64", "16,64,64"], nargs="*",
                    help="VSA grids t,h,w (default 32k and 64k tokens); none to skip")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds per problem (default 5)")
    ap.add_argument("--ref-heads", type=int, default=2, help="heads compared with the reference (default 2)")
    ap.add_argument("--no-loaded", action="store_true", help="skip the loaded pass")
    ap.add_argument("--warm-cache", action="store_true", help="keep torch's compile cache (flex's first call then "
                    "does not show a cold compilation)")
    ap.add_argument("--profile", action="store_true", help="append torch.profiler tables of the first problem's "
                    "sdpa and flex calls")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "cpu", "flex.md"))
    args = ap.parse_args(argv)
    args.vsa = [tuple(int(x) for x in g.split(",")) for g in args.vsa]
    lines = ["# flex on the CPU: sol_attn and VSA against dense SDPA", "",
             "Command: `python " + " ".join(["benchmarks/bench_flex_cpu.py", *(argv or sys.argv[1:])]) + "`", "",
             *environment(), "",
             "Times: median of the rounds; ratios: median over rounds of dense / contender, in the same "
             "rounds. The machine may be shared: quiet means no load of ours, not an idle machine.", ""]
    passes = [("quiet", False)] + ([] if args.no_loaded else [("loaded (a busy loop on one core)", True)])
    for title, loaded in passes:
        rows = measure(args, loaded)
        lines += [f"## {title}", "", HEAD, *(_line(r) for r in rows), ""]
    if args.profile:
        lines += profile_tables(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
