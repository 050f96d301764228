"""Sequence-parallel sol_attn (solattn.distributed) against one device.

    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py --out results/bench_distributed.md
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_distributed.py --device cpu --tiny --out /tmp/d.md

For each sequence length (default: the H3 shape B=1, T=37296, H=56, D=128 bf16 and twice its
length, T=74592), top-k 10%, tail on, backend chosen automatically, forward pass:

1. every rank draws the same whole q, k, v (seeded) and keeps its shard (``shard_lengths``);
   rank 0 gathers the shards back and runs ``solattn.sol_attn`` on one device: median time,
   peak memory above its inputs;
2. ``solattn.distributed.sol_attn`` on the shards: its output shards gathered on rank 0 are
   compared with the one-device output (relative L2); median time (slowest rank) and peak memory
   per device above the shards;
3. the exchange alone with the same tensors: the all-to-all that brings q, k, v in (whole
   sequence, H/P heads) and the one that takes an output-sized tensor back, timed separately;
   and ``solattn.sol_attn`` alone on the H/P-head slice (the attention each rank runs).

Bytes per rank: each all-to-all sends (P-1)/P of the rank's shard of each tensor it carries.
Writes a markdown table to --out (and prints it). On CUDA the whole run takes well under
3 minutes on 2 H200s (mostly Triton's first compilation).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import solattn  # noqa: E402
import solattn.distributed as sd  # noqa: E402
from solattn.distributed.exchange import exchange_in, heads_to_seq  # noqa: E402
from solattn.bench.report import source_revision  # noqa: E402
from solattn import dispatch  # noqa: E402
from solattn.testing import block_structured_qkv, rel_l2  # noqa: E402
from solattn.validation import validate  # noqa: E402



def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "xpu":
        torch.xpu.synchronize(dev)


def median_ms(fn, dev, reps, warmup, barrier=False):
    """Median wall time of ``fn`` in ms (device-synchronised; all ranks start each rep together
    when ``barrier``)."""
    for _ in range(warmup):
        fn()
    sync(dev)
    times = []
    for _ in range(reps):
        if barrier:
            dist.barrier()
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_extra_gib(fn, dev):
    """Peak device memory allocated during one call above what was allocated before (GiB);
    None where the device has no allocator statistics (CPU)."""
    if dev.type != "cuda":
        fn()
        return None
    sync(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    out = fn()
    sync(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    del out
    return peak / 2**30


def reduce_max(x: float, dev) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=dev if dev.type != "cpu" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def fmt(x, spec=".1f"):
    return "n/a" if x is None else format(x, spec)


def run_length(T, args, dev, rank, world):
    B, H, D, dtype = 1, args.heads, args.head_dim, args.dtype
    kw = dict(topk_ratio=args.topk, tail=True)
    lens = sd.shard_lengths(T, world)
    sl = slice(sum(lens[:rank]), sum(lens[:rank + 1]))
    whole = block_structured_qkv(B, T, H, D, dtype, dev, seed=T, spread=2.0, normalise=True)
    shards = [x[:, sl].clone() for x in whole]
    del whole
    row = dict(T=T, lens=lens)

    # 1. one device, on the gathered shards
    gathered = [sd.gather(x) for x in shards]
    ref = None
    if rank == 0:
        row["backend"] = dispatch.choose(validate(*gathered, **kw)).name
        row["single_ms"] = median_ms(lambda: solattn.sol_attn(*gathered, **kw), dev, args.reps, args.warmup)
        row["single_peak"] = peak_extra_gib(lambda: solattn.sol_attn(*gathered, **kw), dev)
        row["single_inputs"] = 3 * gathered[0].numel() * gathered[0].element_size() / 2**30
        ref = solattn.sol_attn(*gathered, **kw)
    del gathered
    dist.barrier()

    # 2. distributed: correctness, time, memory
    def distributed():
        return sd.sol_attn(*shards, **kw)

    out = sd.gather(distributed())
    if rank == 0:
        a, b = out.double(), ref.double()
        row["rel_l2"] = rel_l2(a, b)
        row["max_abs"] = (a - b).abs().max().item()
    del out, ref
    row["dist_ms"] = reduce_max(median_ms(distributed, dev, args.reps, args.warmup, barrier=True), dev)
    peak = peak_extra_gib(distributed, dev)
    row["dist_peak"] = None if peak is None else reduce_max(peak, dev)
    row["dist_inputs"] = 3 * shards[0].numel() * shards[0].element_size() / 2**30

    # 3. the exchange alone, same tensors (and the H/P-head attention each rank runs)
    heads = exchange_in(list(shards), lens, rank, world, None)
    row["a2a_in_ms"] = reduce_max(median_ms(lambda: exchange_in(list(shards), lens, rank, world, None),
                                            dev, args.reps, args.warmup, barrier=True), dev)
    local_out = solattn.sol_attn(*heads, **kw)
    row["a2a_out_ms"] = reduce_max(median_ms(lambda: heads_to_seq(local_out, lens, rank, world, None),
                                             dev, args.reps, args.warmup, barrier=True), dev)
    row["attn_ms"] = reduce_max(median_ms(lambda: solattn.sol_attn(*heads, **kw), dev, args.reps,
                                          args.warmup, barrier=True), dev)
    esize = shards[0].element_size()
    row["bytes_in"] = 3 * B * max(lens) * H * D * esize * (world - 1) / world
    row["bytes_out"] = B * max(lens) * H * D * esize * (world - 1) / world
    del heads, local_out, shards
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def table(rows, args, world, dev):
    dname = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
    lines = [
        f"# solattn.distributed.sol_attn vs one device ({world} x {dname})",
        "",
        f"source {source_revision()}, torch {torch.__version__}, "
        f"{dist.get_backend()} backend, B=1, H={args.heads}, D={args.head_dim}, "
        f"{str(args.dtype).replace('torch.', '')}, top-k {args.topk:g}, tail on, forward, "
        f"median of {args.reps} (after {args.warmup} warm-up); distributed times are the slowest rank's.",
        "",
        "| T | shards | backend | 1 device ms | P devices ms | speed-up | all-to-all in ms | all-to-all out ms "
        "| attention H/P heads ms | MiB sent per rank (in + out) | GB/s per rank | "
        "peak GiB 1 device (inputs + extra) | peak GiB per device (shards + extra) | rel. L2 vs 1 device |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        comm_ms = r["a2a_in_ms"] + r["a2a_out_ms"]
        sent = r["bytes_in"] + r["bytes_out"]
        peak1 = "n/a" if r["single_peak"] is None else f"{r['single_inputs']:.2f} + {r['single_peak']:.2f}"
        peakp = "n/a" if r["dist_peak"] is None else f"{r['dist_inputs']:.2f} + {r['dist_peak']:.2f}"
        lines.append(
            f"| {r['T']} | {'/'.join(map(str, r['lens']))} | {r['backend']} | {r['single_ms']:.2f} "
            f"| {r['dist_ms']:.2f} | {r['single_ms'] / r['dist_ms']:.2f}x | {r['a2a_in_ms']:.2f} "
            f"| {r['a2a_out_ms']:.2f} | {r['attn_ms']:.2f} | {sent / 2**20:.1f} "
            f"| {sent / (comm_ms * 1e-3) / 1e9:.1f} | {peak1} | {peakp} | {r['rel_l2']:.1e} |")
    lines += ["", "Memory columns: what the inputs (q, k, v) occupy plus the peak allocated above them "
              "during one call (output, exchange buffers, attention workspace)."]
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="markdown file to write (rank 0)")
    p.add_argument("--device", choices=["cuda", "xpu", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="T=1000 and 2000, H=4, D=32, fp32, 2 reps")
    p.add_argument("--lengths", type=int, nargs="+", default=[37296, 74592])
    p.add_argument("--heads", type=int, default=56)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--topk", type=float, default=0.1)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    args.dtype = torch.bfloat16
    if args.tiny:
        args.lengths, args.heads, args.head_dim, args.reps, args.warmup = [1000, 2000], 4, 32, 2, 1
        args.dtype = torch.float32

    rank, world, dev = sd.init_from_env(args.device, timeout=timedelta(minutes=5))
    if args.heads % world:
        sys.exit(f"--heads {args.heads} is not divisible by the number of processes {world}")

    rows = []
    t0 = time.time()
    for T in args.lengths:
        rows.append(run_length(T, args, dev, rank, world))
        if rank == 0:
            print(f"T={T} done after {time.time() - t0:.0f} s", flush=True)
    if rank == 0:
        text = table(rows, args, world, dev)
        print(text)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    sd.destroy_and_exit(0)


if __name__ == "__main__":
    main()
