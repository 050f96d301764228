"""A generic ComfyUI-style DiT (not H3): per block a self-attention on (B, N, H * D) through
``optimized_attention``, optionally masked, then a cross-attention to a text context."""

import torch.nn as nn

from comfy.ldm.modules.attention import optimized_attention


class CrossAttention(nn.Module):
    def __init__(self, dim, heads, context_dim=None):
        super().__init__()
        self.heads = heads
        context_dim = context_dim or dim
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(context_dim, dim, bias=False)
        self.to_v = nn.Linear(context_dim, dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x, context=None, mask=None, transformer_options={}):
        context = x if context is None else context
        out = optimized_attention(self.to_q(x), self.to_k(context), self.to_v(context), self.heads,
                                  mask=mask, transformer_options=transformer_options)
        return self.to_out(out)


class Block(nn.Module):
    def __init__(self, dim, heads, context_dim):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = CrossAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.attn2 = CrossAttention(dim, heads, context_dim)

    def forward(self, x, context, mask=None, transformer_options={}):
        x = x + self.attn1(self.norm1(x), mask=mask, transformer_options=transformer_options)
        return x + self.attn2(self.norm2(x), context=context, transformer_options=transformer_options)


class TinyDiT(nn.Module):
    def __init__(self, dim=128, heads=2, context_dim=48, layers=2):
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim, heads, context_dim) for _ in range(layers)])

    def forward(self, x, context, mask=None, transformer_options={}):
        for i, block in enumerate(self.blocks):
            transformer_options["block_index"] = i
            x = block(x, context, mask=mask, transformer_options=transformer_options)
        return x
