"""Run solattn's benchmarks and keep the latest result of each as ``results/<device>/<name>.md``.

    python benchmarks/run.py forward peers backward plan vsa      # a GPU: what the list says
    python benchmarks/run.py plan_reuse                           # a GPU: a caller's plan against routing
    python benchmarks/run.py forward                              # a CPU: the forward table
    python benchmarks/run.py distributed --nproc 2                # torchrun on 2 GPUs
    python benchmarks/run.py flex sdpa                            # a CPU: flex and the sdpa backend's call shapes
    python benchmarks/run.py diffusers_h3 -- --small              # a CPU: FastH3 in diffusers at a CPU size
    python benchmarks/run.py --list                               # the benchmarks and their commands
    python benchmarks/run.py forward --results /tmp/r             # write elsewhere

Each benchmark is one command (below); the runner runs it, then writes
``<results>/<device>/<name>.md``: the commit (``SOLATTN_REVISION`` when set, else the checkout's
``git`` HEAD), the date, the runner's and the benchmark's command, then the benchmark's own
Markdown. ``<device>`` is ``cpu`` or the GPU's model in lower case (``h200``), with ``x2`` for a
multi-GPU run. Every benchmark times calls the same way (``solattn.bench.timing``: the device
idle and, on a GPU, its L2 cache flushed before each timed call; several contenders in
rounds of rotating order, ratios taken round by round). Exit status: the first failing
benchmark's, else 0.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import re
import shlex
import subprocess
import sys
import tempfile
from typing import Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

#: name -> (what it measures, the command with {out} for its output folder, the file it writes there)
BENCHMARKS: Dict[str, Tuple[str, List[str], str]] = {
    "forward": ("sol_attn end to end (routing plan included) against dense SDPA, every backend that can run, "
                "the device's default problems",
                [sys.executable, "-m", "solattn", "bench", "--out", "{out}"], "bench.md"),
    "peers": ("sol_attn against dense SDPA and comfy-kitchen's CUDA kernel at the H3, mid and seed shapes",
              [sys.executable, "-m", "solattn", "bench", "--shapes", "peers", "--ratios", "0.1", "0.2", "0",
               "--tail", "--backends", "dense", "triton", "sdpa", "comfy-kitchen", "--repeats", "5",
               "--warmup", "2", "--out", "{out}"], "bench.md"),
    "backward": ("training step (forward + backward) of the triton backend against dense SDPA, gradient error",
                 [sys.executable, os.path.join(HERE, "bench_backward.py"), "--no-sweep", "--out",
                  os.path.join("{out}", "bench_backward.md")], "bench_backward.md"),
    "plan": ("the routing plan: torch plan against the fused Triton plan, and the kernel alone",
             [sys.executable, os.path.join(HERE, "bench_plan.py"), "--out", "{out}"], "bench_plan.md"),
    "vsa": ("video_sparse_attn against dense SDPA and FastVideo's VSA op, forward and forward + backward",
            [sys.executable, "-m", "solattn", "bench", "--shapes", "vsa", "--backward", "--out", "{out}"],
            "bench.md"),
    "host": ("host time of one eager call (triton backend): video_sparse_attn and sol_attn, forward and "
             "forward + backward, with result digests",
             [sys.executable, os.path.join(HERE, "bench_host.py"), "--out", "{out}"], "bench_host.md"),
    "plan_reuse": ("route once, run many: sol_attn with a caller's plan against the same call routing itself "
                   "and dense SDPA (a GPU: triton at H3; add -- --small on a CPU)",
                   [sys.executable, os.path.join(HERE, "bench_plan_reuse.py"), "--out", "{out}"], "bench_plan_reuse.md"),
    "coarse": ("the triton backward's coarse-branch block gradients: two Triton kernels against the torch "
               "products, GPU and host time, error against float64",
               [sys.executable, os.path.join(HERE, "bench_coarse_grad.py"), "--out", "{out}"], "bench_coarse_grad.md"),
    "first_call": ("a CPU's first call in a fresh process: the automatic backend, then after solattn.warm_up, "
                   "against dense SDPA",
                   [sys.executable, os.path.join(HERE, "bench_first_call.py"), "--out",
                    os.path.join("{out}", "bench_first_call.md")], "bench_first_call.md"),
    "flex": ("a CPU: sol_attn through the automatic, sdpa and flex backends against dense SDPA at T=8192 "
             "(three problems, quiet and under load; the flex backend's first call timed)",
             [sys.executable, os.path.join(HERE, "bench_flex_cpu.py"), "--contenders", "dense,auto,sdpa,flex",
              "--vsa", "none", "--repeats", "3", "--out-dir", "{out}"], "flex.md"),
    "sdpa": ("a CPU: the sdpa backend's SDPA call shapes (items, heads) against dense SDPA, and sol_attn on it "
             "at T=8192",
             [sys.executable, os.path.join(HERE, "bench_flex_cpu.py"), "--preset", "amx", "--contenders",
              "dense,sdpa,sdpa-heads", "--vsa", "none", "--time-limit", "45", "--out-dir", "{out}"], "flex.md"),
    "diffusers_h3": ("FastH3 in diffusers (enable_fasth3) against diffusers' dense attention: attention core, "
                     "one H3 block, a tiny model step (on a CPU add `-- --small`)",
                     [sys.executable, os.path.join(HERE, "diffusers_h3.py"), "--out",
                      os.path.join("{out}", "diffusers_h3.md")], "diffusers_h3.md"),
    "comfyui_fastwan": ("the tiny FastWan-shaped Wan in a real ComfyUI (SOLATTN_COMFYUI), 3 steps without the node "
                        "and with it on auto (vsa with the file's gates)",
                        [sys.executable, os.path.join(HERE, "comfyui_benchmark.py"),
                         os.path.join("{out}", "comfyui_fastwan.md"), "--model", "fastwan", "--repeats", "5"],
                        "comfyui_fastwan.md"),
    "distributed": ("solattn.distributed (sequence parallel over P GPUs) against one GPU",
                    [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "{nproc}",
                     os.path.join(HERE, "bench_distributed.py"), "--out",
                     os.path.join("{out}", "bench_distributed.md")], "bench_distributed.md"),
}


def revision() -> str:
    given = os.environ.get("SOLATTN_REVISION", "").strip()
    if given:
        return given
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def device_folder(nproc: int = 1) -> str:
    """``cpu`` (``cpu-amx`` on a CPU with AMX), or the GPU model in lower case without the vendor
    (``NVIDIA H200`` -> ``h200``)."""
    import torch
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
    elif getattr(torch, "xpu", None) is not None and torch.xpu.is_available():
        name = torch.xpu.get_device_name(0)
    elif torch.backends.mps.is_available():
        name = "mps"
    else:
        sys.path.insert(0, ROOT)
        from solattn.backends.flex import amx_usable
        return "cpu-amx" if amx_usable() else "cpu"
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w and w not in ("nvidia", "intel", "r", "tm")]
    model = next((w for w in words if re.fullmatch(r"[a-z]+[0-9]+[a-z]*", w)), None)   # h100, a770
    base = model or "-".join(words[-2:] if len(words) > 2 else words) or "gpu"
    return base + (f"x{nproc}" if nproc > 1 else "")


def command(name: str, out: str, nproc: int, extra: List[str]) -> List[str]:
    argv = [a.replace("{out}", out).replace("{nproc}", str(nproc)) for a in BENCHMARKS[name][1]]
    return argv + extra


def shown(argv: List[str]) -> str:
    """The command as a user types it, from the repository root."""
    words = ["python" if a == sys.executable else os.path.relpath(a, ROOT) if a.startswith(ROOT) else a
             for a in argv]
    return " ".join(shlex.quote(w) for w in words)


def run_one(name: str, results: str, nproc: int, extra: List[str], runner_cmd: str) -> int:
    folder = os.path.join(results, device_folder(nproc if name == "distributed" else 1))
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"solattn-{name}-") as tmp:
        argv = command(name, tmp, nproc, extra)
        print(f"== {name}: {shown(argv)}", flush=True)
        started = _dt.datetime.now(_dt.timezone.utc)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
        proc = subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        print(proc.stdout[-4000:], flush=True)
        produced = os.path.join(tmp, BENCHMARKS[name][2])
        body = open(produced).read() if os.path.exists(produced) else ""
        minutes = (_dt.datetime.now(_dt.timezone.utc) - started).total_seconds() / 60
        lines = [f"# {name}: {BENCHMARKS[name][0]}", "",
                 f"- commit: {revision()}",
                 f"- date: {started.strftime('%Y-%m-%d %H:%M')} UTC ({minutes:.1f} min)",
                 f"- command: `{runner_cmd}` (runs `{shown(command(name, 'OUT', nproc, extra))}`)",
                 f"- exit status: {proc.returncode}", ""]
        if body:
            body = re.sub(r"^# ", "## ", body, flags=re.M)
            lines.append(body.rstrip())
        else:
            lines += ["No result file was written; the last lines of its output:", "", "```",
                      proc.stdout[-3000:].rstrip(), "```"]
    path = os.path.join(folder, f"{name}.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"== {name}: exit status {proc.returncode}, wrote {path}", flush=True)
    return proc.returncode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/run.py", description=__doc__.splitlines()[0],
                                 epilog="Arguments after -- go to every benchmark's command.")
    ap.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run: {', '.join(BENCHMARKS)}")
    ap.add_argument("--results", default=os.path.join(HERE, "results"),
                    help="results folder (default: benchmarks/results of this checkout)")
    ap.add_argument("--nproc", type=int, default=2, help="processes (GPUs) of the distributed benchmark (default 2)")
    ap.add_argument("--list", action="store_true", help="list the benchmarks and their commands")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.list or not args.names:
        for name, (what, _, _) in BENCHMARKS.items():
            print(f"{name:<12} {what}\n{'':<12} {shown(command(name, 'OUT', args.nproc, []))}")
        return 0 if args.list else 2
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        ap.error(f"NAME received {', '.join(map(repr, unknown))}; allowed: {', '.join(BENCHMARKS)}")
    options = [a for a in argv if a not in args.names]
    status = 0
    for name in args.names:
        runner_cmd = " ".join(["python benchmarks/run.py", name, *map(shlex.quote, options)])
        status = status or run_one(name, args.results, args.nproc, extra, runner_cmd)
    return status


if __name__ == "__main__":
    sys.exit(main())
