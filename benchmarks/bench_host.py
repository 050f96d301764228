"""Host time of one eager call: ``video_sparse_attn`` and ``sol_attn`` on the ``triton`` backend,
forward and forward + backward, with the GPU kept busy so that the call never waits for it.

    python benchmarks/bench_host.py --out DIR               # a CUDA GPU: H3 and 8192-token shapes, ~1 min
    python benchmarks/bench_host.py --dry-run --out DIR     # tiny shapes on the CPU (TRITON_INTERPRET=1)
    python benchmarks/bench_host.py --only "H3 VSA" --profile --out DIR   # and where its host time goes

Each timed call is queued behind a GPU spin kernel (``torch.cuda._sleep``) longer than the call's
host work, and timed with ``time.perf_counter`` without synchronising: what the Python side of the
call costs (validation, routing plan set-up, launches), not the GPU's work, which the ``gpu ms``
column gives (synchronised, as the other benchmarks time it). Per row also the SHA-256 of the
output's bytes (forward) or of the gradients' (forward + backward): equal digests at two commits
mean bit-identical results. The script uses the public API only, so it runs against an older
checkout too (``PYTHONPATH=OLD python benchmarks/bench_host.py ...``). Writes bench_host.md to --out.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import solattn  # noqa: E402
from solattn.bench.parsing import VSAProblem  # noqa: E402
from solattn.bench.vsa import vsa_inputs  # noqa: E402
from solattn.testing import make_qkv  # noqa: E402

#: (label, VSA problem or None for sol_attn top-k 10 % at the problem's T): B=1, H=56, D=128
PROBLEMS = [("H3 VSA: 432 + 16x48x48, 58 tiles, gate", VSAProblem(1, 56, 128, (16, 48, 48), 58, prefix=432)),
            ("8192 VSA: 8x32x32, 13 tiles, gate", VSAProblem(1, 56, 128, (8, 32, 32), 13)),
            ("H3 sol_attn: top-k 10 %", VSAProblem(1, 56, 128, (16, 48, 48), 58, prefix=432, gate=False))]
DRY = [("tiny VSA: 70 + 2x8x8, 2 tiles, gate", VSAProblem(1, 2, 64, (2, 8, 8), 2, prefix=70)),
       ("tiny sol_attn: top-k 10 %", VSAProblem(1, 2, 64, (2, 8, 8), 2, prefix=70, gate=False))]


def call_of(label: str, p: VSAProblem, device: torch.device):
    """``(inputs, call)``: the bf16 inputs (q, k, v, gate or None) and ``call(q, k, v, gate)``."""
    if "sol_attn" in label:
        q, k, v = make_qkv(p.B, p.T, p.H, p.D, dtype=torch.bfloat16, device=device, seed=0)
        return (q, k, v, None), lambda q, k, v, g: solattn.sol_attn(q, k, v, topk_ratio=0.1, tail=False,
                                                                    backend="triton")
    inputs = vsa_inputs(p, torch.bfloat16, device)
    return inputs, lambda q, k, v, g: solattn.video_sparse_attn(q, k, v, p.grid, topk=p.topk, gate=g,
                                                                prefix_len=p.prefix, backend="triton")


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        if t is not None:
            h.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def measure(fn, device: torch.device, repeats: int, busy_cycles: int):
    """``(host ms, gpu ms)``: medians of ``repeats`` calls, each queued behind a spin kernel (host),
    and of as many synchronised calls (GPU)."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    host, gpu = [], []
    for _ in range(repeats):
        sync()
        if cuda:
            torch.cuda._sleep(busy_cycles)
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        gpu.append(time.perf_counter() - t0)
    return statistics.median(host) * 1e3, statistics.median(gpu) * 1e3


def run(problems, device: torch.device, repeats: int, busy_cycles: int, profile: bool = False):
    rows = []
    for label, p in problems:
        (q, k, v, gate), call = call_of(label, p, device)
        dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(q.dtype).to(device)
        leaves = [None if x is None else x.detach().requires_grad_(True) for x in (q, k, v, gate)]

        def forward():
            with torch.no_grad():
                return call(q, k, v, gate)

        def step():
            for x in leaves:
                if x is not None:
                    x.grad = None
            call(*leaves).backward(dout)

        for name, fn in (("forward", forward), ("forward + backward", step)):
            for _ in range(3):                                   # compile, caches
                fn()
            host, gpu = measure(fn, device, repeats, busy_cycles)
            result = [forward()] if name == "forward" else [x.grad for x in leaves if x is not None]
            rows.append((label, name, host, gpu, digest(result)))
            print(f"{label} {name}: host {host:.3f} ms, gpu {gpu:.3f} ms, sha {rows[-1][-1]}", flush=True)
            if profile:
                print(host_profile(fn), flush=True)
    return rows


def host_profile(fn, rows: int = 40) -> str:
    """One call under the PyTorch profiler (CPU side, every thread: the backward runs on autograd's
    device thread), Python functions included, as a table by self CPU time."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        fn()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def markdown(rows, device: torch.device, repeats: int) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    lines = ["# solattn bench: host time of one eager call (triton backend)", "",
             f"- device: {name}; torch {torch.__version__}; B=1, H=56, D=128, bf16 (tiny shapes on the CPU)",
             f"- median of {repeats} calls; host ms: perf_counter around a call queued behind a GPU spin "
             "kernel (no synchronisation); gpu ms: synchronised calls", "",
             "| problem | pass | host ms | gpu ms | result sha-256 |", "|---|---|---|---|---|"]
    lines += [f"| {label} | {what} | {host:.3f} | {gpu:.3f} | `{sha}` |" for label, what, host, gpu, sha in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for bench_host.md")
    ap.add_argument("--repeats", type=int, default=20, help="timed calls per row (median)")
    ap.add_argument("--busy-cycles", type=int, default=100_000_000,
                    help="GPU cycles of the spin kernel before each host-timed call (about 50 ms on an H200)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    ap.add_argument("--profile", action="store_true",
                    help="also print each row's host time by function and op (one call under the PyTorch profiler)")
    ap.add_argument("--only", default="", help="rows whose problem contains this text (e.g. 'H3 VSA')")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        device, problems = torch.device("cpu"), DRY
    elif torch.cuda.is_available():
        device, problems = torch.device("cuda"), PROBLEMS
    else:
        ap.error("needs a CUDA GPU (or --dry-run)")
    problems = [(label, p) for label, p in problems if args.only in label]
    rows = run(problems, device, args.repeats, args.busy_cycles, args.profile)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_host.md"), "w") as f:
        f.write(markdown(rows, device, args.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
