"""FastH3 in diffusers, end to end on a tiny MiniMax-H3 transformer (random weights, runs anywhere).

    python examples/diffusers_fasth3_tiny.py                 # solattn.best_device(): cuda > xpu > mps > cpu
    python examples/diffusers_fasth3_tiny.py --device cpu

Builds diffusers' own MiniMaxH3Transformer3DModel at a tiny size (2 blocks, 2 heads of 128), writes
random gate projections to a safetensors file in FastH3's naming (as a FastH3 checkpoint holds them),
lays out one first-frame-to-video request with diffusers' own layout step, then runs the transformer
dense, as FastH3 (solattn.integrations.diffusers.enable_fasth3) and dense again after disable.
With a real checkpoint, replace the model and the gate file by the pipeline's transformer and the
FastH3 transformer folder (docs/diffusers.md).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from diffusers import MiniMaxH3Transformer3DModel
from diffusers.modular_pipelines.minimax_h3.before_denoise import (MiniMaxH3PrepareLayoutStep,
                                                                   MiniMaxH3SetTimestepsStep)
from safetensors.torch import save_file

import solattn
from solattn.integrations.diffusers import disable, enable_fasth3

HIDDEN, HEADS, HEAD_DIM, LAYERS = 64, 2, 128, 2


def tiny_transformer(device):
    torch.manual_seed(0)
    return MiniMaxH3Transformer3DModel(
        num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, hidden_size=HIDDEN, num_layers=LAYERS,
        num_refiner_layers=1, ffn_dim=128, in_channels=4, audio_in_channels=8, patch_size=(1, 2, 2),
        text_dim=32, freq_dim=32, time_embed_hidden_dim=64, time_embed_dim=32).to(device).eval()


def request(device, frames=4, latent_hw=32, text=40, audio_latents=20, video_timestep=0.5):
    """The transformer's arguments for one request: [text | keyframe | audio | video] rows."""
    tags = torch.ones(text, dtype=torch.long)
    pos, tags, video, audio, text_rows, cond_video, cond_audio = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        tags, frames, latent_hw, latent_hw, audio_latents, (1, 2, 2), 2, 2, 0, ("first",))
    timestep, rows = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video, audio, cond_video, cond_audio, text, video_timestep, video_timestep, 0.999, 1.0)
    g = torch.Generator().manual_seed(1)
    args = dict(hidden_states=torch.randn(1, video.numel(), 16, generator=g),
                audio_hidden_states=torch.randn(1, audio.numel(), 8, generator=g),
                encoder_hidden_states=torch.randn(1, text, 32, generator=g), timestep=timestep,
                timestep_indices=rows, token_tags=tags, position_ids=pos, video_indices=video,
                audio_indices=audio, text_indices=text_rows)
    return {k: v.to(device) for k, v in args.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=str(solattn.best_device()))
    parser.add_argument("--sparsity", type=float, default=0.9)
    args = parser.parse_args()
    device = torch.device(args.device)
    transformer = tiny_transformer(device)             # fp32: a real pipeline loads bf16 weights
    inputs = request(device)

    with tempfile.TemporaryDirectory() as folder:              # stands in for FastH3's transformer folder
        g = torch.Generator().manual_seed(2)
        save_file({f"transformer_blocks.{i}.attn.to_gate_compress.weight":
                   torch.randn(HEADS * HEAD_DIM, HIDDEN, generator=g) * 0.125 for i in range(LAYERS)},
                  str(Path(folder) / "diffusion_pytorch_model.safetensors"))
        with torch.no_grad():
            dense = transformer(**inputs, return_dict=False)[0]
            enable_fasth3(transformer, folder, sparsity=args.sparsity)
            start = time.perf_counter()
            sparse = transformer(**inputs, return_dict=False)[0]
            seconds = time.perf_counter() - start
            disable(transformer)
            again = transformer(**inputs, return_dict=False)[0]

    state = f"{tuple(sparse.shape)} {sparse.dtype} on {device}"
    print(f"FastH3 (sparsity {args.sparsity:g}): video velocity {state} in {seconds * 1e3:.0f} ms")
    print(f"relative difference to the dense model: {float((sparse - dense).norm() / dense.norm()):.3g}")
    print(f"after disable, equal to the dense model: {torch.equal(again, dense)}")


if __name__ == "__main__":
    main()
