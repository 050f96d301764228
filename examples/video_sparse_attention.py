"""Video sparse attention on a small smooth video latent: error against dense attention and speed-up.

    python examples/video_sparse_attention.py                  # grid (8, 16, 16), 4 heads, D = 64
    python examples/video_sparse_attention.py --grid 16 32 32  # bigger: the sparse win grows with T

q and k are random Fourier features of the token's (t, h, w) position, so q_s . k_u is
approximately a Gaussian kernel of the distance between s and u: attention is local in space and
time, as in a real video model, and selecting the best-scoring cubes captures most of it. v is a
smooth field plus a little noise. Runs on solattn.best_device() (fp32 on the CPU, bf16 elsewhere).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

import solattn
from solattn.routing import vsa_topk_from_sparsity


def smooth_features(grid, heads, dim, length_scale, gain, generator):
    """``(1, t*h*w, heads, dim)``: ``gain * sqrt(2/dim) cos(w . p + b)`` with ``w ~ N(0, 1/length^2)``,
    so that ``x_s . x_u ~= gain^2 exp(-|p_s - p_u / length|^2 / 2)``."""
    t, h, w = grid
    pos = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"),
                      dim=-1).reshape(-1, 3).float()                                   # (N, 3) raster order
    freqs = torch.randn(heads, 3, dim, generator=generator) / torch.tensor(length_scale)[None, :, None]
    phase = 2 * math.pi * torch.rand(heads, 1, dim, generator=generator)
    feats = math.sqrt(2.0 / dim) * torch.cos(pos[None] @ freqs + phase)                # (heads, N, dim)
    return (gain * feats).permute(1, 0, 2)[None]                                        # (1, N, heads, dim)


def timed(fn, repeats, device):
    fn()  # warm-up (plan caches, kernels)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return out, sorted(times)[len(times) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", type=int, nargs=3, default=[8, 16, 16], metavar=("T", "H", "W"))
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default=None, help="default: solattn.best_device()")
    args = parser.parse_args()

    device = torch.device(args.device) if args.device else solattn.best_device()
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    grid, H, D = tuple(args.grid), args.heads, args.dim
    gen = torch.Generator().manual_seed(0)
    noise = lambda x, s: x + s * torch.randn(x.shape, generator=gen)                   # noqa: E731
    # keys and queries share the positional features (plus a little noise): local attention
    qk = smooth_features(grid, H, D, length_scale=(1.5, 3.0, 3.0), gain=10.0, generator=gen)
    q = noise(qk, 0.3)
    k = noise(qk, 0.3)
    v = noise(smooth_features(grid, H, D, length_scale=(2.0, 4.0, 4.0), gain=4.0, generator=gen), 0.1)
    q, k, v = (x.to(device=device, dtype=dtype).contiguous() for x in (q, k, v))
    N = q.shape[1]
    n_cubes = math.prod(-(-g // 4) for g in grid)

    def dense():
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return o.transpose(1, 2)

    with torch.no_grad():
        ref, t_dense = timed(dense, args.repeats, device)
        # the first plan-consuming backend of this device's priority list serves VSA calls
        backend = next((b["name"] for b in solattn.list_backends(device)
                        if b["available"] and solattn.dispatch.get_backend(b["name"]).uses_plan), "none")
        print(f"VSA on {device.type} (backend {backend}): grid {grid} = {N} tokens, {n_cubes} cubes, "
              f"H={H}, D={D}, {str(dtype).replace('torch.', '')}")
        print(f"dense attention: {t_dense * 1e3:.1f} ms")
        print(f"{'sparsity':>8}  {'kept':>7}  {'rel_L2_err':>10}  {'time_ms':>8}  {'speed-up':>8}")
        for sparsity in (0.5, 0.8, 0.9):
            topk = vsa_topk_from_sparsity(sparsity, n_cubes)          # FastVideo's count, in floats
            out, t_sparse = timed(lambda: solattn.video_sparse_attn(q, k, v, grid, sparsity=sparsity),
                                  args.repeats, device)
            err = float((out.double() - ref.double()).norm() / ref.double().norm())
            print(f"{sparsity:>8}  {f'{topk}/{n_cubes}':>7}  {err:>10.3e}  {t_sparse * 1e3:>8.1f}  "
                  f"{t_dense / t_sparse:>7.2f}x")


if __name__ == "__main__":
    main()
