"""The portable (sdpa) backward on the CPU: what autograd keeps from the forward, and time.

    python benchmarks/portable_backward.py --out benchmarks/results/cpu/portable_backward.md

The portable backward differentiates the sdpa forward with torch autograd (``sol_attn(...,
backend="sdpa")`` on any device, and the only backward off CUDA). For each case it reports the
bytes autograd saves during the forward (distinct storages, through saved-tensor hooks; the
inputs themselves count once), the peak resident memory growth of the forward + backward, the
forward + backward time and the gradient error against the reference's autograd (small case).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from solattn.bench.report import publish  # noqa: E402
from solattn.ops import run_problem  # noqa: E402
from solattn.testing import make_qkv  # noqa: E402
from solattn.validation import validate  # noqa: E402

CASES = [(1, 4096, 8, 64, 0.1), (1, 4096, 8, 64, 0.3), (1, 8192, 8, 64, 0.1)]


def one(B, T, H, D, ratio):
    q, k, v = (t.requires_grad_(True) for t in make_qkv(B, T, H, D, seed=0))
    w = torch.randn(B, T, H, D, generator=torch.Generator().manual_seed(1))
    saved = {}

    def pack(t):
        s = t.untyped_storage()
        saved[s.data_ptr()] = s.nbytes()
        return t

    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run_problem(validate(q, k, v, topk_ratio=ratio, tail=True), "sdpa")
    t1 = time.perf_counter()
    out.backward(w)
    t2 = time.perf_counter()
    inputs = 3 * q.numel() * q.element_size()
    extra = sum(saved.values()) - sum(s for p, s in saved.items()
                                      if p in {x.untyped_storage().data_ptr() for x in (q, k, v)})
    return dict(shape=f"{B}x{T}x{H}x{D}", ratio=ratio, saved_mib=extra / 2**20,
                saved_vs_inputs=extra / inputs, fwd_s=t1 - t0, bwd_s=t2 - t1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="portable_backward.md")
    ap.add_argument("--case", type=int, help=argparse.SUPPRESS)     # child process: one case
    args = ap.parse_args()
    if args.case is not None:
        import resource  # POSIX only, and only in this script's child processes
        one(1, 256, 2, CASES[args.case][3], 0.5)          # warm the libraries up first
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        row = one(*CASES[args.case])
        row["peak_growth_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        print(repr(row))
        return
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    rows = []
    for i in range(len(CASES)):       # one process per case: peak RSS is per process
        res = subprocess.run([sys.executable, __file__, "--case", str(i)], capture_output=True, text=True,
                             check=True)
        rows.append(eval(res.stdout.strip().splitlines()[-1]))  # noqa: S307 - our own repr
        print(rows[-1], file=sys.stderr, flush=True)
    head = "| shape BxTxHxD | top-k | saved for backward MiB | x inputs | peak RSS growth MiB | fwd s | bwd s |"
    lines = [f"# portable (sdpa) backward on the CPU ({os.cpu_count()} cores), fp32, tail on", "", head,
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['ratio']} | {r['saved_mib']:.1f} | {r['saved_vs_inputs']:.2f} | "
                     f"{r['peak_growth_mib']:.0f} | {r['fwd_s']:.2f} | {r['bwd_s']:.2f} |")
    publish(lines, args.out)


if __name__ == "__main__":
    main()
