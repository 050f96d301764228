"""How many key-block loads two query blocks could share: for each pair of neighbouring query blocks
(2i, 2i + 1) of one (batch, head), the key blocks both lists hold, as a fraction of all listed
blocks. A kernel that gives one program such a pair (``benchmarks/kernel_pingpong.py``) and loads a
co-listed block once would move that fraction fewer key and value bytes; the attention kernel's
time at H3 follows its key and value bytes (``notes_triton.md``, session 16).

Runs the torch plan on the CPU, on the inputs the H3 benchmarks use (``make_qkv``, seed 0).

    python benchmarks/diag/shared_blocks.py [--T 37296] [--H 56]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from solattn.routing import build_plan  # noqa: E402
from solattn.testing import make_qkv  # noqa: E402
from solattn.validation import validate  # noqa: E402

MODES = (("top-k 10 %", dict(topk_ratio=0.1, tail=False)),
         ("top-k 20 %", dict(topk_ratio=0.2, tail=False)),
         ("tau 1 + tail", dict(tau=1.0, tail=True)))


def shared_fraction(plan) -> tuple:
    """(listed blocks, blocks listed by both query blocks of a pair, whether every list is sorted)."""
    listed = shared = 0
    ordered = True
    num, idx = plan.kv_num_blocks, plan.kv_indices
    for row_num, row_idx in zip(num.reshape(-1, num.shape[-1]), idx.reshape(-1, *idx.shape[-2:])):
        for i in range(0, row_num.shape[0] - 1, 2):
            a = row_idx[i, :row_num[i]]
            b = row_idx[i + 1, :row_num[i + 1]]
            ordered &= bool((a[1:] > a[:-1]).all()) and bool((b[1:] > b[:-1]).all())
            listed += a.numel() + b.numel()
            shared += int(torch.isin(a, b).sum())
    return listed, shared, ordered


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=37296)
    ap.add_argument("--H", type=int, default=56)
    args = ap.parse_args()
    q, k, v = make_qkv(1, args.T, args.H, 128, dtype=torch.bfloat16, seed=0)
    print(f"B=1, T={args.T}, H={args.H}, D=128, bf16, make_qkv seed 0 (torch plan on the CPU)\n")
    print("| mode | listed blocks | co-listed in a pair | loads a shared pair would save | lists sorted |")
    print("|---|---|---|---|---|")
    for label, kw in MODES:
        with torch.no_grad():
            listed, shared, ordered = shared_fraction(build_plan(validate(q, k, v, **kw)))
        print(f"| {label} | {listed} | {shared} | {shared / listed:.1%} | {ordered} |", flush=True)


if __name__ == "__main__":
    main()
