"""A tiny FastWan-shaped Wan transformer saved in FastWan's own key layout, and FastVideo's VSA
definition computed independently in float64 (no solattn), for the diffusers and ComfyUI tests.

The layout is a FastWan ``transformer`` folder: diffusers' Wan keys (``blocks.{i}.attn1.to_q``,
``scale_shift_table`` ...) plus FastWan's gates ``blocks.{i}.to_gate_compress.{weight,bias}``
(``Linear(dim, dim)`` with a bias), and diffusers' ``config.json``.
"""

from __future__ import annotations

import json
import math
import os

import torch

#: 2 blocks of 2 heads x 128 (dim 256); text_dim 4096 and freq_dim 256 as Wan (ComfyUI's Wan
#: detection assumes both)
SHAPE = dict(blocks=2, heads=2, head_dim=128, ffn=512, text_dim=4096, freq_dim=256, channels=16)


def fastwan_state_dict(blocks=2, heads=2, head_dim=128, ffn=512, text_dim=4096, freq_dim=256, channels=16,
                       gate=True, seed=0):
    """Random weights under FastWan's diffusers-format key names; activations stay near unit
    scale, norms are ones, gates have random non-zero weights and biases."""
    gen = torch.Generator().manual_seed(seed)
    dim = heads * head_dim
    sd = {}

    def lin(prefix, out_f, in_f, gain=1.0):
        sd[f"{prefix}.weight"] = torch.randn(out_f, in_f, generator=gen) * (gain / math.sqrt(in_f))
        sd[f"{prefix}.bias"] = torch.randn(out_f, generator=gen) * 0.02

    sd["patch_embedding.weight"] = torch.randn(dim, channels, 1, 2, 2, generator=gen) / math.sqrt(channels * 4)
    sd["patch_embedding.bias"] = torch.zeros(dim)
    lin("condition_embedder.time_embedder.linear_1", dim, freq_dim)
    lin("condition_embedder.time_embedder.linear_2", dim, dim)
    lin("condition_embedder.time_proj", 6 * dim, dim, gain=0.1)
    lin("condition_embedder.text_embedder.linear_1", dim, text_dim)
    lin("condition_embedder.text_embedder.linear_2", dim, dim)
    for i in range(blocks):
        b = f"blocks.{i}"
        sd[f"{b}.scale_shift_table"] = torch.randn(1, 6, dim, generator=gen) / math.sqrt(dim)
        for attn in ("attn1", "attn2"):
            for proj in ("to_q", "to_k", "to_v"):
                lin(f"{b}.{attn}.{proj}", dim, dim)
            lin(f"{b}.{attn}.to_out.0", dim, dim, gain=0.5)
            sd[f"{b}.{attn}.norm_q.weight"] = torch.ones(dim)
            sd[f"{b}.{attn}.norm_k.weight"] = torch.ones(dim)
        sd[f"{b}.norm2.weight"] = torch.ones(dim)
        sd[f"{b}.norm2.bias"] = torch.zeros(dim)
        lin(f"{b}.ffn.net.0.proj", ffn, dim)
        lin(f"{b}.ffn.net.2", dim, ffn, gain=0.5)
        if gate:
            lin(f"{b}.to_gate_compress", dim, dim)
            sd[f"{b}.to_gate_compress.bias"] = torch.randn(dim, generator=gen) * 0.5
    sd["scale_shift_table"] = torch.randn(1, 2, dim, generator=gen) / math.sqrt(dim)
    lin("proj_out", channels * 4, dim)
    return {k: v.contiguous() for k, v in sd.items()}


def diffusers_config(blocks=2, heads=2, head_dim=128, ffn=512, text_dim=4096, freq_dim=256, channels=16, **_):
    return {"_class_name": "WanTransformer3DModel", "_diffusers_version": "0.35.0", "patch_size": [1, 2, 2],
            "num_attention_heads": heads, "attention_head_dim": head_dim, "in_channels": channels,
            "out_channels": channels, "text_dim": text_dim, "freq_dim": freq_dim, "ffn_dim": ffn,
            "num_layers": blocks, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6,
            "image_dim": None, "added_kv_proj_dim": None, "rope_max_seq_len": 1024}


def write_fastwan(folder, seed=0, state_dict=None, **shape):
    """A FastWan ``transformer`` folder: ``config.json`` and ``diffusion_pytorch_model.safetensors``."""
    from safetensors.torch import save_file
    shape = {**SHAPE, **shape}
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(diffusers_config(**shape), f)
    sd = fastwan_state_dict(**shape, seed=seed) if state_dict is None else state_dict
    save_file(sd, os.path.join(folder, "diffusion_pytorch_model.safetensors"))
    return folder


# -- FastVideo's VSA, float64, written out here ------------------------------------------------

def cube_members(grid, cube=(4, 4, 4)):
    """Token indices (raster order of the (t, h, w) grid) of each cube, cubes in t, h, w order;
    edge cubes hold only their live tokens."""
    t, h, w = grid
    index = torch.arange(t * h * w).reshape(t, h, w)
    members = []
    for a in range(0, t, cube[0]):
        for b in range(0, h, cube[1]):
            for c in range(0, w, cube[2]):
                members.append(index[a:a + cube[0], b:b + cube[1], c:c + cube[2]].reshape(-1))
    return members


def vsa_reference(q, k, v, gate, grid, sparsity):
    """FastVideo's Wan VSA on ``(B, S, H, D)``: means of each cube over its live tokens,
    ``S = qm km^T / sqrt(D)``; coarse ``softmax(S) vm`` broadcast to the cube's tokens; fine: every
    query attends the tokens of the ``max(1, min(ceil((1 - sparsity) * n), n))`` cubes with the
    highest S in its cube's row; out = fine + gate * coarse (gate None: fine only). float64."""
    q, k, v = (t.double() for t in (q, k, v))
    B, S, H, D = q.shape
    members = cube_members(grid)
    n = len(members)
    owner = torch.empty(S, dtype=torch.long)
    for j, m in enumerate(members):
        owner[m] = j
    qm = torch.stack([q[:, m].mean(1) for m in members], 1)          # (B, n, H, D)
    km = torch.stack([k[:, m].mean(1) for m in members], 1)
    vm = torch.stack([v[:, m].mean(1) for m in members], 1)
    scores = torch.einsum("bihd,bjhd->bhij", qm, km) / math.sqrt(D)   # (B, H, n, n)
    coarse = torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), vm)  # (B, n, H, D)
    topk = max(1, min(math.ceil((1 - sparsity) * n), n))
    keep = torch.zeros(B, H, n, n, dtype=torch.bool)
    keep.scatter_(-1, scores.topk(topk, dim=-1).indices, True)
    mask = keep[:, :, owner][:, :, :, owner]                          # (B, H, S, S) token level
    logits = torch.einsum("bshd,bthd->bhst", q, k) / math.sqrt(D)
    fine = torch.einsum("bhst,bthd->bshd", logits.masked_fill(~mask, float("-inf")).softmax(-1), v)
    if gate is None:
        return fine
    return fine + gate.double() * coarse[:, owner]


def dense_reference(q, k, v):
    q, k, v = (t.double() for t in (q, k, v))
    logits = torch.einsum("bshd,bthd->bhst", q, k) / math.sqrt(q.shape[-1])
    return torch.einsum("bhst,bthd->bshd", logits.softmax(-1), v)


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
