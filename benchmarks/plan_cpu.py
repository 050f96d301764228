"""Time ``solattn.routing.build_plan`` on the CPU, quiet and with the cores oversubscribed.

Each implementation (``--impl NAME=PATH``: a directory holding a ``solattn`` package; default
``current=.`` the working tree) runs in its own worker process, once with torch's default
intra-op threads and once with 1 thread, first on a quiet machine and then with two busy-loop
processes competing for the cores (started here, killed afterwards). The worker also counts
the profiler events of one plan (every ATen op, nested ones included) and saves its plans so
that the parent can check that two implementations give the same selection and the same tail
and coarse terms.

    python benchmarks/plan_cpu.py --impl before=/tmp/solattn_before --impl after=. \\
        --out benchmarks/results/cpu/plan_cpu.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

# (label, B, T, H, D)
SHAPES = [("B=1 T=8192 H=8", 1, 8192, 8, 128), ("seed B=2 T=4056 H=16", 2, 4056, 16, 128)]
# (label, sol_attn keyword arguments; "gate" means a coarse gate of q's shape)
CONFIGS = [
    ("top-k 10 %", dict(topk_ratio=0.1, tail=False)),
    ("top-k 20 %, tail", dict(topk_ratio=0.2, tail=True)),
    ("tau 1, tail", dict(tau=1.0, tail=True)),
    ("top-k 10 %, coarse gate", dict(topk_ratio=0.1, tail=False, gate=True)),
]
BUSY = "while True: pass"


def _cases():
    for s in SHAPES:
        for c in CONFIGS:
            yield s, c


def worker(src: str, threads: int, reps_s: float, save: str, ops: bool) -> dict:
    sys.path.insert(0, os.path.abspath(src))
    import torch
    import solattn
    from solattn import routing
    from solattn.validation import validate

    if os.path.dirname(os.path.abspath(solattn.__file__)) != os.path.join(os.path.abspath(src), "solattn"):
        raise RuntimeError(f"imported {solattn.__file__}, not the one under {src}")
    if threads:
        torch.set_num_threads(threads)
    out = {"threads": torch.get_num_threads(), "cases": {}}
    saved = {}
    for (slabel, B, T, H, D), (clabel, kw) in _cases():
        g = torch.Generator().manual_seed(0)
        q, k, v, gate = (torch.randn(B, T, H, D, generator=g).to(torch.bfloat16) for _ in range(4))
        kw = dict(kw)
        if kw.pop("gate", False):
            kw["coarse_gate"] = gate
        p = validate(q, k, v, **kw)
        with torch.inference_mode():
            plan = routing.build_plan(p)                                  # warm-up
            times = []
            t_end = time.perf_counter() + reps_s
            while len(times) < 3 or (time.perf_counter() < t_end and len(times) < 15):
                t0 = time.perf_counter()
                plan = routing.build_plan(p)
                times.append(time.perf_counter() - t0)
            n_ops = None
            if ops:
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    routing.build_plan(p)
                n_ops = len(prof.events())
        key = f"{slabel} | {clabel}"
        out["cases"][key] = {"ms": 1e3 * statistics.median(times), "reps": len(times), "ops": n_ops}
        if save:
            saved[key] = {f: getattr(plan, f) for f in ("kv_num_blocks", "kv_indices", "tail_lse",
                                                        "tail_value", "coarse", "touches_dead")}
    if save:
        torch.save(saved, save)
    return out


def _run_worker(src, threads, reps_s, save="", ops=False) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--src", src, "--threads", str(threads),
           "--reps-s", str(reps_s)]
    if save:
        cmd += ["--save", save]
    if ops:
        cmd += ["--ops"]
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
    if r.returncode:
        raise RuntimeError(f"worker failed ({' '.join(cmd)}):\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _compare(a_path: str, b_path: str) -> dict:
    import torch
    a, b = torch.load(a_path), torch.load(b_path)
    selection_equal, worst = True, 0.0
    for key in a:
        for f in ("kv_num_blocks", "kv_indices", "touches_dead"):
            selection_equal &= torch.equal(a[key][f], b[key][f])
        for f in ("tail_lse", "tail_value", "coarse"):
            x, y = a[key][f], b[key][f]
            if (x is None) != (y is None):
                selection_equal = False
            elif x is not None:
                fin = torch.isfinite(x)
                if not torch.equal(fin, torch.isfinite(y)) or not torch.equal(x[~fin], y[~fin]):
                    selection_equal = False
                d = ((x[fin] - y[fin]).abs() / y[fin].abs().clamp_min(1.0)).max().item() if fin.any() else 0.0
                worst = max(worst, d)
    return {"selection_equal": bool(selection_equal), "tail_coarse_max_rel_diff": worst}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", action="append", default=[], help="NAME=PATH (a dir holding solattn/)")
    ap.add_argument("--out", default="", help="markdown file to write")
    ap.add_argument("--reps-s", type=float, default=1.0, help="seconds of timed calls per case (>= 3 calls)")
    ap.add_argument("--note", default="", help="a line for the markdown (what the implementations are)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--src", default=".", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--save", default="", help=argparse.SUPPRESS)
    ap.add_argument("--ops", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.src, args.threads, args.reps_s, args.save, args.ops)))
        return

    impls = [(a, os.path.abspath(b)) for a, b in (s.split("=", 1) for s in (args.impl or ["current=."]))]
    tmp = tempfile.mkdtemp(prefix="plan_cpu_")
    load0 = os.getloadavg() if hasattr(os, "getloadavg") else None
    results = {}                                       # (impl, load, threads) -> worker output
    for name, src in impls:                            # quiet, default threads: + op counts, plans
        results[name, "quiet", 0] = _run_worker(src, 0, args.reps_s, os.path.join(tmp, f"{name}.pt"), ops=True)
        results[name, "quiet", 1] = _run_worker(src, 1, args.reps_s)
        print(f"quiet done: {name}", file=sys.stderr)
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(2)]
    try:
        time.sleep(1.0)
        for name, src in impls:
            results[name, "loaded", 0] = _run_worker(src, 0, args.reps_s)
            results[name, "loaded", 1] = _run_worker(src, 1, args.reps_s)
            print(f"loaded done: {name}", file=sys.stderr)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    same = {name: _compare(os.path.join(tmp, f"{impls[0][0]}.pt"), os.path.join(tmp, f"{name}.pt"))
            for name, _ in impls[1:]}

    import torch
    default_threads = results[impls[0][0], "quiet", 0]["threads"]
    lines = ["# `build_plan` on the CPU: quiet and oversubscribed", "",
             f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
             f"default intra-op threads {default_threads}; bf16, D=128; load average before the run "
             f"{'/'.join(f'{x:.2f}' for x in load0) if load0 else 'n/a'}.",
             "Median ms of `build_plan` (inference mode, >= 3 calls after a warm-up). *loaded*: two "
             "`python -c \"while True: pass\"` processes busy on the cores during the measurement. "
             "*ops*: torch.profiler events of one plan (ATen ops, nested ones included).", ""]
    if args.note:
        lines += [args.note, ""]
    head = "| shape | config |"
    sep = "|---|---|"
    for name, _ in impls:
        head += f" {name} quiet | {name} loaded | {name} 1 thr quiet | {name} 1 thr loaded | {name} ops |"
        sep += "---|---|---|---|---|"
    lines += [head, sep]
    for (slabel, *_), (clabel, _) in _cases():
        key = f"{slabel} | {clabel}"
        row = f"| {key} |"
        for name, _ in impls:
            r = {c: results[(name,) + c]["cases"][key] for c in
                 (("quiet", 0), ("loaded", 0), ("quiet", 1), ("loaded", 1))}
            row += "".join(f" {r[c]['ms']:.1f} |" for c in (("quiet", 0), ("loaded", 0), ("quiet", 1), ("loaded", 1)))
            row += f" {r['quiet', 0]['ops']} |"
        lines.append(row)
    for name, cmp in same.items():
        lines += ["", f"{name} against {impls[0][0]}: selection (kv_num_blocks, kv_indices, touches_dead) "
                  f"{'identical' if cmp['selection_equal'] else 'DIFFERENT'}; tail/coarse terms: largest "
                  f"|diff| / max(1, |value|) = {cmp['tail_coarse_max_rel_diff']:.2e}"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
