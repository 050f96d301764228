"""Sequence-parallel sol_attn and VSA over torch.distributed, checked against one device.

    torchrun --nproc-per-node 2 examples/distributed_sol_attn.py              # GPUs if present
    torchrun --standalone --nproc-per-node 2 examples/distributed_sol_attn.py --device cpu

Every rank builds the same whole inputs (same seed), keeps its shard of the sequence, and calls
``solattn.distributed``; rank 0 then gathers the output shards and compares them with the
single-device functions on the whole inputs.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import solattn  # noqa: E402
import solattn.distributed as sd  # noqa: E402
from solattn.testing import block_structured_qkv  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "xpu", "cpu"], default=None,
                   help="default: cuda if available, else xpu if available, else cpu")
    p.add_argument("--grid", type=int, nargs=3, default=(8, 12, 20), help="video latent (t, h, w)")
    p.add_argument("--prefix", type=int, default=77, help="prefix (text) tokens before the video")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    args = p.parse_args()
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:   # started plainly: torch's rendezvous would fail with a traceback
        sys.exit(f"{os.path.basename(__file__)}: the torchrun environment is missing ({', '.join(missing)} "
                 "unset); run me with torchrun --nproc-per-node N, e.g.\n"
                 f"    torchrun --standalone --nproc-per-node 2 {sys.argv[0]} --device cpu")

    rank, world, dev = sd.init_from_env(args.device)   # nccl / xccl / gloo, this rank's device
    device = dev.type

    t, h, w = args.grid
    T = args.prefix + t * h * w
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    q, k, v = block_structured_qkv(1, T, args.heads, args.head_dim, dtype, dev, seed=0, normalise=True)
    gate = 0.1 * torch.randn(1, T, args.heads, args.head_dim, generator=torch.Generator().manual_seed(1))
    gate = gate.to(dtype=dtype, device=dev)

    # this rank's shard of the sequence: ceil(T / world) tokens, the last rank a shorter one
    q_r, k_r, v_r, gate_r = (sd.shard(x) for x in (q, k, v, gate))
    lens = sd.shard_lengths(T, world)

    runs = [
        ("sol_attn top-k 10%, coarse gate",
         lambda: sd.sol_attn(q_r, k_r, v_r, topk_ratio=0.1, coarse_gate=gate_r, shard_lens=lens),
         lambda: solattn.sol_attn(q, k, v, topk_ratio=0.1, coarse_gate=gate)),
        ("video_sparse_attn, prefix + grid, sparsity 0.75",
         lambda: sd.video_sparse_attn(q_r, k_r, v_r, (t, h, w), gate=gate_r, sparsity=0.75,
                                      prefix_len=args.prefix),
         lambda: solattn.video_sparse_attn(q, k, v, (t, h, w), gate=gate, sparsity=0.75,
                                           prefix_len=args.prefix)),
    ]
    failed = False
    for name, distributed, single in runs:
        out_r = distributed()                      # (1, T_r, H, D): this rank's tokens, all heads
        out = sd.gather(out_r)                     # every rank's shard, for the check only
        if rank == 0:
            want = single()
            err = ((out.double() - want.double()).norm() / want.double().norm()).item()
            ok = err < tol
            failed |= not ok
            print(f"{name}: {world} ranks, shards {lens} of T={T}, H={args.heads}, D={args.head_dim} "
                  f"{str(dtype).replace('torch.', '')} on {device}: rel. L2 vs one device {err:.2e} "
                  f"-> {'OK' if ok else 'MISMATCH'}", flush=True)
    sd.destroy_and_exit(1 if failed else 0)    # after rank 0's check (a barrier); see its docstring


if __name__ == "__main__":
    main()
