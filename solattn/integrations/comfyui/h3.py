"""MiniMax-H3 with vsa: every transformer block is replaced by a patch
(``patches_replace["dit"][("double_block", i)]``) that runs the block unchanged except for its
attention core, which :func:`solattn.video_sparse_attn` computes with the block's own gate
(``attn.to_gate_compress``) and the model's packed layout (``minimax_h3_layout``)."""

from __future__ import annotations

import math
from typing import Callable, Optional

from ...validation import validate
from ...op import video_sparse_attn
from .attention import OVERRIDE_KEY, comfy_layout, dense_attention
from .state import SparseAttention, video_segment

PATCH_KEY = "double_block"


def vsa_geometry(state: SparseAttention, layout, tokens: int):
    """``(grid, prefix segment lengths)`` of a packed H3 sequence, or a reason string."""
    if layout is None:
        return "no minimax_h3_layout in transformer_options"
    if getattr(layout, "seq_len", None) != tokens:
        return f"the layout describes {getattr(layout, 'seq_len', None)} rows, the call has {tokens}"
    video = video_segment(layout)
    if video is None or video[1] != tokens:
        return "the layout's video segment is not the single last segment"
    _, lat_t, lat_h, lat_w, _ = layout.signature
    pt, ph, pw = state.patch_size
    grid = (int(lat_t) // pt, int(lat_h) // ph, int(lat_w) // pw)
    if math.prod(grid) != video[1] - video[0]:
        return f"video segment of {video[1] - video[0]} rows does not match the latent grid {grid}"
    prefix = [b - a for a, b, kind in layout.segments if kind != "video" and b > a]
    return grid, prefix


def make_vsa_override(state: SparseAttention, previous, grid, prefix, gate, block_index, preferred) -> Callable:
    """The attention override of one block call: VSA on the packed self-attention."""
    s = state.settings

    def override(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                 skip_output_reshape=False, **kwargs):
        def dense():
            return dense_attention(previous, func, q, k, v, heads, preferred=preferred, mask=mask,
                                   attn_precision=attn_precision, skip_reshape=skip_reshape,
                                   skip_output_reshape=skip_output_reshape, **kwargs)

        if mask is not None or not skip_reshape or q.shape != k.shape or q.shape != v.shape:
            state.note(("vsa_call", block_index), f"dense: block {block_index} attention call is not the "
                                                  f"packed self-attention VSA expects (mask={mask is not None}, "
                                                  f"q {tuple(q.shape)}, k {tuple(k.shape)})")
            return dense()
        qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))          # (1, S, H, D)
        g = None if gate is None else gate.view(qs.shape)
        out = state.run_or_note(qs, lambda: validate(qs, ks, vs, scale=kwargs.get("scale")),
                                lambda: video_sparse_attn(qs, ks, vs, grid, sparsity=s.sparsity, gate=g,
                                                          scale=kwargs.get("scale"), prefix_len=prefix,
                                                          prefix_mode=s.vsa_prefix))
        if out is None:
            return dense()
        state.note(("vsa", grid, tuple(prefix), qs.device.type),
                   f"vsa on {qs.device.type}: grid {grid}, prefix segments {list(prefix)} "
                   f"({s.vsa_prefix}), keep {s.keep_percent:g}%, "
                   + ("gated coarse branch" if g is not None else "no to_gate_compress: fine only"))
        return comfy_layout(out, skip_output_reshape)

    return override


def make_block_patch(state: SparseAttention, block, block_index: int, previous: Optional[Callable] = None):
    """The ``("dit", "double_block", i)`` replacement: the original block, whose attention call gets
    the VSA override when this call is inside the sparse settings. ``previous``: another node's
    replacement of the same block; it runs in the original block's place (with the VSA attention
    in its ``args``), so that node's change is kept rather than silently replaced."""
    attn = block.attn

    def block_patch(args, extra):
        def run(block_args):
            return extra["original_block"](block_args) if previous is None else previous(block_args, extra)

        h, opts = args["img"], args["transformer_options"]
        tokens = h.shape[-2]
        reason = state.dense_reason(opts, tokens, block_index)
        geometry = None
        if reason is None:
            geometry = vsa_geometry(state, opts.get("minimax_h3_layout"), tokens)
            if isinstance(geometry, str):
                reason = "layout", f"dense: {geometry}"
        if reason is not None:
            state.note(*reason)
            return run(args)
        grid, prefix = geometry

        def attention(x, rope_freqs=None, transformer_options={}):
            proj = getattr(attn, "to_gate_compress", None)
            gate = None if proj is None else proj(x)
            override = make_vsa_override(state, transformer_options.get(OVERRIDE_KEY), grid, prefix, gate,
                                         block_index, getattr(attn, "comfy_attention", None))
            return attn(x, rope_freqs=rope_freqs, transformer_options={**transformer_options, OVERRIDE_KEY: override})

        return run({**args, "attention": attention})

    block_patch.solattn_state = state
    return block_patch


def install_block_patches(state: SparseAttention, blocks, dit_patches: dict) -> int:
    """Put ``state``'s patch on top of every block's entry of ``dit_patches`` (the ``"dit"`` dict of
    ``patches_replace``), wrapping another node's patch found there; returns how many it wrapped.
    Idempotent: a block whose top entry is already this state's is left alone."""
    wrapped = 0
    for i, block in enumerate(blocks):
        current = dit_patches.get((PATCH_KEY, i))
        if getattr(current, "solattn_state", None) is state:
            continue
        wrapped += current is not None
        dit_patches[(PATCH_KEY, i)] = make_block_patch(state, block, i, current)
    return wrapped
