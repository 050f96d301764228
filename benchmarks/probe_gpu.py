"""Where the end-to-end time of ``sol_attn`` goes on a GPU: plan stages, backends, SDPA mask dtypes.

    PYTHONPATH=. python benchmarks/probe_gpu.py [--out DIR]

Prints a table and writes probe_gpu.md under --out. Timings: median of
``triton.testing.do_bench`` (CUDA events), inputs with per-block offsets so routing is
meaningful. Not a test: figures only.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import solattn
from solattn.validation import validate
from solattn import routing
from solattn.backends.sdpa import sdpa_forward


def make(B, T, H, D, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = math.ceil(T / 64)
    out = []
    for _ in range(3):
        off = torch.randn(B, n, H, D, device="cuda", generator=g).repeat_interleave(64, 1)[:, :T]
        out.append(((torch.randn(B, T, H, D, device="cuda", generator=g) * 0.5 + off) * D ** -0.25).bfloat16())
    return out


def ms(fn):
    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    lines = ["| shape | what | ms |", "|---|---|---|"]

    def row(shape, what, t):
        lines.append(f"| {shape} | {what} | {t:.3f} |")
        print(f"{shape:>6} {what:<48} {t:9.3f} ms", flush=True)

    for name, (B, T, H, D) in (("seed", (2, 4056, 16, 128)), ("H3", (1, 37296, 56, 128))):
        q, k, v = make(B, T, H, D)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        row(name, "dense F.sdpa", ms(lambda: F.scaled_dot_product_attention(qt, kt, vt)))
        for tail in (False, True):
            p = validate(q, k, v, topk_ratio=0.1, tail=tail)
            stats = routing.block_stats(p)
            exact = routing.select_exact(p, stats)
            plan = routing.build_plan(p)
            if not tail:
                row(name, "plan: block_stats", ms(lambda: routing.block_stats(p)))
                row(name, "plan: select_exact", ms(lambda: routing.select_exact(p, stats)))
                row(name, "plan: indices_from_mask", ms(lambda: routing.indices_from_mask(exact)))
            row(name, f"plan: build_plan tail={tail}", ms(lambda: routing.build_plan(p)))
            row(name, f"sdpa backend (plan given) tail={tail}", ms(lambda: sdpa_forward(p, plan)))
            for b in ("triton", "sdpa"):
                row(name, f"sol_attn end to end, {b}, tail={tail}",
                    ms(lambda: solattn.sol_attn(q, k, v, topk_ratio=0.1, tail=tail, backend=b)))
        # does the CUDA SDPA take an fp32 additive mask with bf16 inputs, and at what cost?
        nr, L = 256, 60 * 64
        qq = torch.randn(nr, 1, 64, D, device="cuda", dtype=torch.bfloat16)
        kk = torch.randn(nr, 1, L, D, device="cuda", dtype=torch.bfloat16)
        vv = torch.randn(nr, 1, L, D, device="cuda", dtype=torch.bfloat16)
        for mname, mask in (("none", None),
                            ("bf16 (nr,1,1,L)", torch.zeros(nr, 1, 1, L, device="cuda", dtype=torch.bfloat16)),
                            ("fp32 (nr,1,1,L)", torch.zeros(nr, 1, 1, L, device="cuda"))):
            try:
                row(name, f"F.sdpa on gathered ({nr} x 64 x {L}), mask {mname}",
                    ms(lambda: F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask)))
            except Exception as e:  # report what the device refuses
                lines.append(f"| {name} | mask {mname} | refused: {type(e).__name__}: {str(e)[:80]} |")
                print("mask", mname, "refused:", e, flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "probe_gpu.md"), "w") as f:
        f.write(f"# probe_gpu on {torch.cuda.get_device_name()} (torch {torch.__version__})\n\n")
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
