"""Project one FastWan sampling step from rates measured on this machine.

    python benchmarks/fastwan_projection.py [--device cpu] [--dtype float32] [--tokens 4096]

Measured here (each the best of ``--repeats`` timed runs after a warm-up):

- the linear-layer rate: ``(tokens, dim) @ (dim, ffn)`` GEMMs (FLOP/s);
- dense attention: ``scaled_dot_product_attention`` on ``(1, heads, tokens, 128)`` (FLOP/s);
- VSA: :func:`solattn.video_sparse_attn` at sparsity 0.8 on a ``(t, 16, 16)`` grid of ``tokens``
  tokens with a gate: seconds per kept (query cube, key cube) pair of 64 x 64 tokens, its
  coarse stage included.

Projected from them (not measured): one step of the model (``--model``, default FastWan2.1-T2V-1.3B
at its default clip, grid 16 x 28 x 52 = 23,296 tokens, 364 cubes, top-k 73): per block the
linear layers (q, k, v, o, gate; cross-attention q, o; the FFN) at the measured GEMM rate and the
self-attention dense (at the measured attention rate) or VSA (at the measured cost per kept cube
pair), times the blocks. Text cross-attention (512 keys) is counted as linear work only.
"""

from __future__ import annotations

import argparse
import json
import math
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


def cubes(grid):
    return math.prod(-(-n // 4) for n in grid)


def topk(sparsity, n):
    return max(1, min(math.ceil((1 - sparsity) * n), n))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--tokens", type=int, default=4096, help="tokens of the measured shapes (a multiple of 256)")
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
        q, k, v = (torch.randn(1, heads, n, 128, device=dev, dtype=dtype) for _ in range(3))
        dense = best(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), args.repeats)
        dense_rate = 4 * n * n * 128 * heads / dense
        mgrid = (n // 256, 16, 16)
        qs, ks, vs, gs = (t.transpose(1, 2).contiguous() for t in (q, k, v, torch.randn_like(q)))
        vsa = best(lambda: solattn.video_sparse_attn(qs, ks, vs, mgrid, sparsity=sparsity, gate=gs), args.repeats)
        m_cubes = cubes(mgrid)
        per_pair = vsa / (m_cubes * topk(sparsity, m_cubes) * heads)
    s = math.prod(grid)
    c = cubes(grid)
    linear_flops = 2 * s * dim * dim * (5 + 2) + 2 * 2 * s * dim * ffn      # self q k v o gate, cross q o, FFN
    linear = linear_flops / gemm_rate
    attn_dense = 4 * s * s * 128 * heads / dense_rate
    attn_vsa = c * topk(sparsity, c) * heads * per_pair
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    out = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch "
                   f"{torch.__version__}, {args.device} {args.dtype}, solattn {commit}",
        "measured": {"gemm_gflops": gemm_rate / 1e9, "dense_attention_gflops": dense_rate / 1e9,
                     "vsa_seconds": vsa, "vsa_grid": mgrid, "vsa_cubes": m_cubes,
                     "vsa_topk": topk(sparsity, m_cubes), "vsa_us_per_kept_cube_pair_per_head": per_pair * 1e6},
        "projected": {"model": args.model, "grid": grid, "tokens": s, "cubes": c, "topk": topk(sparsity, c),
                      "per_block_linear_s": linear, "per_block_attention_dense_s": attn_dense,
                      "per_block_attention_vsa_s": attn_vsa,
                      "step_dense_s": blocks * (linear + attn_dense), "step_vsa_s": blocks * (linear + attn_vsa)},
    }
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
