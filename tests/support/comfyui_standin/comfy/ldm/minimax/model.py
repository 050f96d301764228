"""A small MiniMax-H3-shaped DiT: packed [text | audio | video] rows, one joint self-attention
per block, the block-replacement protocol of ComfyUI's H3 model."""

import torch
import torch.nn as nn

from comfy.ldm.modules.attention import optimized_attention


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def apply_rope(x, freqs):
    """Split-half rope on the first ``freqs.shape[-1]`` channels of ``x`` (S, H, D)."""
    rot = freqs.shape[-1]
    half = rot // 2
    cos, sin = freqs.cos()[:, None, :half].to(x.dtype), freqs.sin()[:, None, :half].to(x.dtype)
    a, b, rest = x[..., :half], x[..., half:rot], x[..., rot:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], dim=-1)


class Attention(nn.Module):
    def __init__(self, hidden, heads, head_dim, gate_compress=False):
        super().__init__()
        self.heads = heads
        self.head_dim = head_dim
        inner = heads * head_dim
        self.qkv_proj = nn.Linear(hidden, inner * 3, bias=False)
        self.q_norm = RMSNorm(head_dim)
        self.k_norm = RMSNorm(head_dim)
        self.out_proj = nn.Linear(inner, hidden, bias=False)
        self.to_gate_compress = nn.Linear(hidden, inner, bias=False) if gate_compress else None

    def project(self, x, rope_freqs=None):
        """(S, hidden) -> q, k, v of shape (S, H, D), normalised and roped."""
        s = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.heads * self.head_dim, dim=-1)
        q = self.q_norm(q.view(s, self.heads, self.head_dim))
        k = self.k_norm(k.view(s, self.heads, self.head_dim))
        v = v.view(s, self.heads, self.head_dim)
        if rope_freqs is not None:
            q, k = apply_rope(q, rope_freqs), apply_rope(k, rope_freqs)
        return q, k, v

    def forward(self, x, rope_freqs=None, transformer_options={}):
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in self.project(x, rope_freqs))
        out = optimized_attention(q, k, v, self.heads, mask=None, skip_reshape=True,
                                  transformer_options=transformer_options)
        return self.out_proj(out.squeeze(0))


class DiTBlock(nn.Module):
    def __init__(self, hidden, heads, head_dim, gate_compress=False):
        super().__init__()
        self.norm1 = RMSNorm(hidden)
        self.norm2 = RMSNorm(hidden)
        self.attn = Attention(hidden, heads, head_dim, gate_compress=gate_compress)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))

    def forward(self, x, t_emb, mod_segments, rope_freqs, transformer_options={}, attention=None):
        attention = self.attn if attention is None else attention
        x = x + attention(self.norm1(x), rope_freqs=rope_freqs, transformer_options=transformer_options)
        return x + self.mlp(self.norm2(x))


class PackedLayout:
    """Segments ``(start, stop, kind)`` in packed order, ``signature`` and ``seq_len``."""

    def __init__(self, text_len, latent_t, latent_h, latent_w, audio_t):
        lengths = [("text", text_len), ("audio", 2 * audio_t), ("video", latent_t * (latent_h // 2) * (latent_w // 2))]
        self.segments, off = [], 0
        for kind, n in lengths:
            self.segments.append((off, off + n, kind))
            off += n
        self.seq_len = off
        self.signature = (text_len, latent_t, latent_h, latent_w, audio_t)


class MiniMaxH3Model(nn.Module):
    def __init__(self, hidden=64, heads=2, head_dim=32, layers=2, rope_dim=16, gate_compress=True):
        super().__init__()
        self.patch_size = (1, 2, 2)
        self.rope_dim = rope_dim
        self.blocks = nn.ModuleList([DiTBlock(hidden, heads, head_dim, gate_compress) for _ in range(layers)])

    def rope_freqs(self, seq_len, device):
        pos = torch.arange(seq_len, dtype=torch.float32, device=device)[:, None]
        inv = 1.0 / (100.0 ** (torch.arange(self.rope_dim // 2, device=device) / (self.rope_dim // 2)))
        half = pos * inv[None]
        return torch.cat([half, half], dim=-1)

    def forward(self, h, layout, transformer_options={}):
        """``h``: (seq_len, hidden) packed rows; returns the rows after every block."""
        transformer_options["minimax_h3_layout"] = layout
        rope_freqs = self.rope_freqs(layout.seq_len, h.device)
        blocks_replace = transformer_options.get("patches_replace", {}).get("dit", {})
        for i, block in enumerate(self.blocks):
            transformer_options["block_index"] = i
            if ("double_block", i) in blocks_replace:
                def block_wrap(args, block=block):
                    return {"img": block(args["img"], args["t_emb"], args["mod_segments"], args["rope_freqs"],
                                         transformer_options=args["transformer_options"],
                                         attention=args.get("attention"))}
                h = blocks_replace[("double_block", i)](
                    {"img": h, "t_emb": None, "mod_segments": None, "rope_freqs": rope_freqs,
                     "layout": layout, "transformer_options": transformer_options},
                    {"original_block": block_wrap})["img"]
            else:
                h = block(h, None, None, rope_freqs, transformer_options=transformer_options)
        return h
