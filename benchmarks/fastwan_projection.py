"""Project one FastWan sampling step from rates measured on this machine.

    python benchmarks/fastwan_projection.py [--device cpu] [--dtype float32] [--tokens 4096]

Measured here (each the best of ``--repeats`` timed runs after a warm-up):

- the linear-layer rate: ``(tokens, dim) @ (dim, ffn)`` GEMMs (FLOP/s);
- self-attention at the model's own latent grid (``--model``, default FastWan2.1-T2V-1.3B at its
  default clip: 16 x 28 x 52 = 23,296 tokens, 364 cubes, top-k 73) on ``--attn-heads`` heads of
  128, dense (``scaled_dot_product_attention``) and VSA (:func:`solattn.video_sparse_attn` at the
  model's sparsity, with a gate, coarse stage included) timed side by side, alternating, in the
  same process on the same inputs.

Projected from them (not measured): one step of the model: per block the linear layers (q, k, v,
o, gate; cross-attention q, o; the FFN) at the measured GEMM rate and the self-attention dense or
VSA (the measured time scaled from ``--attn-heads`` to the model's heads: heads are independent),
times the blocks. Text cross-attention (512 keys) is counted as linear work only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import time

import torch

MODELS = {
    # name: (blocks, heads, dim, ffn, grid, sparsity)
    "FastWan2.1-T2V-1.3B": (30, 12, 1536, 8960, (16, 28, 52), 0.8),
    "FastWan2.1-T2V-14B": (40, 40, 5120, 13824, (16, 28, 52), 0.9),
    "FastWan2.2-TI2V-5B": (30, 24, 3072, 14336, (31, 22, 40), 0.8),
}


def best(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def best_pair(fa, fb, repeats):
    """Best times of ``fa`` and ``fb``, run alternately (a warm-up each first), so that both see
    the same machine load."""
    fa()
    fb()
    ta, tb = [], []
    for _ in range(repeats):
        for fn, times in ((fa, ta), (fb, tb)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return min(ta), min(tb)


def load_average():
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):     # not on Windows
        return None


def cubes(grid):
    return math.prod(-(-n // 4) for n in grid)


def topk(sparsity, n):
    return max(1, min(math.ceil((1 - sparsity) * n), n))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--tokens", type=int, default=4096, help="tokens of the measured GEMM")
    p.add_argument("--attn-heads", type=int, default=2, help="heads of the measured attention (scaled to the model's)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--model", default="FastWan2.1-T2V-1.3B", choices=sorted(MODELS))
    args = p.parse_args(argv)
    import solattn
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    blocks, heads, dim, ffn, grid, sparsity = MODELS[args.model]
    torch.manual_seed(0)
    n = args.tokens
    with torch.no_grad():
        a, w = torch.randn(n, dim, device=dev, dtype=dtype), torch.randn(dim, ffn, device=dev, dtype=dtype)
        gemm = best(lambda: a @ w, args.repeats)
        gemm_rate = 2 * n * dim * ffn / gemm
        s = math.prod(grid)
        ha = args.attn_heads
        q, k, v, g = (torch.randn(1, s, ha, 128, device=dev, dtype=dtype) for _ in range(4))
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        load_before = load_average()
        dense, vsa = best_pair(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt),
                               lambda: solattn.video_sparse_attn(q, k, v, grid, sparsity=sparsity, gate=g),
                               args.repeats)
        load_after = load_average()
    c = cubes(grid)
    linear_flops = 2 * s * dim * dim * (5 + 2) + 2 * 2 * s * dim * ffn      # self q k v o gate, cross q o, FFN
    linear = linear_flops / gemm_rate
    attn_dense = dense * heads / ha
    attn_vsa = vsa * heads / ha
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    out = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch "
                   f"{torch.__version__}, {args.device} {args.dtype}, solattn {commit}",
        "load_average_1min": {"before_attention": load_before, "after_attention": load_after},
        "measured": {"gemm_gflops": gemm_rate / 1e9,
                     "attention_grid": grid, "attention_heads": ha, "dense_sdpa_s": dense, "vsa_s": vsa,
                     "dense_over_vsa": dense / vsa, "dense_sdpa_gflops": 4 * s * s * 128 * ha / dense / 1e9},
        "projected": {"model": args.model, "grid": grid, "tokens": s, "cubes": c, "topk": topk(sparsity, c),
                      "per_block_linear_s": linear, "per_block_attention_dense_s": attn_dense,
                      "per_block_attention_vsa_s": attn_vsa,
                      "step_dense_s": blocks * (linear + attn_dense), "step_vsa_s": blocks * (linear + attn_vsa)},
    }
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
