"""Fine-tune a small attention layer through video sparse attention and watch the loss fall.

    python examples/finetune_vsa.py                           # grid (4, 8, 8), 4 heads, D = 32
    python examples/finetune_vsa.py --grid 8 16 16 --steps 60 --device cuda

A "teacher" attention layer (random q/k/v/o projections, dense attention) maps a smooth video
latent to targets; a "student" layer of the same shape starts from other weights and is trained
with Adam to match them, its attention being ``solattn.video_sparse_attn`` (VSA selection with a
learned coarse gate). Gradients reach the projections and the gate through solattn's backward:
on CUDA the triton backend's fused backward, elsewhere the portable recomputation. Runs on
solattn.best_device() by default (fp32 on the CPU; on a GPU the layer keeps fp32 weights and
attention runs in bf16). Prints the loss every few steps; ``main()`` returns the loss curve.
"""

from __future__ import annotations

import argparse
import math
from typing import List, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

import solattn


class Attention(nn.Module):
    """Multi-head self-attention on ``(B, N, C)`` tokens of a ``grid`` video latent; ``sparse``
    attends through ``video_sparse_attn`` with a sigmoid gate on its coarse branch."""

    def __init__(self, channels: int, heads: int, grid, sparse: bool, sparsity: float = 0.5,
                 attn_dtype: torch.dtype = torch.float32, backend: Optional[str] = None):
        super().__init__()
        self.backend = backend
        self.heads, self.grid, self.sparse, self.sparsity = heads, tuple(grid), sparse, sparsity
        self.attn_dtype = attn_dtype
        self.qkv = nn.Linear(channels, 3 * channels)
        self.gate = nn.Linear(channels, channels) if sparse else None
        self.out = nn.Linear(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, C // self.heads).unbind(2)   # (B, N, H, D)
        if self.sparse:
            gate = torch.sigmoid(self.gate(x)).view(B, N, self.heads, C // self.heads)
            q, k, v, gate = (t.to(self.attn_dtype) for t in (q, k, v, gate))
            o = solattn.video_sparse_attn(q, k, v, self.grid, sparsity=self.sparsity, gate=gate,
                                          backend=self.backend)
        else:
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2)).transpose(1, 2)
        return self.out(o.reshape(B, N, C).to(x.dtype))


def smooth_latent(grid, channels: int, generator: torch.Generator) -> torch.Tensor:
    """``(1, t*h*w, channels)``: random Fourier features of each token's position (nearby tokens
    look alike, as in a video latent) plus a little noise."""
    t, h, w = grid
    pos = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"),
                      dim=-1).reshape(-1, 3).float()
    freq = torch.randn(3, channels, generator=generator) / torch.tensor([1.5, 3.0, 3.0])[:, None]
    phase = 2 * math.pi * torch.rand(channels, generator=generator)
    x = math.sqrt(2.0) * torch.cos(pos @ freq + phase)
    return (x + 0.1 * torch.randn(x.shape, generator=generator))[None]


def main(argv: Optional[Sequence[str]] = None) -> List[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", type=int, nargs=3, default=[4, 8, 8], metavar=("T", "H", "W"))
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=32, help="head dim")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--device", default=None, help="default: solattn.best_device()")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default=None, help="force a solattn backend (default: the device's first)")
    args = parser.parse_args(argv)

    device = torch.device(args.device) if args.device else solattn.best_device()
    # the triton backend takes bf16/fp16 only (on the CPU, under TRITON_INTERPRET=1, for tests)
    attn_dtype = torch.float32 if device.type == "cpu" and args.backend != "triton" else torch.bfloat16
    grid, C = tuple(args.grid), args.heads * args.dim
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    teacher = Attention(C, args.heads, grid, sparse=False).to(device)
    student = Attention(C, args.heads, grid, sparse=True, sparsity=args.sparsity, attn_dtype=attn_dtype,
                        backend=args.backend).to(device)
    for p in teacher.parameters():
        p.requires_grad_(False)
    inputs = torch.cat([smooth_latent(grid, C, gen) for _ in range(args.batch)]).to(device)
    with torch.no_grad():
        targets = teacher(inputs)
    opt = torch.optim.Adam(student.parameters(), lr=args.lr)
    print(f"fine-tuning through video_sparse_attn on {device.type}: grid {grid} = {inputs.shape[1]} tokens, "
          f"{args.heads} heads x {args.dim}, sparsity {args.sparsity}, attention in "
          f"{str(attn_dtype).replace('torch.', '')}")
    losses = []
    for step in range(args.steps):
        loss = F.mse_loss(student(inputs), targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {losses[-1]:.5f}")
    print(f"loss {losses[0]:.5f} -> {losses[-1]:.5f} ({losses[-1] / losses[0]:.2f}x) in {args.steps} steps")
    return losses


if __name__ == "__main__":
    main()
