"""Sequence-parallel sol_attn (solattn.distributed) against one device, with the exchange's
bandwidth alone and the overlap of the pipelined exchange.

    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py --out benchmarks/results/h200x2/bench_distributed.md
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_distributed.py --device cpu --tiny --out /tmp/d.md

For each sequence length (default: the H3 shape B=1, T=37296, H=56, D=128 bf16 and twice its
length), top-k 10 %, tail on, backend chosen automatically:

1. one device (rank 0, on the gathered shards): forward, and forward + backward (``--backward``);
2. the parts, each alone, on every rank: the attention each rank runs (``solattn.sol_attn`` on
   the whole sequence with H/P heads: A), and a bare ``all_to_all_single`` of the bytes the
   exchange moves (q, k, v in: C_in; the output back: C_out), from which the per-rank
   bandwidth; C = C_in + C_out (the backward moves the same bytes the other way);
3. ``solattn.distributed.sol_attn`` for each ``--groups`` value (1 = one exchange each way, no
   overlap): its time (slowest rank), the speed-up over one device, and how much of the
   smaller of A and C it hid: ``hidden = (A + C - E) / min(A, C)`` (1 = the ideal
   ``E = max(A, C)``, 0 = no overlap), its output against one device (relative L2).

Writes a markdown table to --out (and prints it).
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
from solattn.bench.timing import flush_l2, synchronize as sync  # noqa: E402
from solattn import dispatch  # noqa: E402
from solattn.bench.report import source_revision  # noqa: E402
from solattn.testing import block_structured_qkv, rel_l2  # noqa: E402
from solattn.validation import validate  # noqa: E402


def median_ms(fn, dev, reps, warmup, barrier=False):
    """Median wall time of ``fn`` in ms (device-synchronised, L2 flushed as in
    ``solattn.bench.timing``; all ranks start each rep together when ``barrier``)."""
    for _ in range(warmup):
        fn()
    sync(dev)
    times = []
    for _ in range(reps):
        flush_l2(dev)
        if barrier:
            dist.barrier()
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def reduce_max(x: float, dev) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=dev if dev.type != "cpu" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def fwd_bwd(fn, leaves):
    def run():
        out = fn(*leaves)
        out.backward(torch.ones_like(out))
        for x in leaves:
            x.grad = None
    return run


def run_length(T, args, dev, rank, world):
    B, H, D, dtype = 1, args.heads, args.head_dim, args.dtype
    kw = dict(topk_ratio=args.topk, tail=True)
    lens = sd.shard_lengths(T, world)
    sl = slice(sum(lens[:rank]), sum(lens[:rank + 1]))
    whole = block_structured_qkv(B, T, H, D, dtype, dev, seed=T, spread=2.0, normalise=True)
    shards = [x[:, sl].clone() for x in whole]
    del whole
    row = dict(T=T, lens=lens, bwd=args.backward)

    # 1. one device, on the gathered shards
    gathered = [sd.gather(x) for x in shards]
    ref = None
    if rank == 0:
        row["backend"] = dispatch.choose(validate(*gathered, **kw)).name
        row["single_ms"] = median_ms(lambda: solattn.sol_attn(*gathered, **kw), dev, args.reps, args.warmup)
        if args.backward:
            leaves = [x.clone().requires_grad_() for x in gathered]
            row["single_fb_ms"] = median_ms(fwd_bwd(lambda *x: solattn.sol_attn(*x, **kw), leaves), dev,
                                            args.reps, args.warmup)
        ref = solattn.sol_attn(*gathered, **kw)
    del gathered
    dist.barrier()

    # 2. the parts alone: attention on H/P heads, bare all-to-alls of the exchanged bytes
    hp = H // world
    heads = [torch.randn(B, T, hp, D, device=dev).to(dtype) for _ in range(3)]
    row["attn_ms"] = reduce_max(median_ms(lambda: solattn.sol_attn(*heads, **kw), dev, args.reps,
                                          args.warmup, barrier=True), dev)
    if args.backward:
        leaves = [x.requires_grad_() for x in heads]
        row["attn_fb_ms"] = reduce_max(median_ms(fwd_bwd(lambda *x: solattn.sol_attn(*x, **kw), leaves), dev,
                                                 args.reps, args.warmup, barrier=True), dev)
    del heads
    per = max(lens) * B * hp * D      # elements per (rank, rank) block of one tensor
    for name, m in (("in", 3), ("out", 1)):
        send = torch.zeros(world * per * m, dtype=dtype, device=dev)
        recv = torch.empty_like(send)
        row[f"a2a_{name}_ms"] = reduce_max(median_ms(lambda: dist.all_to_all_single(recv, send), dev, args.reps,
                                                     args.warmup, barrier=True), dev)
        row[f"bytes_{name}"] = (world - 1) * per * m * send.element_size()
        del send, recv

    # 3. the distributed call, for each number of head groups
    row["groups"] = {}
    for G in args.groups:
        def distributed():
            return sd.sol_attn(*shards, **kw, head_groups=G)
        r = {}
        out = sd.gather(distributed())
        if rank == 0:
            r["rel_l2"] = rel_l2(out, ref)
        del out
        r["ms"] = reduce_max(median_ms(distributed, dev, args.reps, args.warmup, barrier=True), dev)
        if args.backward:
            leaves = [x.clone().requires_grad_() for x in shards]
            r["fb_ms"] = reduce_max(median_ms(fwd_bwd(lambda *x: sd.sol_attn(*x, **kw, head_groups=G), leaves),
                                              dev, args.reps, args.warmup, barrier=True), dev)
        row["groups"][G] = r
    del ref, shards
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def hidden(a, c, e):
    return (a + c - e) / min(a, c)


def table(rows, args, world, dev):
    dname = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
    lines = [
        f"# solattn.distributed.sol_attn vs one device ({world} x {dname})",
        "",
        f"source {source_revision()}, torch {torch.__version__}, {dist.get_backend()} backend, B=1, "
        f"H={args.heads}, D={args.head_dim}, {str(args.dtype).replace('torch.', '')}, top-k {args.topk:g}, "
        f"tail on; median of {args.reps} (after {args.warmup} warm-up); distributed times are the "
        "slowest rank's.",
        "",
        "## The parts alone",
        "",
        "A: `sol_attn` on the whole sequence with H/P heads (what each rank attends). C_in, C_out: a bare "
        "`all_to_all_single` of the bytes the exchange moves in (q, k, v) and out (the output); GB/s: "
        "bytes each rank sends to the others / time.",
        "",
        "| T | shards | backend | 1 device ms | A ms | C_in ms | C_out ms | MiB sent per rank (in + out) "
        "| GB/s per rank (in / out) | max(A, C) ms | A + C ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = r["a2a_in_ms"] + r["a2a_out_ms"]
        lines.append(
            f"| {r['T']} | {'/'.join(map(str, r['lens']))} | {r['backend']} | {r['single_ms']:.2f} "
            f"| {r['attn_ms']:.2f} | {r['a2a_in_ms']:.2f} | {r['a2a_out_ms']:.2f} "
            f"| {(r['bytes_in'] + r['bytes_out']) / 2**20:.1f} "
            f"| {r['bytes_in'] / r['a2a_in_ms'] / 1e6:.1f} / {r['bytes_out'] / r['a2a_out_ms'] / 1e6:.1f} "
            f"| {max(r['attn_ms'], c):.2f} | {r['attn_ms'] + c:.2f} |")
    lines += ["", "## End to end, by head groups", "",
              "E: `solattn.distributed.sol_attn(..., head_groups=G)`; G = 1 exchanges once each way (no "
              "overlap). hidden = (A + C - E) / min(A, C): the share of the smaller term the overlap "
              "hid (1 = E reaches max(A, C)). Forward + backward: the same with A, C of both passes "
              "(the backward moves the same bytes, C doubles).", "",
              "| T | G | E forward ms | speed-up | hidden | E fwd+bwd ms | 1 device fwd+bwd ms | speed-up "
              "| hidden | rel. L2 vs 1 device |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["a2a_in_ms"] + r["a2a_out_ms"]
        for G, g in r["groups"].items():
            fb = ["n/a"] * 4
            if r["bwd"]:
                fb = [f"{g['fb_ms']:.2f}", f"{r['single_fb_ms']:.2f}", f"{r['single_fb_ms'] / g['fb_ms']:.2f}x",
                      f"{hidden(r['attn_fb_ms'], 2 * c, g['fb_ms']):.2f}"]
            lines.append(f"| {r['T']} | {G} | {g['ms']:.2f} | {r['single_ms'] / g['ms']:.2f}x "
                         f"| {hidden(r['attn_ms'], c, g['ms']):.2f} | {' | '.join(fb)} | {g['rel_l2']:.1e} |")
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
    p.add_argument("--groups", type=int, nargs="+", default=[1, 2, 4, 7, 14],
                   help="head_groups values to time (1 = no overlap)")
    p.add_argument("--no-backward", dest="backward", action="store_false", help="forward only")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    args.dtype = torch.bfloat16
    if args.tiny:
        args.lengths, args.heads, args.head_dim, args.reps, args.warmup = [1000, 2000], 4, 32, 2, 1
        args.groups, args.dtype = [1, 2], torch.float32

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
