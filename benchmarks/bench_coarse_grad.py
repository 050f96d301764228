"""The coarse branch's block gradients in the triton backward: the two Triton kernels
(:func:`solattn.backends.triton.coarse_kernels.fused_coarse_row_grads`) against the torch products
(:func:`solattn.routing.coarse_grad.coarse_block_grads` then ``per_rows``), with their error.

    python benchmarks/bench_coarse_grad.py --out DIR              # a CUDA GPU: n = 128, 583, 2048
    python benchmarks/bench_coarse_grad.py --sweep --out DIR      # and the kernels' launch settings
    python benchmarks/bench_coarse_grad.py --dry-run --out DIR    # tiny shapes on the CPU (TRITON_INTERPRET=1)

B=1, H=56, D=128 (G = 56 heads), random fp32 block means and ``dcoarse``, live lengths of 1..64:
n = 128 is the 8x32x32 video (8192 tokens), n = 583 H3's 432-token prefix and 16x48x48 video,
n = 2048 a 131072-token sequence.
Per path: GPU ms (CUDA events, L2 flushed, both paths in rotating rounds: ``solattn.bench.timing``),
host ms (``perf_counter`` around a call queued behind a GPU spin kernel, no synchronisation) and
the largest error to a float64 computation of the definition, absolute and relative to the
largest float64 value, per gradient. Writes bench_coarse_grad.md to --out.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from solattn.bench.timing import paired_rounds, ratio_summary  # noqa: E402
from solattn.routing.coarse_grad import coarse_block_grads, per_rows  # noqa: E402

SIZES = [("8x32x32 video (8192 tokens)", 56, 128, 128), ("H3: 432 + 16x48x48", 56, 583, 128),
         ("131072 tokens", 56, 2048, 128)]
DRY = [("tiny", 2, 37, 64)]


def inputs(G: int, n: int, D: int, device: torch.device):
    g = torch.Generator().manual_seed(n)
    means = torch.randn(3, G, n, D, generator=g).to(device)
    dco = torch.randn(G, n, D, generator=g).to(device)
    L = torch.randint(1, 65, (n,), generator=g, dtype=torch.int32).to(device)
    return means, dco, L, D ** -0.5


def float64_grads(means, dco, L, scale):
    """The definition (coarse_grad's docstring) in float64, divided by the live lengths."""
    q, k, v = (t.double() for t in means)
    d, lens = dco.double(), L.double()[:, None]
    a = torch.softmax(scale * q @ k.transpose(-1, -2), dim=-1)
    dp = d @ v.transpose(-1, -2)
    ds = a * (dp - (a * dp).sum(-1, keepdim=True))
    return scale * ds @ k / lens, scale * ds.transpose(-1, -2) @ q / lens, a.transpose(-1, -2) @ d / lens


def errors(got, want) -> str:
    cells = []
    for a, b in zip(got, want):
        err = (a.double() - b).abs().max().item()
        cells.append(f"{err:.1e} / {err / b.abs().max().item():.1e}")
    return " | ".join(cells)


def host_ms(fn, device: torch.device, repeats: int, busy_cycles: int) -> float:
    """Median host time of ``fn`` queued behind a spin kernel (the GPU never makes it wait)."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda._sleep(busy_cycles)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(times) * 1e3


def run(sizes, device, rounds: int, busy_cycles: int, sweep: bool):
    from solattn.backends.triton.coarse_kernels import fused_coarse_row_grads
    lines = ["| shape | G, n, D | path | GPU ms | host ms | dq err abs / rel | dk err | dv err |",
             "|---|---|---|---|---|---|---|---|"]
    sweep_lines = ["| n | tile | chunk | warps | GPU ms |", "|---|---|---|---|---|"]
    for label, G, n, D in sizes:
        means, dco, L, scale = inputs(G, n, D, device)
        paths = {"torch": lambda: per_rows(coarse_block_grads(means[0], means[1], means[2], dco, scale), L),
                 "triton": lambda: fused_coarse_row_grads(means, dco, L, scale)}
        want = float64_grads(means, dco, L, scale)
        gpu = paired_rounds(paths, device, rounds=rounds)
        for name, fn in paths.items():
            host = host_ms(fn, device, rounds, busy_cycles)
            lines.append(f"| {label} | {G}, {n}, {D} | {name} | {statistics.median(gpu[name]):.4f} | {host:.4f} "
                         f"| {errors(fn(), want)} |")
            print(lines[-1], flush=True)
        lines.append(f"| | | torch / triton GPU time | {ratio_summary(gpu['torch'], gpu['triton'])} | | | | |")
        if sweep:
            configs = {f"{t} {c} {w}": (lambda t=t, c=c, w=w: fused_coarse_row_grads(
                means, dco, L, scale, tile=t, chunk=c, num_warps=w))
                for t, c, w in itertools.product((16, 32, 64), (16, 32, 64), (2, 4, 8))}
            failed = []
            for key, fn in list(configs.items()):
                try:                    # a setting the compiler refuses (resources) is listed, not timed
                    fn()
                except Exception as err:  # noqa: BLE001
                    failed.append(f"| {n} | " + " | ".join(key.split()) + f" | {type(err).__name__} |")
                    del configs[key]
            times = paired_rounds(configs, device, rounds=max(3, rounds // 4))
            for key, ms in sorted(times.items(), key=lambda kv: statistics.median(kv[1])):
                sweep_lines.append(f"| {n} | " + " | ".join(key.split()) + f" | {statistics.median(ms):.4f} |")
            sweep_lines += failed
            print("\n".join(sweep_lines[-27:]), flush=True)
    return lines, sweep_lines if sweep else []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for bench_coarse_grad.md")
    ap.add_argument("--sweep", action="store_true", help="also time the kernels' tile, chunk and warp settings")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    ap.add_argument("--rounds", type=int, default=20, help="timed rounds (GPU) and calls (host) per path")
    ap.add_argument("--busy-cycles", type=int, default=20_000_000,
                    help="GPU cycles of the spin kernel before each host-timed call (about 10 ms on an H200)")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        device, sizes, args.rounds = torch.device("cpu"), DRY, 2
    elif torch.cuda.is_available():
        device, sizes = torch.device("cuda"), SIZES
    else:
        print("bench_coarse_grad: needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    with torch.no_grad():
        table, sweep = run(sizes, device, args.rounds, args.busy_cycles, args.sweep)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    text = ["# solattn bench: the coarse branch's block gradients, torch products against two Triton kernels", "",
            f"- device: {name}; torch {torch.__version__}; random fp32 means, live lengths 1..64",
            f"- GPU ms: median of {args.rounds} rounds (events, L2 flushed); host ms: median of as many calls "
            "queued behind a spin kernel; errors: largest against float64, absolute / relative to its largest value",
            "", *table, ""] + (["## Kernel launch settings", "", *sweep, ""] if sweep else [])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_coarse_grad.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
