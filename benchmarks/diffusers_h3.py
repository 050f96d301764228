"""FastH3 in diffusers against diffusers' dense attention: one step of a tiny MiniMax-H3, and
MiniMax-H3's attention and one transformer block at its real size.

    python benchmarks/diffusers_h3.py              # on solattn.best_device(); H3's size, bf16 (a GPU)
    python benchmarks/diffusers_h3.py --small      # a small size that runs on the CPU in minutes

Rows (each timed dense, i.e. the model's own processor through diffusers' attention dispatch
with its default backend, and with ``solattn.integrations.diffusers.enable_fasth3``):

- ``tiny model step``: one forward of a 2-block MiniMaxH3Transformer3DModel (2 heads of 128) on
  a first-frame request laid out by diffusers' own layout step (text 40 | keyframe | audio 40 |
  video 4x16x16);
- ``attention core``: q, k, v, gate of B=1, 56 heads, D=128, a 432-row prefix and a 16x48x48
  latent grid after patching (T = 37296), bf16: ``dispatch_attention_fn`` against
  ``video_sparse_attn`` (sparsity 0.9, exempt prefix, gated coarse branch);
- ``one H3 block``: a MiniMaxH3Transformer3DModel with one block at H3's width (hidden 5376,
  56 heads of 128, FFN 14336), random weights, on that sequence ([text 432 | video 16x48x48]).

The error column is the relative L2 distance of the FastH3 result to the same computation in
fp32 through solattn's ``sdpa`` backend (the fp32 definition; the tiny model and the block run
as fp32 copies). Writes ``benchmarks/results/<device>/diffusers_h3.md``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import solattn  # noqa: E402
from diffusers import MiniMaxH3Transformer3DModel  # noqa: E402
from diffusers.models.attention_dispatch import dispatch_attention_fn  # noqa: E402
from diffusers_fasth3_tiny import request, tiny_transformer  # noqa: E402
from solattn.bench.report import publish, source_revision  # noqa: E402
from solattn.bench.timing import log, time_calls  # noqa: E402
from solattn.integrations.diffusers import enable_fasth3  # noqa: E402
from solattn.testing import rel_l2  # noqa: E402

SPARSITY = 0.9


def device_folder(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).split()[-1].lower()     # "NVIDIA H200" -> "h200"
    return device.type


def random_gates(model, scale):
    g = torch.Generator().manual_seed(3)
    return {f"transformer_blocks.{i}.attn.to_gate_compress.weight":
            torch.randn(b.attn.to_q.out_features, b.attn.to_q.in_features, generator=g) * scale
            for i, b in enumerate(model.transformer_blocks)}


def packed_args(prefix: int, grid, hidden_in: int, text_dim: int, device):
    """Arguments of a [text prefix | video grid] request (no audio), position_ids in raster order."""
    t, h, w = grid
    video = t * h * w
    pos = torch.zeros(prefix + video, 3, dtype=torch.float64)
    pos[:prefix, 0] = torch.arange(prefix, dtype=torch.float64)
    pos[prefix:] = torch.cartesian_prod(*(torch.arange(n, dtype=torch.float64) for n in grid))
    pos[prefix:, 0] += prefix
    g = torch.Generator().manual_seed(4)
    args = dict(hidden_states=torch.randn(1, video, hidden_in, generator=g),
                audio_hidden_states=torch.randn(1, 0, 32), encoder_hidden_states=torch.randn(1, prefix, text_dim, generator=g),
                timestep=torch.tensor([0.5]), timestep_indices=torch.zeros(prefix + video, dtype=torch.long),
                token_tags=torch.cat([torch.ones(prefix, dtype=torch.long), torch.zeros(video, dtype=torch.long)]),
                position_ids=pos, video_indices=torch.arange(prefix, prefix + video),
                audio_indices=torch.zeros(0, dtype=torch.long), text_indices=torch.arange(prefix))
    return {k: v.to(device) for k, v in args.items()}


def timed(fn, device, repeats, warmup):
    return statistics.median(time_calls(fn, device, repeats, warmup))


def model_row(name, build, args, gate_scale, device, dtype, repeats, warmup):
    """Dense vs FastH3 forward of ``build()``'s model, and FastH3's error to an fp32 sdpa copy."""
    model = build().to(device)
    reference = copy.deepcopy(model).float()
    if dtype != torch.float32:
        model = model.to(dtype)
    gates = random_gates(model, gate_scale)
    with torch.no_grad():
        dense_ms = timed(lambda: model(**args, return_dict=False), device, repeats, warmup)
        enable_fasth3(model, gates, sparsity=SPARSITY)
        out = model(**args, return_dict=False)[0]
        sparse_ms = timed(lambda: model(**args, return_dict=False), device, repeats, warmup)
        del model
        enable_fasth3(reference, gates, sparsity=SPARSITY)
        with solattn.use_backend("sdpa"):
            want = reference(**args, return_dict=False)[0]
    return dict(name=name, dense=dense_ms, sparse=sparse_ms, error=rel_l2(out.float(), want))


def attention_row(prefix, grid, heads, device, dtype, repeats, warmup):
    T = prefix + grid[0] * grid[1] * grid[2]
    g = torch.Generator(device="cpu").manual_seed(5)
    q, k, v, gate = (torch.randn(1, T, heads, 128, generator=g).to(device, dtype) for _ in range(4))
    vsa = dict(sparsity=SPARSITY, gate=gate, prefix_len=[prefix])
    dense_ms = timed(lambda: dispatch_attention_fn(q, k, v), device, repeats, warmup)
    out = solattn.video_sparse_attn(q, k, v, grid, **vsa)
    sparse_ms = timed(lambda: solattn.video_sparse_attn(q, k, v, grid, **vsa), device, repeats, warmup)
    want = solattn.video_sparse_attn(*(x.float() for x in (q, k, v)), grid, sparsity=SPARSITY, gate=gate.float(),
                                     prefix_len=[prefix], backend="sdpa")
    return dict(name=f"attention core, B=1 H={heads} D=128 T={T}", dense=dense_ms, sparse=sparse_ms,
                error=rel_l2(out.float(), want))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=str(solattn.best_device()))
    parser.add_argument("--small", action="store_true", help="a CPU-sized geometry (prefix 100, grid 4x16x16, 4 heads)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out", default=None, help="report path (default benchmarks/results/<device>/diffusers_h3.md)")
    a = parser.parse_args()
    device = torch.device(a.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    repeats = a.repeats or (2 if device.type == "cpu" else 10)
    warmup = 1 if device.type == "cpu" else 3
    if a.small:
        prefix, grid, heads, hidden, ffn = 100, (4, 16, 16), 4, 512, 1024
    else:
        prefix, grid, heads, hidden, ffn = 432, (16, 48, 48), 56, 5376, 14336

    rows = []
    log("tiny model step")
    tiny_args = request(device)
    rows.append(model_row(f"tiny model step (2 blocks, 2 heads, T={tiny_args['position_ids'].shape[0]})",
                          lambda: tiny_transformer("cpu"), tiny_args, 0.125, device, dtype, repeats, warmup))
    log("attention core")
    rows.append(attention_row(prefix, grid, heads, device, dtype, repeats, warmup))
    log("one block")

    def one_block():
        torch.manual_seed(0)
        with torch.device(device):               # built where it runs: H3's width is 1.5 B parameters
            return MiniMaxH3Transformer3DModel(num_attention_heads=heads, attention_head_dim=128, hidden_size=hidden,
                                               num_layers=1, num_refiner_layers=1, ffn_dim=ffn, text_dim=64).eval()

    rows.append(model_row(f"one H3 block (hidden {hidden}, {heads} heads, T={prefix + grid[0] * grid[1] * grid[2]})",
                          one_block, packed_args(prefix, grid, 96, 64, device), hidden ** -0.5, device, dtype,
                          repeats, warmup))

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    lines = ["# FastH3 in diffusers: solattn VSA against diffusers' dense attention", "",
             f"- device: {device} ({name}); dtype {str(dtype).replace('torch.', '')}; torch {torch.__version__}",
             f"- solattn {source_revision()}; sparsity {SPARSITY} (exempt prefix, gated coarse branch)",
             f"- geometry: prefix {prefix}, grid {grid}, {heads} heads of 128" + (" (--small)" if a.small else ""),
             f"- median of {repeats} timed calls after {warmup} warm-up"
             + (f"; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at the end"
                if hasattr(os, "getloadavg") else ""), "",
             "| case | dense ms | FastH3 ms | speed-up | rel. L2 error to the fp32 definition |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['dense']:.2f} | {r['sparse']:.2f} | {r['dense'] / r['sparse']:.2f}x | "
                     f"{r['error']:.2e} |")
    lines += ["", "Dense: diffusers' own processor and `dispatch_attention_fn` (default backend). FastH3: "
              "`enable_fasth3` (sparse attention through solattn's dispatch). The model rows time whole "
              "forwards (projections, FFN and the rest included)."]
    if a.small:
        lines += ["", "`--small` checks that the script runs end to end; at this size the sparse call's "
                  "fixed costs (layout, plan) dominate, so its timings say nothing about H3's size."]
    out = a.out or str(ROOT / "benchmarks" / "results" / device_folder(device) / "diffusers_h3.md")
    publish(lines, out)


if __name__ == "__main__":
    main()
