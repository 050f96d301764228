"""The attention-override path: ``transformer_options["optimized_attention_override"]`` running
:func:`solattn.sol_attn` on self-attention calls (any model; sol-attn / sla on MiniMax-H3), and the
dense fallback both paths share."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ...op import sol_attn
from ...validation import validate
from .state import SparseAttention

OVERRIDE_KEY = "optimized_attention_override"


def dense_attention(previous, func, q, k, v, heads, preferred=None, **kwargs):
    """The attention that was there before: the override installed earlier (handed every keyword
    ComfyUI passed), else the checkpoint's own attention choice (``preferred_attention=``, or
    ``preferred``: the H3 block's ``comfy_attention``) when it has a function, else ComfyUI's
    attention function."""
    if previous is not None:
        return previous(func, q, k, v, heads, **kwargs)
    chosen = kwargs.pop("preferred_attention", None) or preferred
    function = getattr(chosen, "function", None)
    return (func if function is None else function)(q, k, v, heads, **kwargs)


def comfy_layout(out: torch.Tensor, skip_output_reshape: bool) -> torch.Tensor:
    """solattn's ``(B, N, H, D)`` output in the layout ComfyUI's attention function returns:
    ``(B, H, N, D)`` with ``skip_output_reshape``, else ``(B, N, H * D)``."""
    if skip_output_reshape:
        return out.transpose(1, 2)
    return out.flatten(2)


def make_override(state: SparseAttention, previous: Optional[Callable]) -> Callable:
    """An ``optimized_attention_override`` running ``sol_attn``; declined calls run ``previous``
    (the override that was on the hook) or the attention ComfyUI would have run."""
    s = state.settings

    def override(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                 skip_output_reshape=False, **kwargs):
        opts = kwargs.get("transformer_options") or {}

        def dense():
            return dense_attention(previous, func, q, k, v, heads, preferred=state.preferred_attention(opts),
                                   mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                                   skip_output_reshape=skip_output_reshape, **kwargs)

        if mask is not None:
            state.note("mask", "dense: masked attention call (solattn takes no attention mask)")
            return dense()
        if kwargs.get("enable_gqa", False):
            state.note(("gqa", tuple(q.shape), tuple(k.shape)),
                       f"dense: grouped keys (q {tuple(q.shape)}, k {tuple(k.shape)}: enable_gqa)")
            return dense()
        if q.shape != k.shape or q.shape != v.shape:
            state.note(("cross", tuple(q.shape), tuple(k.shape)),
                       f"dense: cross-attention (q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)})")
            return dense()
        if skip_reshape:                                     # (B, H, N, D)
            tokens = q.shape[2]
            qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
        else:                                                # (B, N, H * D)
            _, tokens, inner = q.shape
            if inner % heads:
                state.note("heads", f"dense: inner dim {inner} is not divisible by {heads} heads")
                return dense()
            dim_head = inner // heads
            qs, ks, vs = (t.unflatten(-1, (heads, dim_head)) for t in (q, k, v))
        reason = state.dense_reason(opts, tokens, opts.get("block_index"))
        if reason is not None:
            state.note(*reason)
            return dense()
        sink_blocks, sink_q = state.sinks(opts, tokens)
        call = dict(tau=s.tau, scale=kwargs.get("scale"), sink_blocks=sink_blocks, sink_q=sink_q,
                    topk_ratio=s.topk_ratio)
        out = state.run_or_note(qs, lambda: validate(qs, ks, vs, **call), lambda: sol_attn(qs, ks, vs, **call))
        if out is None:
            return dense()
        state.note(("sparse", tuple(qs.shape), qs.device.type),
                   f"{s.method} on {tuple(qs.shape)} {qs.dtype} {qs.device.type}"
                   + (f", sinks {sink_blocks}/{sink_q}" if sink_blocks else ""))
        return comfy_layout(out, skip_output_reshape)

    override.solattn_state = state
    return override


def install_override(state: SparseAttention, transformer_options: dict, at_step: bool = False):
    """Put ``state``'s override on top of the hook (idempotent once it is on top). Run before every
    step too (``at_step``), so that a node applied later cannot silently replace it: its override
    then runs for the calls this one keeps dense, and one line says so."""
    current = transformer_options.get(OVERRIDE_KEY)
    if getattr(current, "solattn_state", None) is state:
        return
    if at_step and current is not None:
        state.note("later_override", "an attention override installed after this node (a node applied "
                                     "later) would have replaced it; this node stays on top and hands "
                                     "it the calls it keeps dense", always=True)
    transformer_options[OVERRIDE_KEY] = make_override(state, current)
